"""Reading `general.name` from a GGUF header: files written here byte by byte to the GGUF v3
layout, plus the refusals of what is not one (no model, no llama.cpp needed)."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path

import pytest

from gateway.local.gguf import GGUFError, header_string, model_name


def _str(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(path: Path, strings: Mapping[str, str], *, before: bytes = b"", count_extra: int = 0) -> Path:
    """A header-only GGUF v3: `before` holds `count_extra` other key/values written ahead of `strings`."""
    kvs = b"".join(_str(k) + struct.pack("<I", 8) + _str(v) for k, v in strings.items())
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(strings) + count_extra) + before + kvs)
    return path


def test_the_name_is_found_after_values_of_every_kind(tmp_path: Path) -> None:
    others = (_str("general.alignment") + struct.pack("<II", 4, 32)
              + _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _str("a") + _str("bc")
              + _str("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0, 1, 2)
              + _str("qwen2.rope.freq_base") + struct.pack("<Id", 12, 1e6))
    path = write_gguf(tmp_path / "m.gguf", {"general.name": "Qwen2.5 Coder 0.5B Instruct AWQ"}, before=others,
                      count_extra=4)
    assert model_name(path) == "Qwen2.5 Coder 0.5B Instruct AWQ"
    assert header_string(path, "general.basename") is None


@pytest.mark.parametrize("data, words", [
    (b"GGML" + bytes(20), "not a GGUF file"),
    (b"GGUF" + struct.pack("<I", 1) + bytes(16), "version 1"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40), "beyond belief"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _str("k") + struct.pack("<I", 99), "unknown value type 99"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + _str("k"), "ends inside its header"),
])
def test_what_is_not_a_readable_header_is_refused_with_a_reason(tmp_path: Path, data: bytes, words: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=words):
        model_name(path)
