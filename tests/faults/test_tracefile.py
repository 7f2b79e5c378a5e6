"""Trace file rotation on real files: the newest lines stay in the live file, `keep` old ones."""

from __future__ import annotations

from pathlib import Path

import orjson

from gateway.store import tracefile


def lines(path: Path) -> list[int]:
    return [orjson.loads(line)["n"] for line in path.read_bytes().splitlines()] if path.exists() else []


def test_rotation_keeps_the_newest_files_in_order(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    tracefile.configure(path, 40, keep=2)  # each line is 9 bytes: a rotation every 5 lines
    try:
        for n in range(23):
            tracefile.append(path, [{"n": n}])
    finally:
        tracefile.configure(path, None, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl", "trace.jsonl.1", "trace.jsonl.2"]
    assert lines(tmp_path / "trace.jsonl.2") == [10, 11, 12, 13, 14]
    assert lines(tmp_path / "trace.jsonl.1") == [15, 16, 17, 18, 19]
    assert lines(path) == [20, 21, 22]


def test_keep_zero_drops_the_file_and_no_rule_never_rotates(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    tracefile.configure(path, 10, keep=0)
    try:
        tracefile.append(path, [{"n": 1}, {"n": 2}])
    finally:
        tracefile.configure(path, None, 0)
    assert list(tmp_path.iterdir()) == []
    for n in range(100):
        tracefile.append(path, [{"n": n}])
    assert lines(path) == list(range(100))
