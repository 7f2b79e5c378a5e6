"""Each team's share of a process's own work: a flood queues, a quiet team does not.

`FairShare` on its own (no timing: each step is awaited or checked in order): while two
teams have calls in flight, a team past its share queues (oldest first) and a quiet team's
call is not held up by that queue; a team alone is not limited, and its calls past the
share drain once another comes; a call cancelled while it waits leaves the queue, one
cancelled as it is handed a slot passes the slot on, and a booking is told that its wait
was cancelled rather than dropped. The gateway wiring (slots taken around admission and
booking, given back while the upstream works) is tests/server/test_flood.py; the figure,
benchmarks/team_flood.py.
"""

from __future__ import annotations

import asyncio

from gateway.server.runs.fair_share import FairShare, Share


async def settle() -> None:
    """Let every task that can run, run (a handful of loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_quiet_team_is_not_held_up_by_a_floods_queue() -> None:
    waits: list[str] = []
    fair = FairShare(2, waits.append)
    earlier = Share(fair, "quiet")  # the quiet team has a call in flight: the process is shared
    served: list[str] = []
    shares: dict[str, Share] = {}

    async def call(team: str, name: str) -> None:
        shares[name] = Share(fair, team)
        await shares[name].take()
        served.append(name)

    for i in range(2):
        await call("flood", f"flood-{i}")  # the flood's share: both its slots
    queued = [asyncio.ensure_future(call("flood", f"flood-{i}")) for i in range(2, 12)]
    await settle()
    assert served == ["flood-0", "flood-1"] and fair.waiting() == 10 and waits.count("flood") == 10
    await call("quiet", "quiet")  # at once, ahead of the ten flood calls queued before it
    assert served[-1] == "quiet" and "quiet" not in waits
    for i in range(10):  # the flood's steps end one by one: its queue goes on, oldest first
        shares[f"flood-{i}"].close()
        await settle()
    assert served == ["flood-0", "flood-1", "quiet", *[f"flood-{i}" for i in range(2, 12)]]
    await asyncio.gather(*queued)
    assert fair.held == {"flood": 2, "quiet": 1} and fair.waiting() == 0
    earlier.close()


async def test_a_team_alone_has_the_process_to_itself_and_drains_when_another_comes() -> None:
    fair = FairShare(2)
    flood = [Share(fair, "flood") for _ in range(5)]
    for share in flood:
        await share.take()  # alone: no limit
    assert fair.held == {"flood": 5} and fair.waiting() == 0
    quiet = Share(fair, "quiet")  # now two teams share the process
    more = Share(fair, "flood")
    waiting = asyncio.ensure_future(more.take())
    await quiet.take()  # the quiet team at once
    await settle()
    assert quiet.held and not more.held and fair.waiting() == 1
    for share in flood[:3]:  # the flood drains to its share before its next call goes on
        share.close()
        await settle()
        assert not more.held
    flood[3].close()
    await waiting
    assert more.held and fair.held == {"flood": 2, "quiet": 1}


async def test_a_call_cancelled_while_it_waits_leaves_no_slot_behind() -> None:
    fair = FairShare(1)
    other = Share(fair, "quiet")  # two teams: the share is a limit
    holder, first, second = Share(fair, "flood"), Share(fair, "flood"), Share(fair, "flood")
    await holder.take()
    waiting = asyncio.ensure_future(first.take())
    await settle()
    waiting.cancel()
    await settle()
    assert fair.waiting() == 0 and not first.held
    handed = asyncio.ensure_future(second.take())
    await settle()
    holder.close()  # handed to the second call...
    handed.cancel()  # ...cancelled before it ran: the slot is given back, not lost
    await settle()
    assert fair.held == {} and fair.waiting() == 0
    other.close()


async def test_a_booking_waits_its_turn_but_is_never_dropped_by_a_cancel() -> None:
    fair = FairShare(1)
    other = Share(fair, "quiet")
    holder, share = Share(fair, "flood"), Share(fair, "flood")
    await holder.take()
    booking = asyncio.ensure_future(share.take_for_booking())
    await settle()
    booking.cancel()  # the client left while the booking waited for a slot
    assert await asyncio.wait_for(asyncio.shield(booking), 1) is False  # told so: it books without a slot
    assert not share.held and fair.waiting() == 0
    other.close()


async def test_no_slots_is_off() -> None:
    fair = FairShare(0)
    shares = [Share(fair, team) for team in ("a", "b") * 50]
    for share in shares:
        await share.take()
    assert fair.held == {} and not any(share.held for share in shares)
