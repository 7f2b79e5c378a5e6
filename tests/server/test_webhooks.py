"""Webhooks end to end: a real gateway process, a real receiver (an aiohttp server in the
test) that checks every signature, a real SQLite file. Each event arrives once, signed,
even when the receiver answers 500 twice first; when the gateway is SIGKILLed between the
event and its delivery, each arrives at least once, and a copy sent again (the receiver
took an attempt the dead process never saw answered) has the same id."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.server.notify.message import SIGNATURE_HEADER, verify
from gateway.store.sqlite import SqliteStore
from tests.server.served import DEMO, OPS, Served, chat_body, poll, request, write_config
from tests.store.conftest import redis_url  # noqa: F401  (the session's redis-server)
from tests.support.shared_store import SHARED_KINDS, shared_store, view
from tests.support.procs import free_port, start_gateway

SECRET = "whsec-test-0123456789"
PUBLIC = "https://gateway.example.com"
FAST = {"webhook_poll_s": 0.05, "budget_scan_s": 0.1}
"""The delivery task's waits, short: a retry, a message another replica wrote or a budget
threshold is seen within a tenth of a second instead of the 0.5-2 s a deployment uses."""
RETRY_BASE_S = 0.05
PATIENT_S = 60.0
"""webhooks[].timeout_s of the tests that count attempts exactly: an attempt that times out
is sent again, and the receiver (in this process) may answer that late only on a machine
so loaded the tests' own waits would fail first."""


@dataclass
class Receiver:
    """Answers `fail_first` 500s to each notice id (or 500 to all while `down`), then 200;
    keeps every attempt and checks its signature."""

    fail_first: int = 0
    down: bool = False
    delay_s: float = 0.0
    hold: asyncio.Event | None = None
    """While set to an unset Event, an attempt waits for it before it is answered (`held`)."""
    held: list[str] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # a receiver that takes its time
        if self.hold is not None and not self.hold.is_set():
            gate = self.hold
            self.held.append(orjson.loads(raw)["id"])
            await gate.wait()  # answered when the test says, whoever is still listening
        body = orjson.loads(raw)
        signed = verify(SECRET.encode(), request.headers.get(SIGNATURE_HEADER, ""), raw, time.time())
        tries = sum(1 for a in self.attempts if a["body"]["id"] == body["id"]) + 1
        status = 500 if self.down or tries <= self.fail_first else 200
        self.attempts.append({"body": body, "signed": signed, "status": status, "at": time.monotonic()})
        return web.Response(status=status)

    def delivered(self, event: str | None = None) -> list[dict[str, Any]]:
        return [a["body"] for a in self.attempts if a["status"] == 200 and event in (None, a["body"]["event"])]

    def tried(self, event: str) -> bool:
        return any(a["body"]["event"] == event for a in self.attempts)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    hook = Receiver()
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    hook.url = f"http://127.0.0.1:{port}/hook"
    yield hook
    await runner.cleanup()


def start(folder: Path, receiver: Receiver, store: dict[str, Any] | None = None,
          timeout_s: float = PATIENT_S) -> Served:
    """The test gateway of served.py with a webhook for every event of team demo, whose
    budget ($10) counts in total."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = write_config(folder, port)
    config = yaml.safe_load(path.read_text())
    if store is not None:
        config["store"] = store
    config["server"].update(public_url=PUBLIC, **FAST)
    config["teams"][0]["budget_period"] = "total"
    config["webhooks"] = [{"url": receiver.url, "secret_env": "GW_TEST_HOOK_SECRET", "teams": ["demo"],
                           "events": ["approval_required", "approval_decided", "run_stopped", "budget_threshold"],
                           "name": "test-hook", "timeout_s": timeout_s, "retry_base_s": RETRY_BASE_S}]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return Served(folder, port, spawn(folder, port))


def spawn(folder: Path, port: int) -> Any:
    n = len(list(folder.glob("gateway-*.log"))) + 1
    return start_gateway(["serve", "--config", str(folder / "config.yaml")], "/healthz", port,
                         folder / f"gateway-{n}.log", env={"GW_TEST_HOOK_SECRET": SECRET})


async def destructive_run(session: aiohttp.ClientSession, served: Served) -> str:
    status, headers, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                          body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    assert status == 200 and body["run"]["status"] == "interrupted", body
    return headers["X-Run-Id"]


async def spend(served: Served, usd: float) -> None:
    """Book spending on team demo's ledger in the gateway's own SQLite file (as another
    replica's calls would)."""
    store = SqliteStore(served.folder / "gateway.db")
    try:
        await store.charge("demo", "total", usd)
    finally:
        await store.close()


def once_each(receiver: Receiver) -> Counter[str]:
    """Every notice delivered exactly once, every attempt signed; the events delivered."""
    assert all(a["signed"] for a in receiver.attempts)
    ids = Counter(b["id"] for b in receiver.delivered())
    assert all(n == 1 for n in ids.values()), ids
    return Counter(b["event"] for b in receiver.delivered())


def deduped(receiver: Receiver) -> Counter[str]:
    """What a receiver that deduplicates by `id` (docs/notifications.md) acts on: every
    attempt signed, every copy of a notice delivered more than once the same notice (same
    id, event, team, run and detail; only `run`, the summary at sending, may differ); the
    events of the distinct notices delivered."""
    assert all(a["signed"] for a in receiver.attempts)
    first: dict[str, dict[str, Any]] = {}
    for body in receiver.delivered():
        kept = first.setdefault(body["id"], body)
        assert {k: v for k, v in body.items() if k != "run"} == {k: v for k, v in kept.items() if k != "run"}
    return Counter(b["event"] for b in first.values())


async def metric(session: aiohttp.ClientSession, served: Served, prefix: str) -> float:
    async with session.get(f"{served.url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


async def test_each_event_arrives_once_signed_after_two_500s(tmp_path: Path, receiver: Receiver,
                                                            session: aiohttp.ClientSession) -> None:
    receiver.fail_first = 2
    served = start(tmp_path / "gw", receiver)
    try:
        run_id = await destructive_run(session, served)
        status, _, body = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/approvals", key=OPS,
                                        body={"call_id": "c2", "decision": "approve", "reason": "<b>ok</b>"})
        assert status == 200, body
        status, _, body = await request(session, "POST", f"{served.url}/v1/runs/{run_id}/resume", key=DEMO, body={})
        assert status == 200, body
        await spend(served, 8.5)  # 85% of demo's $10

        expected = {"approval_required": 1, "approval_decided": 1, "run_stopped": 2, "budget_threshold": 1}
        await poll(lambda: _async(once_each(receiver) == expected), timeout=60)
        await poll(lambda: _async(len(receiver.attempts) == 3 * sum(expected.values())), timeout=30)
        for notice in {a["body"]["id"] for a in receiver.attempts}:  # 500, 500, then taken
            assert [a["status"] for a in receiver.attempts if a["body"]["id"] == notice] == [500, 500, 200]
            at = [a["at"] for a in receiver.attempts if a["body"]["id"] == notice]
            assert at[1] - at[0] >= RETRY_BASE_S and at[2] - at[1] >= 2 * RETRY_BASE_S  # backed off, doubled

        required = receiver.delivered("approval_required")[0]
        assert required["team"] == "demo" and required["run_id"] == run_id
        assert required["detail"]["toolName"] == "delete_file" and required["detail"]["callId"] == "c2"
        assert required["link"] == f"{PUBLIC}/console/runs/demo/{run_id}"
        assert required["run"]["policy"] == "files" and required["run"]["id"] == run_id
        decided = receiver.delivered("approval_decided")[0]["detail"]
        assert (decided["decision"], decided["by"], decided["reason"]) == ("approve", "ops", "<b>ok</b>")
        reasons = sorted(b["detail"]["reason"] for b in receiver.delivered("run_stopped"))
        assert reasons == ["approval", "completed"]
        budget = receiver.delivered("budget_threshold")[0]
        assert budget["detail"] == {"threshold_pct": 80, "period": "total", "budget_usd": 10.0,
                                    "spent_usd": pytest.approx(budget["detail"]["spent_usd"])}
        assert budget["detail"]["spent_usd"] >= 8.5 and budget["run"] is None

        await spend(served, 1.5)  # past 100%: that threshold once, the 80% one not again
        await poll(lambda: _async(len(receiver.delivered("budget_threshold")) == 2), timeout=60)
        assert [b["detail"]["threshold_pct"] for b in receiver.delivered("budget_threshold")] == [80, 100]
        once_each(receiver)

        delivered = 'gateway_webhook_deliveries_total{event="approval_required",outcome="delivered",webhook="test-hook"}'
        retried = 'gateway_webhook_deliveries_total{event="approval_required",outcome="retried",webhook="test-hook"}'
        assert await metric(session, served, delivered) == 1
        assert await metric(session, served, retried) == 2

        async def drained() -> bool:
            return await metric(session, served, "gateway_webhook_outbox_depth ") == 0

        await poll(drained, timeout=30)
    finally:
        served.proc.stop()


async def test_a_notice_outlives_a_sigkill_between_the_event_and_its_delivery(
        tmp_path: Path, receiver: Receiver, session: aiohttp.ClientSession) -> None:
    """Delivery is at least once: an attempt the receiver takes after the sender died (here:
    held open across the SIGKILL, then answered 200 to nobody) is sent again, with the same
    id, by the restarted process, which takes back what its previous life held as it starts
    (the lease, 5 + 10 s here, would run out well after the test's waits). Any other attempt the dead
    process had on the wire may come twice the same way; a deduplicating receiver acts on
    each notice once."""
    receiver.down = True  # the event is stored, its delivery cannot happen yet
    served = start(tmp_path / "gw", receiver, timeout_s=PATIENT_S)  # a 70 s lease: only the restart takes it back in time
    try:
        run_id = await destructive_run(session, served)
        await spend(served, 8.0)
        await poll(lambda: _async(receiver.tried("approval_required") and receiver.tried("budget_threshold")),
                   timeout=30)
        receiver.hold = release = asyncio.Event()
        await poll(lambda: _async(bool(receiver.held)), timeout=60)  # an attempt is on the wire...
        served.proc.kill()  # ...when its sender dies
        assert receiver.delivered() == []
        receiver.down = False
        release.set()  # the receiver takes it (answers 200); nobody hears the answer
        taken = receiver.held[0]
        await poll(lambda: _async(any(b["id"] == taken for b in receiver.delivered())), timeout=30)
        served.proc = spawn(served.folder, served.port)

        await poll(lambda: _async(deduped(receiver).get("approval_required") == 1
                                  and deduped(receiver).get("budget_threshold") == 1), timeout=60)
        assert receiver.delivered("approval_required")[0]["run_id"] == run_id
        await spend(served, 2.0)  # the restarted process remembers nothing; the store does
        final = {"approval_required": 1, "run_stopped": 1, "budget_threshold": 2}
        await poll(lambda: _async(deduped(receiver) == final
                                  and sum(b["id"] == taken for b in receiver.delivered()) == 2), timeout=60)

        async def drained() -> bool:  # the copy sent again was booked delivered: nothing left to send
            return await metric(session, served, "gateway_webhook_outbox_depth ") == 0

        await poll(drained, timeout=30)
        assert sum(b["id"] == taken for b in receiver.delivered()) == 2
    finally:
        served.proc.stop()


@pytest.mark.parametrize("kind", SHARED_KINDS)
async def test_two_replicas_on_one_store_send_each_notice_once(tmp_path: Path, receiver: Receiver, kind: str,
                                                               request: pytest.FixtureRequest,
                                                               session: aiohttp.ClientSession) -> None:
    receiver.delay_s = 0.2  # deliveries overlap: both replicas claim while the other sends
    shared = shared_store(kind, request, "hooks")
    a = start(tmp_path / "gw", receiver, store=shared)
    b_port = free_port()
    b = start_gateway(["serve", "--config", str(a.folder / "config.yaml"), "--port", str(b_port)], "/healthz", b_port,
                      a.folder / "replica-b.log", env={"GW_TEST_HOOK_SECRET": SECRET})
    try:
        runs = [await destructive_run(session, a), await destructive_run(session, Served(a.folder, b_port, b))]
        store = view(shared)
        try:
            await store.charge("demo", "total", 10.0)  # both thresholds at once, seen by both replicas' scans
        finally:
            await store.close()
        expected = {"approval_required": 2, "run_stopped": 2, "budget_threshold": 2}
        await poll(lambda: _async(once_each(receiver) == expected), timeout=60)
        assert sorted(x["run_id"] for x in receiver.delivered("approval_required")) == sorted(runs)
        assert len(receiver.attempts) == 6  # nothing sent twice, not even an attempt
    finally:
        b.stop()
        a.proc.stop()


async def _async(value: bool) -> bool:
    return value
