"""A reload: config.yaml and the policy files read again and served together, or neither.

`SIGHUP` and `POST /v1/admin/reload` (`gateway.server.api.admin`) both come here. A reload
reads the config file the process started with and every policy file, off the event loop
(policy loads may start MCP servers), and refuses the whole of it at the first file that
is not valid: every error of the config file, else every policy error (the policies the
new config's teams list included). Nothing changes then; the answer and the log say why.

Otherwise it swaps both in one step on the event loop (`apply_config`), between two calls:

- what changes live: `teams` (keys, budgets, budget modes, admin, rate limits, model
  allow-lists, user budgets), `models` (routes, prices, fallbacks), `upstreams`, `webhooks`,
  `defaults` and `console`;
- what cannot (the listen address, the store, paths, retention, `metrics`, the rest of
  `server`) keeps its running value; each such field the file changed is named in the
  answer (`restart_required`) and the log, and takes effect at the next start.

A call already admitted keeps what it read (its team, its route, its upstreams, its
reservation) and finishes under the config it started with; the next call reads the new
one. The caches built from the config are rebuilt in the same step (the keyring, the
governor's rate limits, the upstreams and their deployments' health, the metrics' label
sets, the webhooks). Each process reloads its own copy: the workers of `--workers N`
together (`gateway.server.workers`); the other replicas sharing the store when a SIGHUP's
or a call's reload is announced there (`gateway.server.reload_watch`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from gateway.config.settings import Config, ConfigError, ConfigErrors, TeamConfig, load_config, unlisted_policies
from gateway.config.upstreams import require_upstreams
from gateway.config.webhooks import require_secrets
from gateway.policy.decl import Policy
from gateway.policy.errors import PolicyError
from gateway.policy.registry import PolicyRegistry, ReloadResult, StagedSet, policy_names
from gateway.server import audit
from gateway.server import context as ctx
from gateway.server.metrics import KnownPolicy, Metrics
from gateway.server.models import routed_models
from gateway.server.notify.delivery import NOTIFIER
from gateway.server.workers import mark_reloaded

log = logging.getLogger("gateway")

LIVE_FIELDS: Final = ("upstreams", "models", "teams", "webhooks", "defaults", "console")
"""The top-level config fields a reload serves at once."""
RESTART_FIELDS: Final = tuple(f.name for f in dataclasses.fields(Config)
                              if f.compare and f.name != "path" and f.name not in LIVE_FIELDS)
"""The top-level config fields that keep their running value until the next start: every
other one (`server`, `store`, `policies_dir`, ...), so a field added to `Config` without a
thought for reload is at worst named as needing a restart, never silently ignored."""


@dataclass(frozen=True)
class Reloaded:
    """What a reload did: the policies' result, and the config's (its errors refuse both)."""

    policies: ReloadResult
    config_errors: tuple[ConfigError, ...] = ()
    changed: tuple[str, ...] = ()
    """The live config fields whose value changed."""
    restart_required: tuple[str, ...] = ()
    """Fields the file changed that this process keeps until it restarts."""

    @property
    def ok(self) -> bool:
        return not self.config_errors and self.policies.ok


@dataclass(frozen=True)
class _Staged:
    config: Config
    changed: tuple[str, ...]
    restart_required: tuple[str, ...]
    policies: StagedSet


def team_check(config: Config) -> Callable[[Mapping[str, Policy]], Sequence[PolicyError]]:
    """A registry `check` refusing a set that lacks a policy some team of the config lists."""

    def check(policies: Mapping[str, Policy]) -> list[PolicyError]:
        return [PolicyError(str(config.path), None, ("teams", i, "policies", j), problem)
                for i, j, problem in unlisted_policies(config, policies)]

    return check


def known_policies(config: Config, registry: PolicyRegistry) -> dict[str, list[KnownPolicy]]:
    """Team -> the policies it may use, as the metrics' zero series need them."""
    out: dict[str, list[KnownPolicy]] = {}
    for team in config.teams:
        policies = [registry.get(name) for name in team.policies]
        out[team.name] = [KnownPolicy(p.name, tuple(t.name for t in p.tools),
                                      tuple(p.limit_ask.grant) if p.limit_ask is not None else ())
                          for p in policies if p is not None]
    return out


def served_config(running: Config, read: Config) -> tuple[Config, tuple[str, ...], tuple[str, ...]]:
    """The config to serve after reading `read` while serving `running`: `read`'s live fields
    with `running`'s others; and the live fields that changed, and the others that did (each
    named by its field path, e.g. `server.port`)."""
    served = dataclasses.replace(running, **{name: getattr(read, name) for name in LIVE_FIELDS})
    changed = tuple(name for name in LIVE_FIELDS if getattr(read, name) != getattr(running, name))
    restart: list[str] = []
    for name in RESTART_FIELDS:
        old, new = getattr(running, name), getattr(read, name)
        if old == new:
            continue
        if dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new):
            restart.extend(f"{name}.{f.name}" for f in dataclasses.fields(old)  # not what is derived (compare=False)
                           if f.compare and getattr(old, f.name) != getattr(new, f.name))
        else:
            restart.append(name)
    return served, changed, tuple(restart)


def _mount_check(app: web.Application, config: Config) -> None:
    """A `kind: scripted` upstream without `base_url` is this process's own mount, which is
    set up at start only when the config had one."""
    if ctx.SCRIPTED_KEY in app:
        return
    for i, upstream in enumerate(config.upstreams.values()):
        if ctx.uses_mount(upstream):
            raise ConfigError(str(config.path), f"upstreams[{i}].kind",
                              "a scripted upstream without base_url is this gateway's own /scripted/v1 mount, "
                              "which is served only when the config names one at start: restart the gateway "
                              "to add it (or give it the base_url of a `gateway scripted`)")


def _stage(app: web.Application) -> _Staged:
    """In a worker thread: the config file read and checked, then the policies against it."""
    running = app[ctx.LIVE].config
    read = load_config(running.path, policy_names)
    require_secrets(str(read.path), read.webhooks)
    require_upstreams(str(read.path), read.upstreams)
    _mount_check(app, read)
    served, changed, restart = served_config(running, read)
    return _Staged(served, changed, restart, app[ctx.POLICIES].stage(check=team_check(served)))


def configure_metrics(metrics: Metrics, config: Config, registry: PolicyRegistry) -> None:
    """Export at zero the label sets `config` and its policies know (at start and on a reload)."""
    metrics.configure((name for name, _ in routed_models(config)), config.upstreams,
                      ((w.name, sorted(w.events)) for w in config.webhooks))
    metrics.start_at_zero(known_policies(config, registry))


def apply_config(app: web.Application, config: Config) -> None:
    """Serve `config` from the next call on: the one step, on the event loop, that makes the
    config and everything built from it current together (see the module docstring). The
    config's keys authenticate through `KeyRing.set_teams` (which also shows the store's
    keys through the new teams at once)."""
    app[ctx.LIVE].config = config
    app[ctx.KEYRING].set_teams(config.teams)
    configure_metrics(app[ctx.METRICS], config, app[ctx.POLICIES])
    if ctx.UPSTREAMS in app:  # the loop's resources, once the app has started
        app[ctx.UPSTREAMS].configure(config)
    if ctx.GOVERNOR in app:
        app[ctx.GOVERNOR].configure(config.defaults)
    if NOTIFIER in app:
        app[NOTIFIER].configure(config)


async def _on_own_thread(stage: Callable[[web.Application], _Staged], app: web.Application) -> _Staged:
    """A reload may start MCP servers and list their tools: it runs off the event loop, on a
    thread of its own rather than one of a shared pool, so it never queues behind other work
    (tools have their own pool, but DNS lookups and the like use asyncio's default one)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-reload")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, stage, app)
    finally:
        pool.shutdown(wait=False)


async def reload(app: web.Application, by: str) -> Reloaded:
    """Read config.yaml and the policy files again and serve them (or keep the current ones
    and say why); logs the outcome. A worker of `--workers N` then notes that it serves the
    files as they were when this began."""
    read_at = time.time()
    async with app[ctx.LIVE].reloading:
        try:
            staged = await _on_own_thread(_stage, app)
        except ConfigError as exc:
            errors = exc.errors if isinstance(exc, ConfigErrors) else (exc,)
            done = Reloaded(ReloadResult(loaded=app[ctx.POLICIES].names()), config_errors=errors)
        else:
            result = app[ctx.POLICIES].commit(staged.policies)  # no await from here to the config's swap
            if result.ok:
                apply_config(app, staged.config)
                done = Reloaded(result, changed=staged.changed, restart_required=staged.restart_required)
            else:
                done = Reloaded(result)
    _log(app, by, done)
    if ctx.WORKER in app:
        mark_reloaded(app[ctx.WORKER], read_at)
    return done


async def record_reload(app: web.Application, done: Reloaded, team: TeamConfig | None, by: str) -> None:
    """The audit record of a reload that served the files (`config.reloaded`, target
    `policies`): an act of `team`'s key (POST /v1/admin/reload), or of the gateway itself
    (`team` None: a signal, named in `details.by`)."""
    registry = app[ctx.POLICIES]
    details: dict[str, object] = {"changed": [[n, registry.version_of(n)] for n in done.policies.changed],
                                  "config": list(done.changed)}
    if team is None:
        details["by"] = by
    await audit.record(app[ctx.STORE], team, audit.CONFIG_RELOADED, "policies", details=details)


def _log(app: web.Application, by: str, done: Reloaded) -> None:
    registry = app[ctx.POLICIES]
    result = done.policies
    errors = done.config_errors or result.errors
    if errors:
        log.error("reload by %s refused, the previous config and policies kept:\n%s", by,
                  "\n".join(f"  {e}" for e in errors))
        return
    log.warning("policies reloaded by %s: %s (changed: %s); config fields served anew: %s", by,
                ", ".join(f"{n}@{registry.version_of(n)}" for n in result.loaded),
                ", ".join(f"{n}@{registry.version_of(n) or 'removed'}" for n in result.changed) or "none",
                ", ".join(done.changed) or "none")
    if done.restart_required:
        log.warning("reload by %s: these settings changed in %s and take effect at the next start: %s", by,
                    app[ctx.LIVE].config.path, ", ".join(done.restart_required))
