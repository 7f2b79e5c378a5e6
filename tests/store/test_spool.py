"""The spool keeps room of its own on its disk, and loses no record when the disk is full.

On a real tmpfs mounted for the test (skipped where mounting is not permitted), filled by a
file of the test's own: records still go into the spool's reserve; once the reserve cannot
be topped up, the spool says it is not intact; a record that does not fit waits in memory
and is written once space is free; a line torn by a crash never swallows the next record.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.store.errors import StoreError
from gateway.store.spool import Spool
from tests.support.disk import fill, small_disk

RESERVE = 256 * 1024
RECORD = {"run_id": "team/run", "transcript": ["x" * 2000]}  # some 2 KB a line


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", "2m") as folder:
        yield folder


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_the_reserve_is_allocated_at_open_and_again_once_everything_is_booked(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl", RESERVE)
    spool.open()
    assert spool.intact and spool.path.stat().st_size == 0 and allocated(spool.path) >= RESERVE
    ids = {spool.append(RECORD) for _ in range(3)}
    assert {r["id"] for r in spool.pending()} == ids
    assert allocated(spool.path) >= spool.path.stat().st_size + RESERVE  # topped up after each append
    first = spool.pending()[0]["id"]
    spool.drop({first})
    assert {r["id"] for r in spool.pending()} == ids - {first} and allocated(spool.path) >= RESERVE
    spool.drop(ids)
    assert spool.pending() == [] and spool.path.stat().st_size == 0 and allocated(spool.path) >= RESERVE
    assert spool.reservations() == set()


def test_records_go_into_the_reserve_of_a_full_disk(disk: Path) -> None:
    spool = Spool(disk / "spool.jsonl", RESERVE)
    spool.open()
    fill(disk / "filler")
    with pytest.raises(OSError):
        (disk / "other").write_bytes(b"x" * 10_000)  # the disk is full for everyone else
    for _ in range(40):  # some 80 KB: within the reserve
        spool.append({**RECORD, "booking": {"reservation_id": "r1"}})
    assert len(spool.pending()) == 40 and spool.reservations() == {"r1"}
    assert not spool.intact  # it could not be topped up again: calls are refused until it is
    assert not spool.condition.ok and "not intact" in spool.condition.detail
    (disk / "filler").unlink()
    assert spool.keep_reserve() and spool.intact and spool.condition.ok


def test_a_record_the_disk_cannot_take_waits_in_memory(disk: Path) -> None:
    spool = Spool(disk / "spool.jsonl", 8 * 1024)
    spool.open()
    fill(disk / "filler")
    written = 0
    with pytest.raises(StoreError):
        for _ in range(100):  # past the reserve
            spool.append(RECORD)
            written += 1
    assert not spool.intact and spool.has_pending()
    assert len(spool.pending()) == written + 1  # the one kept in memory is pending too
    (disk / "filler").unlink()
    spool.write_unwritten()
    assert spool.intact and len(Spool(spool.path).pending()) == written + 1  # on disk now, for any process


def test_a_line_torn_by_a_crash_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl", RESERVE)
    spool.open()
    kept = spool.append(RECORD)
    with spool.path.open("ab") as fh:
        fh.write(b'{"run_id": "team/torn", "transcr')  # the process died mid-write
    after = spool.append(RECORD)
    assert [r["id"] for r in spool.pending()] == [kept, after]
