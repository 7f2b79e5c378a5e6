"""docs/trace-events.md and the trace's TypedDicts (gateway.harness.trace) name the same
kinds and the same fields: a kind or a field added on one side only fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest

from gateway.harness.trace import EVENT_KINDS, Event, EventKind, EventList, Tracer

DOC = Path(__file__).resolve().parents[2] / "docs" / "trace-events.md"
OPTIONAL = "*(optional)*"


def _sections(text: str) -> dict[str, str]:
    """Each `### `kind`` section's text, up to the next heading."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    out: dict[str, str] = {}
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        m = re.fullmatch(r"### `(\w+)`", heading.strip())
        if m:
            out[m.group(1)] = body
    return out


def _bullets(body: str) -> list[str]:
    """The head of each top-level bullet (what comes before its first `: `)."""
    return [line[2:].split(": ", 1)[0] for line in body.splitlines() if line.startswith("- ")]


def _documented() -> tuple[set[str], dict[str, tuple[set[str], set[str]]]]:
    """The fields every event has (the first table) and, per kind, (fields, optional fields)."""
    text = DOC.read_text()
    envelope = set(re.findall(r"^\| `(\w+)` \|", text.split("## ", 1)[0], flags=re.M))
    kinds: dict[str, tuple[set[str], set[str]]] = {}
    for kind, body in _sections(text).items():
        fields: set[str] = set()
        optional: set[str] = set()
        for head in _bullets(body):
            names = set(re.findall(r"`(\w+)`", head))
            fields |= names
            if OPTIONAL in head:
                optional |= names
        common = envelope - ({"ts"} if "has no `ts`" in body else set())
        kinds[kind] = (fields | common, optional)
    return envelope, kinds


def _typed() -> dict[str, tuple[set[str], set[str]]]:
    """Per kind, the keys of its TypedDict and the ones that are NotRequired."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for member in get_args(Event):
        (kind,) = get_args(get_type_hints(member)["type"])
        out[kind] = (set(member.__required_keys__) | set(member.__optional_keys__), set(member.__optional_keys__))
    return out


def test_the_doc_and_the_types_list_the_same_kinds() -> None:
    _, documented = _documented()
    assert sorted(documented) == sorted(EVENT_KINDS)
    assert sorted(_typed()) == sorted(EVENT_KINDS)


def test_every_event_has_the_documented_envelope() -> None:
    envelope, _ = _documented()
    assert envelope == {"runId", "type", "ts"}


@pytest.mark.parametrize("kind", EVENT_KINDS)
def test_each_kind_documents_exactly_its_fields(kind: EventKind) -> None:
    fields, optional = _documented()[1][kind]
    typed_fields, typed_optional = _typed()[kind]
    assert fields == typed_fields, (f"{kind}: only in docs/trace-events.md: {sorted(fields - typed_fields)}; "
                                    f"only in gateway/harness/trace.py: {sorted(typed_fields - fields)}")
    assert optional == typed_optional, f"{kind}: fields marked {OPTIONAL} differ from the NotRequired ones"


def test_the_doc_parser_sees_a_field_added_on_one_side() -> None:
    """The check above is not vacuous: a bullet the types lack shows up as a field."""
    body = "Fields:\n\n- `toolName`: the tool.\n- `extra` *(optional)*: new.\n  - `nested`: not a field.\n"
    assert _bullets(body) == ["`toolName`", "`extra` *(optional)*"]


def test_the_doc_examples_have_the_fields_of_their_kind() -> None:
    """Each JSON example line carries only fields of its kind, and all its required ones."""
    typed = _typed()
    for kind, body in _sections(DOC.read_text()).items():
        for block in re.findall(r"```json\n(.*?)```", body, flags=re.S):
            for line in block.splitlines():
                example: dict[str, Any] = json.loads(line)
                assert example["type"] == kind
                fields, optional = typed[kind]
                assert fields - optional <= set(example) <= fields, (kind, sorted(set(example) ^ fields))


def test_the_builder_writes_the_envelope_around_the_fields_in_order() -> None:
    sink = EventList()
    line = Tracer("r1", sink)("tool_result", toolName="read_file", ms=0.2, ok=True, callId="c1")
    assert list(line) == ["runId", "type", "toolName", "ms", "ok", "callId", "ts"]
    assert sink.events == [line]
    sub = Tracer("r1")("subrun_started", childRunId="r1.c1", toolName="research", callId="c1")
    assert list(sub) == ["runId", "type", "childRunId", "toolName", "callId"]  # the contract: no ts


def test_mypy_rejects_a_missing_or_misspelt_field(tmp_path: Path) -> None:
    """The point of the types: a builder call with a wrong field does not type-check."""
    from mypy import api

    probe = tmp_path / "probe.py"
    probe.write_text(
        "from gateway.harness.trace import Tracer\n"
        "trace = Tracer('r')\n"
        "trace('tool_start', toolName='t', args='{}', callId='c')\n"  # right
        "trace('tool_start', toolName='t', args='{}')\n"  # callId missing
        "trace('tool_result', toolName='t', ms=1.0, ok=True, callID='c')\n"  # misspelt
        "trace('tool_progress', toolName='t', label=3)\n"  # wrong type
    )
    out, _, status = api.run(["--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"),
                              "--python-version", "3.11", str(probe)])
    lines = sorted({int(m) for m in re.findall(r"probe\.py:(\d+): error", out)})
    assert status == 1 and lines == [4, 5, 6], out
