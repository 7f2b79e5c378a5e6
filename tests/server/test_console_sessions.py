"""Console sessions (issue 28 item 8) over plain HTTP against real gateway processes: the
cookie holds a random session id kept server-side in the store, never the key.

- a copied cookie no longer works after sign-out (on main it did: the cookie was the key);
- the cookie's value is not the key, and the store keeps only a hash of it;
- every replica knows a session (two processes on one store): signed in on one, used on the
  other, signed out on the other, refused on the first;
- revoking or rotating the key a session signed in with ends the session;
- a session ends after its idle time without use, and at its absolute expiry.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.store.keys import session_hash
from tests.server.test_admission import two_replicas, write_policies
from tests.support.procs import START_TIMEOUT_S, Proc, free_port, start_gateway

ROOT, DEMO = "sk-sess-root", "sk-sess-demo"
COOKIE = "gateway_console"
IDLE_S = 3.0


def start(folder: Path, _upstream: str, store: dict[str, Any]) -> Proc:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "store": store,
        "policies_dir": str(write_policies(folder.parent)),
        "upstreams": [{"name": "scripted", "kind": "scripted"}],
        "models": [{"match": "scripted-*", "upstream": "scripted"}],
        "console": {"session_idle_s": IDLE_S, "session_max_s": 3600},
        "teams": [{"name": "root", "keys": [ROOT], "admin": True, "policies": ["passthrough"]},
                  {"name": "demo", "keys": [DEMO], "policies": ["passthrough"]}],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return start_gateway(["serve", "--config", str(path), "--workers", "1"], "/healthz", port, folder / "gateway.log",
                         timeout=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Path]]:
    folder = tmp_path_factory.mktemp("sessions")
    store = {"kind": "sqlite", "path": str(folder / "gateway.db")}
    with two_replicas(start, folder, "", store) as (a, b):
        yield a, b, folder / "gateway.db"


async def sign_in(proc: Proc, key: str) -> tuple[str, str]:
    """(the cookie's value, the CSRF token) of a new console session."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
        async with s.post(f"{proc.url}/console/session", json={"key": key}) as resp:
            assert resp.status == 200, await resp.text()
            return resp.cookies[COOKIE].value, (await resp.json())["csrf_token"]


async def with_cookie(proc: Proc, cookie: str, method: str = "GET", path: str = "/console/session",
                      headers: dict[str, str] | None = None) -> int:
    """A request carrying a copied cookie (as another browser would send it)."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
        async with s.request(method, proc.url + path, headers={"Cookie": f"{COOKIE}={cookie}", **(headers or {})}
                             ) as resp:
            return resp.status


async def test_a_copied_cookie_stops_working_after_sign_out_on_every_replica(pair: tuple[Proc, Proc, Path]) -> None:
    a, b, db = pair
    cookie, csrf = await sign_in(a, DEMO)
    assert DEMO not in cookie and len(cookie) >= 32  # a random id, not the key
    assert await with_cookie(b, cookie) == 200  # the other replica knows the session
    with sqlite3.connect(db) as conn:
        stored = [row[0] for row in conn.execute("SELECT id_hash FROM console_sessions")]
    assert session_hash(cookie) in stored and cookie not in stored
    assert await with_cookie(b, cookie, "DELETE", headers={"X-CSRF-Token": csrf, "Origin": b.url}) == 200
    assert await with_cookie(a, cookie) == 401  # signed out on b: refused on a too
    assert await with_cookie(a, cookie, path="/console/api/runs") == 401


async def test_revoking_or_rotating_the_key_ends_its_sessions(pair: tuple[Proc, Proc, Path]) -> None:
    a, b, _ = pair
    async with aiohttp.ClientSession() as s:
        made: list[dict[str, Any]] = []
        for _ in range(2):
            async with s.post(f"{a.url}/v1/admin/keys", json={"team": "demo", "name": "console"},
                              headers={"Authorization": f"Bearer {ROOT}"}) as resp:
                assert resp.status == 201
                made.append(await resp.json())
        sessions = []
        for key in made:
            deadline = time.monotonic() + 5
            while True:  # the other replica learns the new key within its keyring's sync
                try:
                    sessions.append((await sign_in(b, key["key"]))[0])
                    break
                except AssertionError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
        assert [await with_cookie(a, c) for c in sessions] == [200, 200]
        async with s.delete(f"{a.url}/v1/admin/keys/{made[0]['id']}", headers={"Authorization": f"Bearer {ROOT}"}):
            pass
        async with s.post(f"{a.url}/v1/admin/keys/{made[1]['id']}/rotate", json={"grace_s": 60},
                          headers={"Authorization": f"Bearer {ROOT}"}) as resp:
            assert resp.status == 200
    for cookie in sessions:
        deadline = time.monotonic() + 5
        while await with_cookie(b, cookie) != 401:
            assert time.monotonic() < deadline, "a session outlived its key's revocation or rotation"
            await asyncio.sleep(0.05)  # polling: the replica learns from the store on its own clock


async def test_an_idle_session_ends(pair: tuple[Proc, Proc, Path]) -> None:
    a, b, _ = pair
    cookie, _ = await sign_in(a, DEMO)
    for _ in range(3):  # used within its idle time: it goes on
        await asyncio.sleep(IDLE_S / 3)
        assert await with_cookie(b, cookie) == 200
    deadline = time.monotonic() + 4 * IDLE_S
    while await with_cookie(a, cookie) == 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(IDLE_S + 0.5)  # left idle longer than its idle time
    assert await with_cookie(b, cookie) == 401
