"""The name a GGUF file gives its model (`general.name`), read from the file's header.

Only the header's key/value section is read, key by key, stopping at the wanted key: the
`gguf` package's GGUFReader maps every tensor first (over a minute for a 0.5 GB file on a
loaded 2-core machine) to answer the same question. Every length is bounded, so a
corrupt or hostile file ends in `GGUFError`, never in a huge allocation.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Final

MAGIC: Final = b"GGUF"
MAX_KEY_BYTES: Final = 65_536
MAX_STRING_BYTES: Final = 16 << 20
MAX_ARRAY_ITEMS: Final = 16 << 20
_STRING, _ARRAY = 8, 9
# value type -> struct format of one value (strings and arrays are read apart)
_SCALARS: Final = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands; the message says why."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError("the file ends inside its header")
    return data


def _u32(f: BinaryIO) -> int:
    return int(struct.unpack("<I", _read(f, 4))[0])


def _u64(f: BinaryIO) -> int:
    return int(struct.unpack("<Q", _read(f, 8))[0])


def _string(f: BinaryIO, limit: int = MAX_STRING_BYTES) -> bytes:
    n = _u64(f)
    if n > limit:
        raise GGUFError(f"a string of {n} bytes in the header is beyond belief")
    return _read(f, n)


def _skip(f: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize("<" + _SCALARS[kind]), 1)
    elif kind == _STRING:
        f.seek(_u64(f), 1)
    elif kind == _ARRAY:
        item, count = _u32(f), _u64(f)
        if count > MAX_ARRAY_ITEMS:
            raise GGUFError(f"an array of {count} items in the header is beyond belief")
        if item in _SCALARS:
            f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        raise GGUFError(f"unknown value type {kind} in the header")


def header_string(path: Path, key: str) -> str | None:
    """The string value of `key` in the GGUF header at `path` (None if the header has no such string)."""
    wanted = key.encode()
    with path.open("rb") as f:
        if _read(f, 4) != MAGIC:
            raise GGUFError(f"{path.name} is not a GGUF file (no GGUF magic)")
        version = _u32(f)
        if version < 2:
            raise GGUFError(f"{path.name} is GGUF version {version}; versions 2 and later are read")
        _u64(f)  # tensor count
        for _ in range(_u64(f)):
            name = _string(f, MAX_KEY_BYTES)
            kind = _u32(f)
            if name == wanted and kind == _STRING:
                return _string(f).decode("utf-8", "replace")
            _skip(f, kind)
    return None


def model_name(path: Path) -> str | None:
    """`general.name` of the GGUF at `path`: the model the file says it holds."""
    return header_string(path, "general.name")
