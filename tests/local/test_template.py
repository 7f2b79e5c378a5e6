"""The custom chat template: Qwen's, with the tool-call tags gone (served behaviour: test_local.py)."""

from __future__ import annotations

from pathlib import Path

from gateway.local.template import CHAT_TEMPLATE, TEMPLATE_FILENAME, write_template


def test_no_tool_call_tags_anywhere() -> None:
    assert "<tool_call>" not in CHAT_TEMPLATE and "</tool_call>" not in CHAT_TEMPLATE


def test_keeps_qwens_tool_sections() -> None:
    # Tools are still announced in <tools>, results still wrapped in <tool_response>, and past
    # calls are still replayed as {"name": ..., "arguments": ...} JSON.
    assert "<tools></tools> XML tags:\\n<tools>" in CHAT_TEMPLATE
    assert "<tool_response>" in CHAT_TEMPLATE
    assert """{{- '\\n{"name": "' }}""" in CHAT_TEMPLATE
    assert "<|im_start|>assistant\\n" in CHAT_TEMPLATE


def test_write_template_is_idempotent(tmp_path: Path) -> None:
    path = write_template(tmp_path / "cache")
    assert path == tmp_path / "cache" / TEMPLATE_FILENAME
    assert path.read_text() == CHAT_TEMPLATE
    before = path.stat().st_mtime_ns
    assert write_template(tmp_path / "cache") == path
    assert path.stat().st_mtime_ns == before, "an unchanged template is not rewritten"
    path.write_text("stale")
    write_template(tmp_path / "cache")
    assert path.read_text() == CHAT_TEMPLATE
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [TEMPLATE_FILENAME]


def test_the_gemma_template_offers_the_same_tools_in_gemma_turns(tmp_path: Path) -> None:
    from gateway.local.template import GEMMA_TEMPLATE, TEMPLATES

    assert "<start_of_turn>user" in GEMMA_TEMPLATE and "<start_of_turn>model\\n" in GEMMA_TEMPLATE
    assert "<tools></tools> XML tags:\\n<tools>" in GEMMA_TEMPLATE and "<tool_response>" in GEMMA_TEMPLATE
    assert "<|im_start|>" not in GEMMA_TEMPLATE and "<tool_call>" not in GEMMA_TEMPLATE
    path = write_template(tmp_path, "gemma")
    assert path.name == TEMPLATES["gemma"][0] and path.read_text() == GEMMA_TEMPLATE
