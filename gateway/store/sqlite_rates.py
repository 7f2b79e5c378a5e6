"""The rate-limit part of the SQLite admission statement (`SqliteStore.admit`), built once per
set of rate scopes.

A claim's rate scopes (a key's and its team's) come from config and are the same for every
call of a team, so the statement is shaped once per set (`rate_plan`): it names only the
conditions the scopes have (a scope with a request limit alone is not checked for tokens or
calls in flight), binds their figures from a tuple made once, and reads back only the
clocks the answer's `x-ratelimit-*` headers show. Sets of the same shape share one SQL
text, so the driver's statement cache holds one prepared statement per shape, however
many teams and keys have limits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from gateway.store.base import RATE_SLACK_S, RateLimit, RateState, scope_tag
from gateway.store.sqlite_schema import LIVE

CLOCK_SCOPES: Final = 2
"""A reservation spends the clocks of at most two scopes (its columns `clock_a`, `clock_b`)."""
_CLOCK: Final = "(SELECT COALESCE({kind}_tat, 0) FROM reservations WHERE id = :s{i})"
"""A scope's clock: its row of the reservations table (sqlite_schema: on the admission's page)."""
_FITS: Final = " AND MAX({clock}, :now) + {cost} - :now <= :w{i} + " + repr(RATE_SLACK_S)
"""A GCRA check (`base.fits`) of the i-th scope's clock, in SQL."""


ADMIT_ARGS: Final = ("id", "team", "period", "amount", "expires", "run", "owner", "scopes", "now", "max_turns",
                     "max_in_flight", "run_budget", "budget", "team_in_flight", "budgets", "attrib")
"""The arguments of the admission statement without rate limits, in the order of its numbered
parameters (?1, ?2, ...); a plan's statement takes the call's counted tokens next, then its
own figures (`RatePlan.args`). A tuple binds faster than a dict of names, for which the
driver makes a str of every parameter's name to look it up (about 2 us per limited call)."""


def numbered(sql: str, names: Sequence[str]) -> str:
    """`sql` with each `:name` parameter replaced by its number in `names` (?1 for the first)."""
    index = {name: i for i, name in enumerate(names, 1)}
    return re.sub(r":(\w+)", lambda m: f"?{index[m.group(1)]}", sql)


@dataclass(frozen=True)
class RatePlan:
    """The admission statement for one set of scopes (numbered parameters: `ADMIT_ARGS`, then
    `args`), its `scopes` argument (the scopes whose calls in flight the reservation counts
    in), the scopes whose clocks it spends (their clock rows must exist), and where in its
    RETURNING row (which ends with the run's revision) each scope's clocks are (None: a
    scope without clocks)."""

    sql: str
    scopes: str | None
    args: tuple[Any, ...] | None
    """The plan's figures, bound after ADMIT_ARGS and the call's counted tokens; None: the
    statement takes neither."""
    clocked: tuple[str, ...]
    read_at: tuple[int | None, ...]
    own_team: str | None = None
    """When the plan's one scope is a team's calls in flight and nothing else (the claim of a
    call whose request and tokens were taken ahead): that team. A claim of that team binds
    `team_in_flight` of the admission without rate limits instead (`own_in_flight`)."""
    own_in_flight: int | None = None


def rate_plan(rates: Sequence[RateLimit], admit: str, revision: str,
              head: Sequence[str] = ADMIT_ARGS) -> RatePlan:
    """The plan for `rates`; `admit` is the statement without rate limits (parameters by
    name, `head`: ADMIT_ARGS and those of the claim's holds), with `{clocks}` and `{values}`
    where the reservation's clock columns go; `revision` the expression its RETURNING row
    ends with (the run's revision)."""
    clocked = [r for r in rates if r.requests is not None or r.tokens is not None]
    if len(clocked) > CLOCK_SCOPES:
        raise ValueError(f"the sqlite store keeps the clocks of {CLOCK_SCOPES} rate scopes per claim, "
                         f"got {len(clocked)}")
    params: dict[str, Any] = {}
    checks: list[str] = []
    returning: list[str] = []
    read_at: list[int | None] = []
    columns = values = ""
    for i, r in enumerate(rates):
        requests_clock, tokens_clock = (_CLOCK.format(kind=kind, i=i) for kind in ("requests", "tokens"))
        if r.requests_s is not None:
            checks.append(_FITS.format(clock=requests_clock, cost=f":rs{i}", i=i))
        if r.tokens_s is not None:
            checks.append(_FITS.format(clock=tokens_clock, cost=f":tokens * :ts{i}", i=i))
        if r.max_in_flight is not None:
            checks.append(f" AND {in_flight(r.scope, f':tag{i}')} < :mif{i}")
            params.update({f"mif{i}": r.max_in_flight, f"tag{i}": in_flight_arg(r.scope)})
        if r in clocked:
            # RETURNING reports the clocks as the statement found them (SQLite's RETURNING
            # does not see the trigger's changes); `spent` adds what the trigger added.
            # The trigger (sqlite_schema) spends these clocks in the INSERT itself: the
            # reservation's clock columns take the scope and its figures (NULL: no such limit).
            x = "ab"[len(returning) // 2]
            read_at.append(len(returning))
            returning += [requests_clock, tokens_clock]
            columns += f", clock_{x}, requests_s_{x}, tokens_s_{x}"
            values += f", :s{i}, :rs{i}, :ts{i}"
            params.update({f"s{i}": r.scope, f"w{i}": r.window_s, f"rs{i}": r.requests_s, f"ts{i}": r.tokens_s})
        else:
            read_at.append(None)
    if clocked:
        columns += ", tokens, admitted_at"
        values += ", :tokens, :now"
    sql = admit.format(clocks=columns, values=values) + "".join(checks) + " RETURNING " + ", ".join(
        [*returning, revision])
    scopes = "".join(scope_tag(r.scope) for r in rates if r.max_in_flight is not None and not _team(r.scope)) or None
    # The driver wants as many arguments as the highest number: none past ADMIT_ARGS when the
    # statement uses none (scopes without any limit).
    args = tuple(params.values()) if params or ":tokens" in sql else None
    own = rates[0] if len(rates) == 1 and not clocked and _team(rates[0].scope) else None
    return RatePlan(numbered(sql, (*head, "tokens", *params)), scopes, args,
                    tuple(r.scope for r in clocked), tuple(read_at), None if own is None else own.scope[5:],
                    None if own is None else own.max_in_flight)


def _team(scope: str) -> bool:
    return scope.startswith("team:")


def in_flight(scope: str, param: str) -> str:
    """The SQL that counts a scope's calls in flight, its argument bound as `param`
    (`in_flight_arg`): a team's are its held reservations (read in its index), a key's those
    whose `scopes` name it."""
    if _team(scope):
        return team_in_flight(param)
    return f"(SELECT COUNT(*) FROM reservations WHERE instr(scopes, {param}) > 0 AND {LIVE})"


def team_in_flight(param: str) -> str:
    """The SQL that counts the calls in flight of the team named by `param`: its held reservations."""
    return f"(SELECT COUNT(*) FROM reservations WHERE team = {param} AND {LIVE})"


def in_flight_arg(scope: str) -> str:
    """`in_flight`'s argument for `scope`: the team's name, or the key's tag in `scopes`."""
    return scope[5:] if _team(scope) else scope_tag(scope)


def spent(plan: RatePlan, rates: Sequence[RateLimit], row: Sequence[float] | None, now: float,
          tokens: int) -> tuple[RateState, ...]:
    """Each scope's clocks after a granted claim spent them (as the trigger did), from the
    clocks the statement read before (`row`, its RETURNING row). On every granted call of a
    limited team: plain comparisons, no max() calls."""
    out = []
    for r, at in zip(rates, plan.read_at, strict=True):
        if at is None or row is None:
            out.append(RateState(r.scope, now))
            continue
        requests_tat, tokens_tat = row[at], row[at + 1]
        if r.requests_s is not None:
            requests_tat = (requests_tat if requests_tat > now else now) + r.requests_s
        if r.tokens_s is not None:
            tokens_tat = (tokens_tat if tokens_tat > now else now) + tokens * r.tokens_s
        out.append(RateState(r.scope, now, requests_tat, tokens_tat))
    return tuple(out)
