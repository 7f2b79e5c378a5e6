"""Fixtures of the fault tests: a client session and a redis-server of the test's own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.faults.support import RedisProc


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        yield s


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProc]:
    """A redis-server this test may stop, freeze and restart (same port, append-only file)."""
    proc = RedisProc(tmp_path / "redis")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
