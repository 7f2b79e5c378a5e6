"""Which deployment answers a call: the route plan, weighted least-in-flight selection and
the cooldown (circuit breaker) of each deployment. Pure state, no I/O, no clock of its own
(the caller passes `now`), so it is cheap on every call and testable without a server.

A route's plan is a list of groups: its own deployments first, then the deployments of
each fallback model in order. A call picks, in this order:

1. an available deployment not tried yet in this call, from the first group that has one
   (so fallbacks are reached only when every deployment before them failed or is cooling);
2. an available deployment already tried (the same one again: a retry, after a backoff);
3. when every deployment is cooling, the one that cools off first (the call waits for it,
   within its deadline), so a call is never refused without an attempt.

Within a group the pick is least in flight relative to weight (`in_flight / weight`), ties
broken by smooth weighted round-robin, so an idle route splits calls by weight exactly and
a busy one sends the next call where the fewest wait.

A deployment is available when its breaker is closed, or open but past its cooldown with no
probe in flight (half-open: that call is the probe), and past any `retry-after` it gave.
`cooldown_after` consecutive failures open the breaker for `cooldown_s`; a failed probe
opens it again for twice as long (up to `MAX_COOLDOWN_S`); a success closes it.
Breaker state is per process: each replica learns on its own. A plan with one deployment
and no fallbacks has nothing to route around and is never cooled down.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Literal

from gateway.harness.usage import Price

__all__ = ["Breaker", "Deployment", "Group", "Health", "Outcome", "Pick", "RETRYABLE", "RoutePlan", "Router"]

Outcome = Literal["ok", "unreachable", "timeout", "rate_limited", "server_error", "denied", "rejected", "malformed",
                  "cut", "misconfigured"]
"""How one attempt ended (the `outcome` label of gateway_upstream_attempts_total)."""

RETRYABLE: frozenset[Outcome] = frozenset({"unreachable", "timeout", "rate_limited", "server_error", "cut",
                                           "misconfigured"})
"""Outcomes after which another attempt is made (if none of the answer reached the client)."""

HEALTHY: frozenset[Outcome] = frozenset({"ok", "rejected"})
"""Outcomes that show the deployment works (a 4xx is the request's fault, not the deployment's)."""

MAX_COOLDOWN_S = 300.0


@dataclass(frozen=True)
class Deployment:
    """One place a model is served: an upstream, the model name it is asked for (None: the
    name the client asked for, or the fallback's name), its share of calls and its price."""

    upstream: str
    model: str | None
    weight: int
    price: Price
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Looked up on every call (its health): hash once, not the fields every time.
        object.__setattr__(self, "_hash", hash((self.upstream, self.model, self.weight, self.price)))

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True)
class Group:
    """The deployments of one model name: the route's own (`model` None) or a fallback's."""

    model: str | None
    deployments: tuple[Deployment, ...]


@dataclass(frozen=True)
class Breaker:
    """A route's cooldown settings."""

    cooldown_after: int = 3
    cooldown_s: float = 30.0


@dataclass(frozen=True)
class RoutePlan:
    """Everything a call needs to route: groups in order, the attempt cap (1 + retries),
    the total deadline (None: only the upstreams' own timeouts) and the breaker."""

    groups: tuple[Group, ...]
    retries: int = 0
    deadline_s: float | None = None
    breaker: Breaker = field(default_factory=Breaker)

    @property
    def single(self) -> bool:
        """One deployment, no retries: the plain proxy path."""
        return self.retries == 0 and len(self.groups) == 1 and len(self.groups[0].deployments) == 1

    def hold_price(self) -> Price:
        """The most any deployment of the plan may charge per token, in and out: what a call's
        budget hold is taken at, so whichever deployment answers, the hold covers it."""
        prices = [d.price for g in self.groups for d in g.deployments]
        return Price(max(p.input_per_million for p in prices), max(p.output_per_million for p in prices))


class Health:
    """One deployment's live state in this process."""

    __slots__ = ("failures", "open_until", "opens", "probing", "in_flight", "not_before", "current")

    def __init__(self) -> None:
        self.failures = 0  # consecutive
        self.open_until: float | None = None  # breaker open (cooling) until then; None: closed
        self.opens = 0  # consecutive openings (a failed probe doubles the cooldown)
        self.probing = False
        self.in_flight = 0
        self.not_before = 0.0  # its last retry-after
        self.current = 0.0  # smooth weighted round-robin

    def available(self, now: float) -> bool:
        if now < self.not_before:
            return False
        if self.open_until is None:
            return True
        return now >= self.open_until and not self.probing

    def ready_at(self) -> float:
        return max(self.open_until or 0.0, self.not_before)


@dataclass(frozen=True)
class Pick:
    """The deployment for the next attempt, the model name to ask it for, and how long to
    wait first (a deployment that is cooling or asked for a `retry-after`)."""

    deployment: Deployment
    model: str
    group: int
    wait_s: float
    probe: bool


class Router:
    """The health of every deployment this process calls, and the pick of the next one."""

    def __init__(self) -> None:
        self._health: dict[Deployment, Health] = {}

    def keep(self, deployments: Set[Deployment]) -> None:
        """Forget the health of every deployment but these (a reload's routes): a call still
        on a forgotten one starts its health afresh."""
        self._health = {d: h for d, h in self._health.items() if d in deployments}

    def health(self, deployment: Deployment) -> Health:
        found = self._health.get(deployment)
        if found is None:
            found = self._health[deployment] = Health()
        return found

    def pick(self, plan: RoutePlan, model: str, tried: Sequence[Deployment], now: float) -> Pick:
        """The next attempt's deployment (see the module docstring for the order)."""
        groups = plan.groups
        if len(groups) == 1 and len(groups[0].deployments) == 1:
            # Nothing to route around: never cooled (a breaker would only refuse calls
            # without trying), but a retry-after it gave is still waited for.
            only = groups[0].deployments[0]
            return Pick(only, only.model or model, 0, max(0.0, self.health(only).not_before - now), False)
        for fresh in (True, False):
            for index, group in enumerate(groups):
                choice = self._best(group.deployments, tried, fresh, now)
                if choice is not None:
                    return self._taken(plan, model, index, choice, now)
        index, soonest = min(((i, d) for i, g in enumerate(groups) for d in g.deployments),
                             key=lambda pair: self.health(pair[1]).ready_at())
        return self._taken(plan, model, index, soonest, now)

    def _best(self, deployments: Sequence[Deployment], tried: Sequence[Deployment], fresh: bool,
              now: float) -> Deployment | None:
        # Plain loops (no comprehensions, min/max/sum calls): this runs on every routed call.
        known = self._health
        least = -1.0
        tied: list[tuple[Deployment, Health]] = []  # the candidates least in flight for their weight
        for d in deployments:
            if (d not in tried) != fresh:
                continue
            h = known.get(d) or self.health(d)
            if not h.available(now):
                continue
            load = h.in_flight / d.weight
            if not tied or load < least:
                least, tied = load, [(d, h)]
            elif load == least:
                tied.append((d, h))
        if len(tied) <= 1:
            return tied[0][0] if tied else None
        total = 0
        best, top = tied[0]
        for d, h in tied:  # smooth weighted round-robin among them; the first of equals wins
            total += d.weight
            h.current += d.weight
            if h.current > top.current:
                best, top = d, h
        top.current -= total
        return best

    def _taken(self, plan: RoutePlan, model: str, index: int, deployment: Deployment, now: float) -> Pick:
        health = self.health(deployment)
        wait = max(0.0, health.ready_at() - now)
        probe = health.open_until is not None
        if probe:
            health.probing = True
        name = deployment.model or plan.groups[index].model or model
        return Pick(deployment, name, index, wait, probe)

    def started(self, deployment: Deployment) -> None:
        self.health(deployment).in_flight += 1

    def abandoned(self, pick: Pick) -> None:
        """A pick that was never attempted (the call gave up first): its probe slot is free again."""
        if pick.probe:
            self.health(pick.deployment).probing = False

    def finished(self, deployment: Deployment, outcome: Outcome, breaker: Breaker, now: float,
                 retry_after_s: float | None = None) -> bool:
        """Record how an attempt ended; True when it opened (or re-opened) the breaker."""
        health = self.health(deployment)
        health.in_flight = max(0, health.in_flight - 1)
        was_probe, health.probing = health.probing, False
        if retry_after_s:
            health.not_before = max(health.not_before, now + retry_after_s)
        if outcome in HEALTHY:
            health.failures = 0
            health.opens = 0
            health.open_until = None
            return False
        health.failures += 1
        if was_probe or health.failures >= breaker.cooldown_after:
            health.opens += 1
            cooldown = min(MAX_COOLDOWN_S, breaker.cooldown_s * 2 ** (health.opens - 1))
            health.open_until = now + max(cooldown, retry_after_s or 0.0)
            return True
        return False

    def cooling(self) -> list[Deployment]:
        """The deployments whose breaker is open (cooling or waiting for a probe)."""
        return [d for d, h in self._health.items() if h.open_until is not None]
