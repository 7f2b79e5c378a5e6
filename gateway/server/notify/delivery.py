"""The delivery task of one replica: claims due notices from the store's outbox and sends them.

`background(app)` (a cleanup context; nothing runs while the config has no `webhooks:`)
installs the notice rule on the store, so a notifying trace line and its notices are written in one
store step, and starts `Notifier.run`, which every `server.webhook_poll_s` (0.5 s by default;
at once when this process wrote a notice):

- claims up to `CLAIM_BATCH` due notices with a lease (the longest webhook timeout plus
  `LEASE_MARGIN_S`): another replica gets them only if this one died holding them;
- sends each, signed, to its webhook (2xx: delivered; anything else, a timeout or a
  refused connection: tried again after `message.retry_in`, given up after the webhook's
  `max_attempts`);
- every `server.budget_scan_s` (2 s by default), enqueues a `budget_threshold` notice for
  each team whose spend in its current period reached 80% or 100% of its budget (the notice
  id is the team, period, threshold and webhook, so each is sent once, whichever replica
  sees it first);
- keeps `gateway_webhook_outbox_depth` up to date.

A run never waits for any of it: a notice costs its run one more row in a write it makes
anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Final

import aiohttp
from aiohttp import web

from gateway.server import context as ctx
from gateway.config.settings import Config
from gateway.config.webhooks import WebhookConfig
from gateway.server.metrics import Metrics
from gateway.server.notify import message
from gateway.store.base import Store
from gateway.store.errors import StoreError
from gateway.store.outbox import Claimed, Notice
from gateway.store.periods import period_key
from gateway.store.signals import changed

log = logging.getLogger(__name__)

DEPTH_EVERY_S: Final = 5.0
CLAIM_BATCH: Final = 16
LEASE_MARGIN_S: Final = 10.0
USER_AGENT: Final = "gateway-webhooks/1"
ENQUEUED_MEMO: Final = 4096


class Notifier:
    """Turns trace lines into notices (`rule`) and delivers the outbox (`run`)."""

    def __init__(self, store: Store, config: Config, metrics: Metrics, session: aiohttp.ClientSession, owner: str,
                 base_url: str | None) -> None:
        self.store = store
        self.metrics = metrics
        self.session = session
        self.owner = owner
        self.base_url = base_url
        self.wake = asyncio.Event()
        self._enqueued: set[str] = set()  # budget notices this process already wrote
        self._next_scan = 0.0
        self._next_depth = 0.0
        self.poll_s = config.server.webhook_poll_s
        self.scan_s = config.server.budget_scan_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Deliver to `config`'s webhooks from now on (at start, and on a config reload), on
        the event loop. With webhooks, trace lines make notices (the store's rule) and the
        delivery task runs; a reload that removes them all stops new notices, and the task
        goes on (a notice already written for a webhook no longer configured is given up)."""
        self.config = config
        self.hooks: Mapping[str, WebhookConfig] = {w.name: w for w in config.webhooks}
        self.lease_s = max((w.timeout_s for w in config.webhooks), default=0.0) + LEASE_MARGIN_S
        self.store.notice_rule = self.rule if config.webhooks else None
        if config.webhooks and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(self._stop))

    async def close(self) -> None:
        """Stop the delivery task (5 s for a round in progress) and the notice rule."""
        self.store.notice_rule = None
        self._stop.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=5.0)
            if not self._task.done():
                self._task.cancel()

    def rule(self, run_id: str, events: Sequence[Mapping[str, Any]]) -> list[Notice]:
        """The store's `notice_rule`: runs inside its write, so it only builds and signals."""
        notices = message.notices_for(self.config.webhooks, run_id, events, time.time())
        if notices:
            self.wake.set()
        return notices

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until `stop` is set; store failures are logged and retried next round."""
        while not stop.is_set():
            try:
                await self.step()
            except StoreError as exc:
                log.warning("webhook delivery: the store failed, retrying in %.1fs: %s", self.poll_s, exc)
            except Exception:  # a bug must not end deliveries for the life of the process
                log.exception("webhook delivery round failed")
            self.wake.clear()
            # Until the poll, or sooner: this process wrote a notice, or (PostgreSQL) another did.
            await changed(self.store, "outbox", "", self.poll_s, stop, self.wake)

    async def step(self) -> int:
        """One round: the budget scan when due, then one batch of due notices; returns how many were sent."""
        now = time.monotonic()
        if now >= self._next_scan:
            self._next_scan = now + self.scan_s
            await self.scan_budgets()
        claimed = await self.store.claim_notices(self.owner, CLAIM_BATCH, self.lease_s)
        results = await asyncio.gather(*(self.deliver(c) for c in claimed))
        if claimed or now >= self._next_depth:
            self._next_depth = now + DEPTH_EVERY_S
            self.metrics.set_outbox_depth(await self.store.outbox_depth())
        return sum(results)

    async def scan_budgets(self) -> None:
        """Enqueue the threshold notices of every team whose spend reached one (once each)."""
        now = time.time()
        for team in self.config.teams:
            hooks = [w for w in self.config.webhooks if w.wants("budget_threshold", team.name)]
            if not hooks or team.budget_usd is None:
                continue
            period = period_key(team.budget_period)
            spent, _ = await self.store.team_spend(team.name, period)
            fresh = [message.budget_notice(w, team.name, period, pct, team.budget_usd, spent, now)
                     for pct in message.crossed(team.budget_usd, spent) for w in hooks]
            fresh = [n for n in fresh if n.id not in self._enqueued]
            if fresh:
                await self.store.enqueue_notices(fresh)
                if len(self._enqueued) > ENQUEUED_MEMO:  # a memo only: the store refuses a known id anyway
                    self._enqueued.clear()
                self._enqueued.update(n.id for n in fresh)

    async def deliver(self, claim: Claimed) -> bool:
        """One attempt at one claimed notice; books its outcome. True if it was delivered."""
        try:
            record = message.read_record(claim.body)
        except ValueError:
            await self.store.notice_failed(claim.id, self.owner, None, "unreadable notice")
            return False
        hook = self.hooks.get(record["webhook"])
        if hook is None:  # the config no longer has it: nobody to send it to
            await self.store.notice_failed(claim.id, self.owner, None, "webhook no longer configured")
            self.metrics.on_webhook(record["webhook"], record["event"], "failed")
            return False
        body = message.encode(message.payload(claim.id, record, await self._run(record), self.base_url), hook.format)
        error = await self._post(hook, body)
        if error is None:
            await self.store.notice_sent(claim.id)
            self.metrics.on_webhook(hook.name, record["event"], "delivered")
            return True
        attempts = claim.attempts + 1
        retry = None if attempts >= hook.max_attempts else message.retry_in(attempts, hook.retry_base_s)
        await self.store.notice_failed(claim.id, self.owner, retry, error)
        self.metrics.on_webhook(hook.name, record["event"], "failed" if retry is None else "retried")
        log.warning("webhook %s: %s notice %s not delivered (attempt %d of %d): %s", hook.name, record["event"],
                    claim.id, attempts, hook.max_attempts, error)
        return False

    async def _run(self, record: message.Record) -> dict[str, Any] | None:
        """The run's summary now (None: a budget notice, or the run is gone)."""
        if record["run_id"] is None:
            return None
        run = await self.store.load_run(record["run_id"])
        if run is None:
            return None
        return {**run.summary(), "team": run.team, "policy": run.policy, "model": run.model,
                "created_at": run.created_at, "updated_at": run.updated_at}

    async def _post(self, hook: WebhookConfig, body: bytes) -> str | None:
        """POST `body` signed now; None when the receiver took it (2xx), else why not. The
        words never carry the URL (it may hold a secret) nor the receiver's answer."""
        if hook.secret is None:  # build_app refuses to serve without it; never send unsigned
            return f"no secret (${hook.secret_env} is not set)"
        headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT,
                   message.SIGNATURE_HEADER: message.sign(hook.secret, body, int(time.time()))}
        try:
            async with asyncio.timeout(hook.timeout_s):
                async with self.session.post(hook.url, data=body, headers=headers, allow_redirects=False) as resp:
                    await resp.content.readany()  # a little of it, so the connection can be reused
                    return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
        except TimeoutError:
            return f"no answer within {hook.timeout_s:g}s"
        except aiohttp.ClientError as exc:
            return f"cannot reach the webhook ({type(exc).__name__})"


async def background(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: this replica's notifier (`NOTIFIER`), which installs the notice rule
    and runs the delivery task while the config has webhooks (nothing runs without)."""
    config = app[ctx.LIVE].config
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    notifier = Notifier(app[ctx.STORE], config, app[ctx.METRICS], session, app[ctx.GOVERNOR].owner,
                        config.server.public_url or app.get(ctx.SELF_URL))
    app[NOTIFIER] = notifier
    try:
        yield
    finally:
        await notifier.close()
        await session.close()


NOTIFIER: Final = web.AppKey("notifier", Notifier)
"""This replica's notifier (a config reload gives it the new webhooks: `Notifier.configure`)."""
