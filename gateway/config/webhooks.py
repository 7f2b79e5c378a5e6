"""`webhooks:` of config.yaml: where notifications go, which events, signed with whose secret.

    webhooks:
      - url: https://hooks.example.com/gateway      # http:// or https://
        secret_env: GATEWAY_WEBHOOK_SECRET          # read at start; a missing variable stops `gateway serve`
                                                    # (not `gateway prune` or `trace`, which send nothing)
        events: [approval_required, approval_decided, run_stopped, budget_threshold]
        teams: [demo]                               # optional: only these teams' runs and budgets
        reasons: [max_budget, team_budget]          # optional: only run_stopped with these reasons
        format: json                                # json (default) | slack
        name: ops-hook                              # optional (default: the url's host); names it in
                                                    # metrics and logs (the url is never shown: it may hold a secret)
        timeout_s: 10                               # one delivery attempt's deadline
        max_attempts: 12                            # attempts before the notice is given up
        retry_base_s: 1                             # the wait after the first failed attempt (doubles each time)

Every error is a ConfigError naming the field (docs/config.md, docs/notifications.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, get_args
from urllib.parse import urlsplit

from gateway.harness.options import StopReason
from gateway.config.fields import ConfigError, Field

NoticeEvent = Literal["approval_required", "approval_decided", "run_stopped", "budget_threshold"]
NOTICE_EVENTS: Final[tuple[NoticeEvent, ...]] = get_args(NoticeEvent)
WebhookFormat = Literal["json", "slack"]
RUN_STOP_REASONS: Final[tuple[str, ...]] = (*get_args(StopReason), "team_budget", "key_budget", "user_budget",
                                            "crashed", "upstream_error", "internal_error")
"""Every `reason` a run_stopped line may carry (docs/runs.md): the loop's and the gateway's."""
_EVENT_OF: Final[dict[str, NoticeEvent]] = {e: e for e in NOTICE_EVENTS}
MAX_URL: Final = 2048
DEFAULT_TIMEOUT_S: Final = 10.0
DEFAULT_MAX_ATTEMPTS: Final = 12
DEFAULT_RETRY_BASE_S: Final = 1.0
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:#\-]{0,99}")


@dataclass(frozen=True)
class WebhookConfig:
    """One `webhooks[i]`. `teams`/`reasons` None: every team, every reason."""

    name: str
    url: str
    secret_env: str
    secret: bytes | None = field(repr=False)
    """None: the variable was not set when the config was read (`require_secrets` refuses to serve)."""
    events: frozenset[NoticeEvent]
    teams: frozenset[str] | None = None
    reasons: frozenset[str] | None = None
    format: WebhookFormat = "json"
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_base_s: float = DEFAULT_RETRY_BASE_S
    """The wait after the first failed attempt; it doubles after each one (up to 5 minutes)."""

    def wants(self, event: NoticeEvent, team: str, reason: str | None = None) -> bool:
        """Whether this webhook is sent `event` of `team` (a run_stopped with `reason`)."""
        if event not in self.events or (self.teams is not None and team not in self.teams):
            return False
        return event != "run_stopped" or self.reasons is None or reason in self.reasons


def parse_public_url(at: Field) -> str | None:
    """`server.public_url`: the address people reach this gateway at (links in notices)."""
    value = at.optional_str_or_none()
    if value is None:
        return None
    _check_url(at, value)
    return value.rstrip("/")


def parse_webhooks(section: Field, teams: Collection[str]) -> tuple[WebhookConfig, ...]:
    """`webhooks:` validated against the configured `teams`."""
    out: list[WebhookConfig] = []

    def one(at: Field) -> None:
        at.keys_only({"name", "url", "secret_env", "events", "teams", "reasons", "format", "timeout_s",
                      "max_attempts", "retry_base_s"})
        url_at = at.get("url")
        url = url_at.required().nonempty_str()
        _check_url(url_at, url)
        name_at = at.get("name")
        host = urlsplit(url).hostname or "webhook"
        name = name_at.optional_str_or_none() or (host if all(w.name != host for w in out) else f"{host}#{len(out)}")
        if not _NAME.fullmatch(name):
            name_at.fail(f"must be 1-100 letters, digits or '_.:-', starting with a letter or digit, got {name!r}")
        if any(w.name == name for w in out):
            name_at.invalid(f"webhook '{name}' is defined twice (give each a distinct name)")
        env_at = at.get("secret_env")
        env = env_at.required().nonempty_str()
        secret = os.environ.get(env) or None
        events_at = at.get("events").required()
        events = [_EVENT_OF[_one_of(e, NOTICE_EVENTS, "event")] for e in events_at.list_of()]
        if not events:
            events_at.fail(f"a webhook needs at least one event (of {', '.join(NOTICE_EVENTS)})")
        teams_at = at.get("teams")
        chosen = None
        if not teams_at.missing and teams_at.value is not None:
            chosen = frozenset(_one_of(t, tuple(teams), "team") for t in teams_at.list_of())
        reasons_at = at.get("reasons")
        reasons = None
        if not reasons_at.missing and reasons_at.value is not None:
            if "run_stopped" not in events:
                reasons_at.fail("filters run_stopped notices, but events does not list run_stopped")
            reasons = frozenset(_one_of(r, RUN_STOP_REASONS, "run_stopped reason") for r in reasons_at.list_of())
        out.append(WebhookConfig(
            name=name, url=url, secret_env=env, secret=None if secret is None else secret.encode(), events=frozenset(events), teams=chosen,
            reasons=reasons, format=at.get("format").choice(("json", "slack"), "json"),
            timeout_s=at.get("timeout_s").optional_number(DEFAULT_TIMEOUT_S, positive=True),
            max_attempts=at.get("max_attempts").optional_int(DEFAULT_MAX_ATTEMPTS, low=1, high=100),
            retry_base_s=at.get("retry_base_s").optional_number(DEFAULT_RETRY_BASE_S, positive=True),
        ))

    section.each(one)
    return tuple(out)


def require_secrets(file: str, webhooks: Sequence[WebhookConfig]) -> None:
    """What serving needs and reading the config does not: every webhook's secret, or a
    ConfigError naming the variable that is not set."""
    for i, hook in enumerate(webhooks):
        if hook.secret is None:
            raise ConfigError(file, f"webhooks[{i}].secret_env", f"environment variable {hook.secret_env} is not "
                              "set (it should hold the secret this webhook's messages are signed with)")


def _one_of(at: Field, options: tuple[str, ...], what: str) -> str:
    value = at.nonempty_str()
    if value not in options:
        at.fail(f"unknown {what} {value!r}; expected one of {', '.join(options)}")
    return value


def _check_url(at: Field, url: str) -> None:
    if len(url) > MAX_URL or any(c.isspace() for c in url):
        at.fail(f"must be an http:// or https:// URL of at most {MAX_URL} characters without spaces")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        at.fail(f"is not a valid URL ({exc}): {url!r}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        at.fail(f"must be an http:// or https:// URL with a host (e.g. https://hooks.example.com/gateway), got {url!r}")
