"""Fair shares of the process's own work: one team's flood does not slow every other team.

A gateway process does its own work for a call on one event loop: the admission (a store
step) before forwarding, the booking (another) after the answer. With many calls of one
team in those steps at once, every other team's call waits behind all of them at each of
its own steps: a team calling at 1,300 req/s raised another team's p50 tenfold.

`FairShare` gives each team a share of that work: at most `server.work_slots` calls of one
team in those steps at once. A pass-through call holds a slot of its team (its `Share`)
from the moment its body is read until it is forwarded, and again from the upstream's
answer until its turn is booked; a call past its team's share waits in its team's queue
(oldest first) for one of its team's calls to leave. Another team's calls are not held up
by that queue: a team with one call in flight competes with at most `slots` calls of a
flooding team in each of its steps, whatever the flood's size. The wait for the upstream is
outside the slots (a call holds none while its upstream works), so the number of calls in
flight is not limited by them.

The share is a limit only while more than one team has calls in flight (and for `SHARED_S`
after): a team alone has the process to itself; when another comes, the first team's
calls past its share drain. The price is paid by the team past its share, and only while
it shares the process: its calls queue. Cost when nothing waits: a few dict operations per
step. `slots = 0` turns it off.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Final


SHARED_S: Final = 1.0
"""How long after the last moment two teams had calls in flight at once the slots stay a
limit: a team calling one call after the other is never alone for more than an instant."""


def _ignore(team: str) -> None:
    return None


class FairShare:
    """Each team's share of the process's own work: `slots` calls at a time per team, while
    more than one team has calls in flight."""

    def __init__(self, slots: int, on_wait: Callable[[str], None] = _ignore) -> None:
        self.slots = slots
        self.held: dict[str, int] = {}
        """Slots held, by team."""
        self.calls: dict[str, int] = {}
        """Calls in flight (with a `Share`), by team."""
        self.shared_until = 0.0
        """Until when (loop time) more than one team counts as active: only then are the
        slots a limit (a team alone has the process to itself)."""
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._on_wait = on_wait

    def _limited(self) -> bool:
        return asyncio.get_running_loop().time() <= self.shared_until

    async def enter(self, team: str) -> None:
        """Take one of `team`'s slots: at once while it holds fewer than `slots` (or is alone)
        and none of its calls waits, else in its queue until one of its calls leaves."""
        held = self.held.get(team, 0)
        if team not in self._waiting and (held < self.slots or not self._limited()):
            self.held[team] = held + 1
            return
        self._on_wait(team)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(team, deque())
        queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a slot as it was cancelled: pass it on
                self.leave(team)
            else:
                queue.remove(turn)
                if not queue:
                    del self._waiting[team]
            raise

    def leave(self, team: str) -> None:
        """Give one of `team`'s slots back: to its oldest waiting call, if it may have one now."""
        held = self.held[team] - 1
        queue = self._waiting.get(team)
        if queue is not None and (held < self.slots or not self._limited()):
            turn = queue.popleft()
            if not queue:
                del self._waiting[team]
            turn.set_result(None)  # the slot passes on: `held` stays
            return
        if held:
            self.held[team] = held
        else:
            del self.held[team]

    def waiting(self) -> int:
        """Calls waiting for a slot."""
        return sum(len(q) for q in self._waiting.values())


class Share:
    """One call's hold on its team's share: taken for the gateway's own work, given back
    while the upstream works, taken again for the booking. Both idempotent."""

    __slots__ = ("fair", "team", "held", "open")

    def __init__(self, fair: FairShare, team: str) -> None:
        self.fair = fair
        self.team = team
        self.held = False
        self.open = True
        calls = fair.calls
        calls[team] = calls.get(team, 0) + 1
        if len(calls) > 1:  # another team is in flight too: the slots are shared for a while
            fair.shared_until = asyncio.get_running_loop().time() + SHARED_S

    async def take(self) -> None:
        if not self.held and self.fair.slots:
            await self.fair.enter(self.team)
            self.held = True

    async def take_for_booking(self) -> bool:
        """`take`, for a booking that must happen whatever comes: False when the wait was
        cancelled (the caller books without a slot, then lets the cancel go on)."""
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # cancelled already (a client gone): book at once
            return True
        try:
            await self.take()
        except asyncio.CancelledError:
            return False
        return True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.fair.leave(self.team)

    def close(self) -> None:
        """The call is over: it no longer counts as in flight, and its slot is given back."""
        if self.open:
            self.open = False
            calls = self.fair.calls
            left = calls[self.team] - 1
            if left:
                calls[self.team] = left
            else:
                del calls[self.team]
        self.give_back()
