"""`config.yaml`: loaded, validated and frozen before the gateway starts.

The shape is docs/config.md's (field names are the contract). Every error is a `ConfigError`
naming the file, the field path (`teams[0].budget_usd`) and what is wrong; `gateway
serve` prints it and exits 2 without starting. Relative paths are taken from the
config file's folder, so the gateway works from any working directory.

Settings beyond the first contract's shape (all in docs/config.md):

- `server.lease_ttl_s` (default 15): how long a replica's hold on a run it drives, and on
  the reservations of its calls in flight, lasts without renewal (renewed every third of
  it). A run whose replica died can be resumed by another replica, and its reservations
  stop counting against the team, once this much time has passed since the last renewal.
- `server.refusal_status` (default 429; 400, 402 or 403): the HTTP status of a cap or budget
  refusal. Some clients (Vercel's `ai` SDK, litellm's `num_retries`) retry a 429 whatever
  `x-should-retry` says; another status stops them at the first refusal. `error.type` and
  `error.code` name the refusal either way.
- `upstreams[]`: read by `gateway.config.upstreams` (auth, headers, query, path, kind azure,
  tls, proxy, discover_models; docs/upstreams.md).
- `upstreams[].api` (default `chat`): `responses` for an upstream that speaks the Responses
  API natively: `POST /v1/responses` calls are sent to its `/responses` (the whole
  conversation, `store: false`) instead of being translated to chat completions; chat
  completions calls still go to its `/chat/completions`.
- `defaults.max_calls_in_flight_per_run` (default 64): calls of one pass-through run the
  gateway forwards at once, across replicas; one more is refused before anything is
  forwarded (409 `run_busy`, retryable).
- `runs_dir` (default `runs/` next to the SQLite file, else next to this file): where
  per-run sandbox folders live. Replicas that share a store must share this folder too,
  so a run resumed on another replica finds its files.
- `spool_file` (default `spool.jsonl` next to this file): where a turn that was paid
  upstream while the store was unreachable is written (durably) until the store books it.
  `spool_reserve_mb` (default 64): the space it keeps allocated for that (gateway.store.spool).
- `metrics` (default: none, /metrics open on the main address as before):
  `token_env: NAME` makes /metrics require `Authorization: Bearer <the value of $NAME>`
  (the token itself is never written in the config); `listen: "HOST:PORT"` serves
  /metrics on that address only, from a second listener of the same process, and the
  main address no longer has it. Both may be set.
- `store.timeout_s` (Redis, default 2): the deadline of one store command; a frozen or
  unreachable store answers calls 503 `store_unavailable` within it.
- `store.wait_replicas` / `store.wait_timeout_s` (Redis, default 0 / 0.5): replicas that must
  confirm each write, and how long they have (docs/stores.md, replication and failover);
  checked with the other store fields by `gateway.store.factory.open_store`.
- `retention` (see `RetentionConfig`): finished runs, their events, closed ledgers and the
  trace file deleted or rotated as they age.
- `telemetry` (default: off) and `access_log` (default: JSON lines on stderr): read by
  `gateway.config.telemetry` (docs/telemetry.md).
- `teams[i].admin` (default false): keys of an admin team may call the admin API
  (`POST /v1/admin/reload`) and resume or cancel any team's runs (docs/runs.md). Admin
  is an explicit grant: being named as an approver by a policy does not make a team an
  admin, so editing a policy file can never widen who may reload policies or steer runs.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gateway.config.fields import ConfigError, ConfigErrors, Errors, Field
from gateway.harness.usage import Price
from gateway.config.keys import MAX_GLOB_CHARS, MAX_GLOBS, Caller, ConfigKey, check_user
from gateway.config.rates import RateLimits, parse_rate_limits
from gateway.config.telemetry import AccessLogConfig, TelemetryConfig, parse_access_log, parse_telemetry
from gateway.config.upstreams import UpstreamConfig, UpstreamKind, parse_upstreams
from gateway.config.yamlfile import parse as parse_yaml
from gateway.config.webhooks import WebhookConfig, parse_public_url, parse_webhooks
from gateway.providers.routing import Breaker, Deployment, Group, RoutePlan

__all__ = [
    "Config", "ConfigError", "ConfigErrors", "Defaults", "MetricsConfig", "ModelRoute", "RetentionConfig", "ServerConfig", "StoreConfig",
    "TeamConfig",
    "UpstreamConfig", "UpstreamKind", "load_config", "parse_config",
]

BudgetPeriod = Literal["day", "week", "month", "total"]
BUDGET_PERIODS: tuple[BudgetPeriod, ...] = ("day", "week", "month", "total")
BudgetMode = Literal["turn", "strict"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
TEAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
DEFAULT_OUTPUT_ALLOWANCE = 4096
DEFAULT_CALLS_IN_FLIGHT_PER_RUN = 64
DEFAULT_RETRIES = 2
"""`retries` of a route that names `deployments` or `fallbacks` (the single-`upstream` form: 0)."""
MAX_RETRIES = 10
DEFAULT_LEASE_TTL_S = 15.0
DEFAULT_WEBHOOK_POLL_S = 0.5
DEFAULT_BUDGET_SCAN_S = 2.0
DEFAULT_RATE_LIMIT_WAIT_S = 30.0
DEFAULT_STORE_TIMEOUT_S = 2.0
"""The deadline of one store command (`store.timeout_s`, Redis): a frozen store is a 503 this soon."""
DEFAULT_TOOL_THREADS = 32
"""Threads for sync python tools (`server.tool_threads`): as many as asyncio's default pool
has at most, for tools alone."""
MAX_TOOL_THREADS = 1024
DEFAULT_SPOOL_RESERVE_MB = 64
"""Room the spool keeps allocated for the calls in flight when the store fails (`spool_reserve_mb`)."""
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_IDLE_TIMEOUT_S = 75.0
"""Longer than the idle timeout of common load balancers (60 s), which must close first."""
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_WORK_SLOTS = 1
"""Calls of one team at once in the process's own work while other teams have calls in
flight (`server.work_slots`, gateway.server.runs.fair_share)."""
SCRIPTED_PREFIX = "/scripted/v1"
ROUTE_CACHE_SIZE = 1024
"""Model names remembered by `Config.route` (it runs on every call; names come from clients)."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    refusal_status: int = 429
    public_url: str | None = None
    """Where people reach this gateway (links in notifications); None: the listening address."""
    webhook_poll_s: float = DEFAULT_WEBHOOK_POLL_S
    """How often the webhook delivery task looks for due messages another process wrote."""
    budget_scan_s: float = DEFAULT_BUDGET_SCAN_S
    """How often the webhook delivery task reads team spend for `budget_threshold` messages."""
    shutdown_delay_s: float = 0.0
    """After SIGTERM, how long the process goes on serving with GET /readyz failing before it
    stops listening and drains (time for a load balancer to see it is not ready)."""
    tool_threads: int = DEFAULT_TOOL_THREADS
    """Threads of the process's pool for sync python tools (`gateway.policy.threads`)."""
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    """A request's head must arrive within this of its first byte (gateway.server.http.listener)."""
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    """A request's body must arrive within this of its head."""
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    """A keep-alive connection with no request for this long is closed."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Client connections one process holds; past it a new one is refused (503)."""
    work_slots: int = DEFAULT_WORK_SLOTS
    """A team's share of the process's own work (admission, booking) while others have calls in flight."""


REFUSAL_STATUSES = (429, 400, 402, 403)


@dataclass(frozen=True)
class StoreConfig:
    """`store:`; `path` is absolute (resolved from the config folder). `options` holds the
    whole section as written (with `path` resolved) for store kinds with more settings."""

    kind: str = "sqlite"
    path: str | None = None
    url: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = DEFAULT_STORE_TIMEOUT_S
    allow_eviction: bool = False
    """Redis: start even when the server may evict keys (`maxmemory-policy` other than noeviction)."""


@dataclass(frozen=True)
class ModelRoute:
    """`models[i]`: the first route whose glob matches the model name decides.

    `upstream` is its first deployment's; `price` is what a call's budget hold is taken at:
    the most any deployment of the route or of its fallbacks may charge (`RoutePlan.hold_price`),
    so a hold covers whichever answers. The turn is booked at the price of the one that did.
    """

    match: str
    upstream: str
    price: Price
    plan: RoutePlan
    is_glob: bool = field(init=False, compare=False)
    """`match` is a glob (`*`, `?`, `[...]`), not a name: read on every routed call, so set once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_glob", any(c in self.match for c in "*?["))


@dataclass(frozen=True)
class TeamConfig:
    name: str
    keys: tuple[str, ...]
    policies: tuple[str, ...]
    budget_usd: float | None = None
    budget_period: BudgetPeriod = "month"
    budget_mode: BudgetMode = "turn"
    admin: bool = False
    rate_limits: RateLimits | None = None
    """The team's own rate limits (config_rates), shared by all its keys."""
    config_keys: tuple[ConfigKey, ...] = ()
    """Every key of the team in config.yaml, with what each names beyond the key itself."""
    models: tuple[str, ...] | None = None
    """The models the team may call (globs); None: every routed model."""
    user_budget_usd: float | None = None
    """What each user of the team may spend per `user_budget_period` (None: no user budget)."""
    user_budget_period: BudgetPeriod = "month"
    caller: Caller | None = None
    """Set by the keyring on the team a call authenticates as: the key it used."""

    @property
    def default_policy(self) -> str:
        return self.policies[0]


@dataclass(frozen=True)
class RetentionConfig:
    """`retention:` what the gateway deletes as it ages, in the background every `interval_s`
    and on `gateway prune`. None keeps forever (no rotation for the trace file).

    - `runs_days`: finished runs (any status but running) last saved this long ago are
      deleted with their events; `events_days`: only their events (the run is kept).
    - `ledger_days`: figures of budget periods that ended this long ago; the current
      period and a `total` one are never pruned.
    - `trace_file_max_mb` / `trace_file_keep`: the trace file is rotated past this size,
      keeping this many old files (trace.jsonl.1 ...).
    - `outbox_days`: webhook notices delivered or given up this long ago (a budget
      threshold's notice is kept until its period ended, so it is never sent twice).
    - `spend_days`: spend rows of days this long ago (`GET /v1/spend`); `audit_days`: audit
      records this long ago (default: kept; the newest record is always kept).
    """

    runs_days: float | None = 30.0
    events_days: float | None = 30.0
    ledger_days: float | None = None
    trace_file_max_mb: float | None = 100.0
    trace_file_keep: int = 5
    interval_s: float = 3600.0
    outbox_days: float | None = 7.0
    spend_days: float | None = 400.0
    audit_days: float | None = None


@dataclass(frozen=True)
class Defaults:
    output_allowance_tokens: int = DEFAULT_OUTPUT_ALLOWANCE
    max_calls_in_flight_per_run: int = DEFAULT_CALLS_IN_FLIGHT_PER_RUN
    rate_limit_wait_s: float = DEFAULT_RATE_LIMIT_WAIT_S
    """How long, in all, a server-side model turn waits for its rate limits before the run stops."""


DEFAULT_SESSION_IDLE_S = 8 * 3600.0
DEFAULT_SESSION_MAX_S = 24 * 3600.0


@dataclass(frozen=True)
class ConsoleConfig:
    """`console:` how long a web console session lasts: `session_idle_s` without a request,
    `session_max_s` in all since sign-in (docs/console.md#signing-in)."""

    session_idle_s: float = DEFAULT_SESSION_IDLE_S
    session_max_s: float = DEFAULT_SESSION_MAX_S


@dataclass(frozen=True)
class MetricsConfig:
    """`metrics:`: who may read /metrics and where it is served (both off by default)."""

    token_env: str | None = None
    token: str | None = field(default=None, repr=False)
    listen: tuple[str, int] | None = None


@dataclass(frozen=True)
class Config:
    """The whole validated configuration."""

    path: Path
    server: ServerConfig
    store: StoreConfig
    policies_dir: Path
    runs_dir: Path
    trace_file: Path | None
    spool_file: Path
    upstreams: Mapping[str, UpstreamConfig]
    models: tuple[ModelRoute, ...]
    teams: tuple[TeamConfig, ...]
    defaults: Defaults = field(default_factory=Defaults)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    webhooks: tuple[WebhookConfig, ...] = ()
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    access_log: AccessLogConfig = field(default_factory=AccessLogConfig)
    spool_reserve_bytes: int = DEFAULT_SPOOL_RESERVE_MB * 1024 * 1024
    """Space the spool keeps allocated for turns the store cannot take (`spool_reserve_mb`)."""
    _routes: dict[str, ModelRoute | None] = field(default_factory=dict, init=False, repr=False, compare=False)

    def route(self, model: str) -> ModelRoute | None:
        """The first route matching `model`, or None (unknown model)."""
        try:
            return self._routes[model]
        except KeyError:
            pass
        found = next((r for r in self.models if fnmatch.fnmatchcase(model, r.match)), None)
        if len(self._routes) >= ROUTE_CACHE_SIZE:  # model names come from clients: keep the memo bounded
            self._routes.clear()
        self._routes[model] = found
        return found

    def team_for_key(self) -> dict[str, TeamConfig]:
        return {key: team for team in self.teams for key in team.keys}

    def team(self, name: str) -> TeamConfig | None:
        return next((t for t in self.teams if t.name == name), None)


PolicyNames = Callable[[Path], Collection[str]]
"""The names of the policies a folder holds (`gateway.policy.registry.policy_names`)."""


def load_config(path: str | Path, policy_names: PolicyNames | None = None) -> Config:
    """Read and validate a config file; raises ConfigError naming file and field (every
    error of the file: `ConfigErrors`). With `policy_names`, the policies each team lists
    must be among those of `policies_dir` (checked with the rest, so a start reports them
    together; `gateway serve` and a reload pass it)."""
    file = Path(path)
    try:
        text = file.read_text("utf-8")
    except FileNotFoundError:
        raise ConfigError(str(file), "", "file not found") from None
    except OSError as exc:
        raise ConfigError(str(file), "", f"cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start:exc.start + 1]
        raise ConfigError(str(file), "", f"not UTF-8 text (byte {exc.start} is {bad!r}): is it the config "
                                         "file?") from None
    try:
        data = parse_yaml(text, lambda loader: loader.get_single_data())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(str(file), "", f"not valid YAML{where}: {problem}") from None
    return parse_config(data, file, policy_names)


def parse_config(data: Any, file: Path, policy_names: PolicyNames | None = None) -> Config:
    """Validate an already-parsed YAML document as if it were read from `file`; every error
    of the document is reported at once (`ConfigErrors`, one line each)."""
    base = file.resolve().parent
    errors = Errors()
    root = Field(str(file), "", data if data is not None else {}, errors)
    root.mapping()  # a document that is not a mapping has nothing more to report
    root.keys_only({"server", "store", "policies_dir", "runs_dir", "trace_file", "spool_file", "spool_reserve_mb", "upstreams", "models",
                    "teams", "defaults", "metrics", "retention", "webhooks", "console", "telemetry", "access_log"})
    take = errors.take
    upstreams: dict[str, UpstreamConfig] = take(lambda: parse_upstreams(root.get("upstreams"), base), {})
    store = take(lambda: _store(root.get("store"), base), StoreConfig())
    server = take(lambda: _server(root.get("server")), ServerConfig())
    metrics = take(lambda: _metrics(root.get("metrics")), MetricsConfig())
    if metrics.listen == (server.host, server.port):
        root.get("metrics").get("listen").invalid("is the gateway's own address (server.host:server.port); give "
                                                  "/metrics another port, or leave listen out to serve it there")
    teams: tuple[TeamConfig, ...] = take(lambda: _teams(root.get("teams")), ())
    # What a section that failed declared, so the sections naming it do not fail again for it.
    named_upstreams = {**{n: UpstreamConfig(n) for n in _declared(root.get("upstreams"))}, **upstreams}
    team_names = [t.name for t in teams] or _declared(root.get("teams"))
    config = Config(
        path=file,
        server=server,
        store=store,
        policies_dir=base / take(lambda: root.get("policies_dir").optional_str("./policies"), "./policies"),
        runs_dir=take(lambda: _optional_path(root.get("runs_dir"), base), None) or _default_runs_dir(store, base),
        trace_file=take(lambda: _optional_path(root.get("trace_file"), base), None),
        spool_file=take(lambda: _optional_path(root.get("spool_file"), base), None) or base / "spool.jsonl",
        spool_reserve_bytes=take(lambda: _spool_reserve(root.get("spool_reserve_mb")), DEFAULT_SPOOL_RESERVE_MB * 1024 * 1024),
        upstreams=upstreams,
        models=take(lambda: _models(root.get("models"), named_upstreams), ()),
        teams=teams,
        defaults=take(lambda: _defaults(root.get("defaults")), Defaults()),
        metrics=metrics,
        retention=take(lambda: _retention(root.get("retention")), RetentionConfig()),
        webhooks=take(lambda: parse_webhooks(root.get("webhooks"), team_names), ()),
        console=take(lambda: _console(root.get("console")), ConsoleConfig()),
        telemetry=take(lambda: parse_telemetry(root.get("telemetry")), TelemetryConfig()),
        access_log=take(lambda: parse_access_log(root.get("access_log"), base), AccessLogConfig()),
    )
    if policy_names is not None and teams:
        try:
            names = policy_names(config.policies_dir)
        except OSError:  # the folder's own error is the policy load's to report
            names = None
        if names is not None:
            for i, j, problem in unlisted_policies(config, names):
                Field(str(file), f"teams[{i}].policies[{j}]", None, errors).invalid(problem)
    errors.raise_any()
    return config


def unlisted_policies(config: Config, names: Collection[str]) -> list[tuple[int, int, str]]:
    """(team index, index in its policies, problem) for every policy a team lists that is not
    among `names`: the rule of a start and of a reload, whatever read the names."""
    known = ", ".join(sorted(names)) or "none"
    return [(i, j, f"team '{team.name}' lists policy '{name}': no policy named '{name}' in {config.policies_dir} "
             f"(policies: {known})")
            for i, team in enumerate(config.teams) for j, name in enumerate(team.policies) if name not in names]


def _declared(section: Field) -> list[str]:
    """The names a list section declares (`name:` strings), whether or not its entries are valid."""
    value = section.value if isinstance(section.value, list) else []
    return [item["name"] for item in value if isinstance(item, dict) and isinstance(item.get("name"), str)]


def _console(at: Field) -> ConsoleConfig:
    if at.missing or at.value is None:
        return ConsoleConfig()
    at.keys_only({"session_idle_s", "session_max_s"})
    idle = at.get("session_idle_s").optional_number(DEFAULT_SESSION_IDLE_S, positive=True)
    most = at.get("session_max_s").optional_number(DEFAULT_SESSION_MAX_S, positive=True)
    if idle > most:
        at.get("session_idle_s").fail(f"is longer than session_max_s ({most:g}): a session ends at session_max_s "
                                      "whatever its use")
    return ConsoleConfig(idle, most)


def _server(at: Field) -> ServerConfig:
    if at.missing:
        return ServerConfig()
    at.keys_only({"host", "port", "max_body_bytes", "lease_ttl_s", "refusal_status", "public_url", "webhook_poll_s",
                  "budget_scan_s", "shutdown_delay_s", "tool_threads", "header_timeout_s", "body_timeout_s",
                  "idle_timeout_s", "max_connections", "work_slots"})
    refusal = at.get("refusal_status")
    status = refusal.optional_int(429)
    if status not in REFUSAL_STATUSES:
        refusal.invalid(f"must be one of {', '.join(map(str, REFUSAL_STATUSES))}, got {status}")
    return ServerConfig(
        public_url=parse_public_url(at.get("public_url")),
        host=at.get("host").optional_str("127.0.0.1"),
        port=at.get("port").optional_int(8080, low=0, high=65535),
        max_body_bytes=at.get("max_body_bytes").optional_int(DEFAULT_MAX_BODY_BYTES, low=1),
        lease_ttl_s=at.get("lease_ttl_s").optional_number(DEFAULT_LEASE_TTL_S, positive=True),
        refusal_status=status,
        webhook_poll_s=at.get("webhook_poll_s").optional_number(DEFAULT_WEBHOOK_POLL_S, positive=True),
        budget_scan_s=at.get("budget_scan_s").optional_number(DEFAULT_BUDGET_SCAN_S, positive=True),
        shutdown_delay_s=_shutdown_delay(at.get("shutdown_delay_s")),
        tool_threads=at.get("tool_threads").optional_int(DEFAULT_TOOL_THREADS, low=1, high=MAX_TOOL_THREADS),
        header_timeout_s=at.get("header_timeout_s").optional_number(DEFAULT_HEADER_TIMEOUT_S, positive=True),
        body_timeout_s=at.get("body_timeout_s").optional_number(DEFAULT_BODY_TIMEOUT_S, positive=True),
        idle_timeout_s=at.get("idle_timeout_s").optional_number(DEFAULT_IDLE_TIMEOUT_S, positive=True),
        max_connections=at.get("max_connections").optional_int(DEFAULT_MAX_CONNECTIONS, low=1, high=1_000_000),
        work_slots=at.get("work_slots").optional_int(DEFAULT_WORK_SLOTS, low=0, high=100_000),
    )


MAX_SHUTDOWN_DELAY_S = 15.0
"""Below the 20 s a worker of `--workers N` is given to stop before it is killed."""


def _shutdown_delay(at: Field) -> float:
    delay = at.optional_number(0.0, nonnegative=True)
    if delay > MAX_SHUTDOWN_DELAY_S:
        at.invalid(f"must be at most {MAX_SHUTDOWN_DELAY_S:g} (the drain that follows needs time too), got {delay:g}")
        return 0.0
    return delay


def _store(at: Field, base: Path) -> StoreConfig:
    if at.missing:
        return StoreConfig(kind="sqlite", path=str(base / "gateway.db"), options={"kind": "sqlite",
                                                                                  "path": str(base / "gateway.db")})
    mapping = at.mapping()
    kind = at.get("kind").optional_str("sqlite")
    path = at.get("path").optional_str_or_none()
    resolved = str(base / path) if path is not None else None
    options = dict(mapping)
    options["kind"] = kind
    if resolved is not None:
        options["path"] = resolved
    timeout = at.get("timeout_s").optional_number(DEFAULT_STORE_TIMEOUT_S, positive=True)
    allow_eviction = at.get("allow_eviction").optional_bool(False)
    if kind in ("redis", "postgres"):
        options["timeout_s"] = timeout
    return StoreConfig(kind=kind, path=resolved, url=at.get("url").optional_str_or_none(), options=options,
                       timeout_s=timeout, allow_eviction=allow_eviction)


def _spool_reserve(at: Field) -> int:
    megabytes = at.optional_number(DEFAULT_SPOOL_RESERVE_MB, nonnegative=True)
    if megabytes > 1024 * 1024:
        at.invalid(f"must be at most {1024 * 1024} (a terabyte), got {megabytes:g}")
        return DEFAULT_SPOOL_RESERVE_MB * 1024 * 1024
    return int(megabytes * 1024 * 1024)


def _optional_path(at: Field, base: Path) -> Path | None:
    value = at.optional_str_or_none()
    return base / value if value else None


def _default_runs_dir(store: StoreConfig, base: Path) -> Path:
    """`runs/` next to the SQLite file (a store without a file: next to the config)."""
    return (Path(store.path).parent if store.path else base) / "runs"


def _models(section: Field, upstreams: Mapping[str, UpstreamConfig]) -> tuple[ModelRoute, ...]:
    """Two passes: every route's own deployments first, then the fallbacks, which name other
    models routed by this same table (their own fallbacks are not followed: one level)."""
    own: list[tuple[Field, str, tuple[Deployment, ...]]] = []

    def one(at: Field) -> None:
        at.keys_only({"match", "upstream", "price_in", "price_out", "deployments", "fallbacks", "retries",
                      "deadline_s", "cooldown_s", "cooldown_after"})
        match = at.get("match").required().nonempty_str()
        own.append((at, match, _deployments(at, upstreams)))

    section.required().each(one)
    if not own and not section.value:
        section.fail("at least one model route is required (e.g. {match: \"*\", upstream: local})")

    def routed(name: str) -> tuple[Deployment, ...] | None:
        return next((d for _, m, d in own if fnmatch.fnmatchcase(name, m)), None)

    routes = []
    for at, match, deployments in own:
        groups = [Group(None, deployments)]
        fallbacks_at = at.get("fallbacks")
        for f in fallbacks_at.list_of() if not fallbacks_at.missing else []:
            name = f.nonempty_str()
            target = routed(name)
            if target is None:
                f.invalid(f"fallback model '{name}' is not routed by any models[] entry")
                continue
            groups.append(Group(name, target))
        apis = {upstreams[d.upstream].api for g in groups for d in g.deployments if d.upstream in upstreams}
        if len(apis) > 1:
            at.invalid("its deployments and fallbacks mix upstreams with api: chat and api: responses; a route's "
                    "upstreams must speak one API (the request body is built once for it)")
        several = not at.get("deployments").missing or len(groups) > 1
        breaker = Breaker(at.get("cooldown_after").optional_int(Breaker.cooldown_after, low=1, high=1000),
                          at.get("cooldown_s").optional_number(Breaker.cooldown_s, positive=True))
        plan = RoutePlan(tuple(groups),
                         at.get("retries").optional_int(DEFAULT_RETRIES if several else 0, low=0, high=MAX_RETRIES),
                         at.get("deadline_s").optional_number_or_none(positive=True), breaker)
        routes.append(ModelRoute(match, deployments[0].upstream, plan.hold_price(), plan))
    return tuple(routes)


def _deployments(at: Field, upstreams: Mapping[str, UpstreamConfig]) -> tuple[Deployment, ...]:
    """`upstream` + prices (the single form), or `deployments: [{upstream, model?, weight, price_in?,
    price_out?}]` (a deployment without prices takes the route's, or the default)."""
    def upstream_of(f: Field) -> str:
        name = f.required().nonempty_str()
        if name not in upstreams:
            f.invalid(f"no upstream named '{name}' (known: {', '.join(upstreams)})")
        return name

    price = Price(at.get("price_in").optional_number(2.00, nonnegative=True),
                  at.get("price_out").optional_number(12.00, nonnegative=True))
    listed = at.get("deployments")
    if listed.missing:
        return (Deployment(upstream_of(at.get("upstream")), None, 1, price),)
    if not at.get("upstream").missing:
        at.get("upstream").fail("give either upstream or deployments, not both")
    out = []
    for d in listed.list_of():
        d.keys_only({"upstream", "model", "weight", "price_in", "price_out"})
        out.append(Deployment(
            upstream_of(d.get("upstream")), d.get("model").optional_str_or_none(),
            d.get("weight").optional_int(1, low=1, high=1_000_000),
            Price(d.get("price_in").optional_number(price.input_per_million, nonnegative=True),
                  d.get("price_out").optional_number(price.output_per_million, nonnegative=True))))
    if not out:
        listed.fail("at least one deployment is required")
    if len({(d.upstream, d.model) for d in out}) < len(out):
        listed.fail("names the same upstream and model twice")
    return tuple(out)


def _teams(section: Field) -> tuple[TeamConfig, ...]:
    teams: list[TeamConfig] = []
    seen_keys: dict[str, str] = {}

    def one(at: Field) -> None:
        at.keys_only({"name", "keys", "key_env", "budget_usd", "budget_period", "budget_mode", "policies", "admin",
                      "rate_limits", "models", "user_budget_usd", "user_budget_period"})
        name = at.get("name").required().nonempty_str()
        if not TEAM_NAME.fullmatch(name):
            at.get("name").invalid(f"team name {name!r} must be 1-64 letters, digits, '_', '-' or '.', starting with "
                                   "a letter or digit (it scopes the team's run ids, stored as TEAM/ID)")
        if any(t.name == name for t in teams):
            at.get("name").invalid(f"team '{name}' is defined twice")
        config_keys: list[ConfigKey] = []

        def key_entry(k: Field) -> None:
            config_keys.append(_config_key(k) if isinstance(k.value, dict) else ConfigKey(k.nonempty_str()))

        at.get("keys").each(key_entry)
        key_env = at.get("key_env").optional_str_or_none()
        if key_env:
            value = os.environ.get(key_env)
            if not value:
                at.get("key_env").invalid(f"environment variable {key_env} is not set (it should hold the team's key)")
            else:
                config_keys.append(ConfigKey(value))
        if not config_keys and not key_env and not at.get("keys").value:
            at.get("keys").invalid("a team needs at least one key (keys: [...] or key_env: VARIABLE)")
        for i, ck in enumerate(config_keys):
            if ck.key in seen_keys:
                at.get("keys").invalid(f"key #{i + 1} is also a key of team '{seen_keys[ck.key]}'; a key names one team")
            seen_keys[ck.key] = name
        policies_at = at.get("policies")
        policies = [p.nonempty_str() for p in policies_at.required().list_of()]
        if not policies:
            policies_at.invalid("a team needs at least one policy (the first is its default)")
        budget = at.get("budget_usd").optional_number_or_none(nonnegative=True)
        teams.append(TeamConfig(
            name=name, keys=tuple(ck.key for ck in config_keys), policies=tuple(policies), budget_usd=budget,
            budget_period=at.get("budget_period").choice(BUDGET_PERIODS, "month"),
            budget_mode=at.get("budget_mode").choice(("turn", "strict"), "turn"),
            admin=at.get("admin").optional_bool(False),
            rate_limits=parse_rate_limits(at.get("rate_limits")), config_keys=tuple(config_keys),
            models=model_globs(at.get("models")),
            user_budget_usd=at.get("user_budget_usd").optional_number_or_none(nonnegative=True),
            user_budget_period=at.get("user_budget_period").choice(BUDGET_PERIODS, "month"),
        ))

    section.required().each(one)
    if not teams and not _declared(section):
        section.fail("at least one team is required")
    return tuple(teams)


def model_globs(at: Field) -> tuple[str, ...] | None:
    """`models:` an allow-list of model globs (absent or null: every model)."""
    if at.missing or at.value is None:
        return None
    items = at.list_of()
    if len(items) > MAX_GLOBS:
        at.fail(f"lists {len(items)} globs; at most {MAX_GLOBS}")
    out = []
    for item in items:
        glob = item.nonempty_str()
        if len(glob) > MAX_GLOB_CHARS:
            item.fail(f"is {len(glob)} characters long; a glob has at most {MAX_GLOB_CHARS}")
        out.append(glob)
    return tuple(out)


def _config_key(at: Field) -> ConfigKey:
    """`{key: "sk-..." | key_env: NAME, name, user, models, budget_usd, budget_period, manage_keys,
    rate_limits}`: a key with settings of its own."""
    at.keys_only({"key", "key_env", "rate_limits", "name", "user", "models", "budget_usd", "budget_period",
                  "manage_keys"})
    key = at.get("key").optional_str_or_none()
    env = at.get("key_env").optional_str_or_none()
    if (key is None) == (env is None):
        at.fail("a key given as a mapping names exactly one of key (the key) or key_env (a variable holding it)")
    if env is not None:
        key = os.environ.get(env)
        if not key:
            at.get("key_env").fail(f"environment variable {env} is not set (it should hold the key)")
    assert key is not None
    user_at = at.get("user")
    user = user_at.optional_str_or_none()
    if user is not None and check_user(user) is None:
        user_at.fail("must be 1-128 letters, digits, '_', '.', '@', ':', '+', '=', '/' or '-', starting with a letter or digit")
    return ConfigKey(key, name=at.get("name").optional_str(""), user=user, models=model_globs(at.get("models")),
                     budget_usd=at.get("budget_usd").optional_number_or_none(nonnegative=True),
                     budget_period=at.get("budget_period").choice(BUDGET_PERIODS, "month"),
                     manage_keys=at.get("manage_keys").optional_bool(False),
                     limits=parse_rate_limits(at.get("rate_limits")))


def _defaults(at: Field) -> Defaults:
    if at.missing:
        return Defaults()
    at.keys_only({"output_allowance_tokens", "max_calls_in_flight_per_run", "rate_limit_wait_s"})
    return Defaults(
        at.get("output_allowance_tokens").optional_int(DEFAULT_OUTPUT_ALLOWANCE, low=1, high=10_000_000),
        at.get("max_calls_in_flight_per_run").optional_int(DEFAULT_CALLS_IN_FLIGHT_PER_RUN, low=1, high=100_000),
        at.get("rate_limit_wait_s").optional_number(DEFAULT_RATE_LIMIT_WAIT_S, nonnegative=True),
    )


def _metrics(at: Field) -> MetricsConfig:
    if at.missing or at.value is None:
        return MetricsConfig()
    at.keys_only({"token_env", "listen"})
    token_env = at.get("token_env").optional_str_or_none()
    token = None
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            at.get("token_env").fail(f"environment variable {token_env} is not set (it should hold the token "
                                     "a scraper sends as 'Authorization: Bearer <token>')")
    listen_at = at.get("listen")
    raw = listen_at.optional_str_or_none()
    listen = None
    if raw is not None:
        host, sep, port = raw.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            listen_at.fail(f"must be HOST:PORT with a port from 1 to 65535 (e.g. 127.0.0.1:9464), got {raw!r}")
        listen = (host, int(port))
    return MetricsConfig(token_env=token_env, token=token, listen=listen)


def _days(at: Field, default: float | None) -> float | None:
    return default if at.missing else at.optional_number_or_none(positive=True)


def _retention(at: Field) -> RetentionConfig:
    base = RetentionConfig()
    if at.missing:
        return base
    at.keys_only({"runs_days", "events_days", "ledger_days", "trace_file_max_mb", "trace_file_keep", "interval_s",
                  "outbox_days", "spend_days", "audit_days"})
    return RetentionConfig(
        runs_days=_days(at.get("runs_days"), base.runs_days),
        events_days=_days(at.get("events_days"), base.events_days),
        ledger_days=_days(at.get("ledger_days"), base.ledger_days),
        trace_file_max_mb=_days(at.get("trace_file_max_mb"), base.trace_file_max_mb),
        trace_file_keep=at.get("trace_file_keep").optional_int(base.trace_file_keep, low=0),
        interval_s=at.get("interval_s").optional_number(base.interval_s, positive=True),
        outbox_days=_days(at.get("outbox_days"), base.outbox_days),
        spend_days=_days(at.get("spend_days"), base.spend_days),
        audit_days=_days(at.get("audit_days"), base.audit_days),
    )
