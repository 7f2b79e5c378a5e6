"""Readiness: named checks, each of which must pass for this process to take calls.

`Readiness.add(name, check)` registers one; `GET /readyz` (`gateway.server.probes`) runs
them all in the order they were added and answers 503 naming every one that fails. A check
is an async callable returning a `Check`; it should answer in milliseconds (a store probe
has the store's own deadline). The app adds `draining` (a SIGTERM was received: fails
first, so a load balancer stops sending before the listener closes), `store` (the store
answers, and takes this process's writes) and `spool` (the spool's reserve is intact);
more can be added beside them (policies loaded, MCP servers up) without touching these.
Each check's state is also the `gateway_ready{check}` gauge, set as `/readyz` runs and,
for checks that track a condition, as it changes (`set`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

DRAINING: Final = "draining"


@dataclass(frozen=True)
class Check:
    """One check's answer: ok, or what is wrong (words fit for an operator, never a secret)."""

    ok: bool
    detail: str = ""


CheckFn = Callable[[], Awaitable[Check]]


def _ignore(name: str, ok: bool) -> None:
    return None


class Readiness:
    """The process's readiness checks, by name, in order."""

    def __init__(self, gauge: Callable[[str, bool], None] = _ignore) -> None:
        self._checks: dict[str, CheckFn] = {}
        self.gauge = gauge
        """Told (check, ok) whenever a check's state is known (the `gateway_ready` metric)."""
        self.draining = False

        async def draining() -> Check:
            return Check(False, "the process is shutting down") if self.draining else Check(True)

        self.add(DRAINING, draining)

    def add(self, name: str, check: CheckFn) -> None:
        """Register `check` under `name` (a short code: it labels the metric); a name is added once."""
        if name in self._checks:
            raise ValueError(f"readiness check {name!r} is added twice")
        self._checks[name] = check
        self.gauge(name, True)

    def names(self) -> list[str]:
        return list(self._checks)

    def drain(self) -> None:
        """From now on the process is not ready (it is shutting down)."""
        self.draining = True
        self.gauge(DRAINING, False)

    def set(self, name: str, ok: bool) -> None:
        """A tracked condition behind check `name` changed (keeps the gauge current between probes)."""
        self.gauge(name, ok)

    async def run(self) -> dict[str, Check]:
        """Every check's answer, by name."""
        out: dict[str, Check] = {}
        for name, check in self._checks.items():
            out[name] = result = await check()
            self.gauge(name, result.ok)
        return out
