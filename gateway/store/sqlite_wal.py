"""WAL checkpoints of the SQLite store, off the event loop.

SQLite's automatic checkpoint runs inside the COMMIT that crosses 1000 WAL pages, on the
committing thread, and costs two fsyncs (the WAL, then the database file): a few
milliseconds during which the event loop serves nobody. The store turns it off
(`wal_autocheckpoint = 0`) and a `Checkpointer` thread, with a connection of its own, copies
the WAL into the database file in the background instead (PASSIVE: it never blocks a
writer, and the GIL is released while SQLite works). Durability does not change: commits
are in the WAL before they return, whoever checkpoints.

A WAL can only restart from its beginning once a checkpoint has copied all of it; under a
steady stream of writes a background pass never catches up, and the WAL would grow without
end. So when it reaches `FENCE_FRAMES` frames, the store holds its next writes (they await;
the loop goes on serving) while one pass copies everything, then lets them go; the first
of them restarts the WAL. Other processes writing the same file (workers, replicas) are
held too, for the end of that pass only: it finishes with a RESTART checkpoint, which waits
for their transactions and keeps new ones out while it copies the last frames (their
writes wait in SQLite's busy handler: milliseconds, `RESTART_WAIT_S` at most).

The WAL's length is what the last pass saw plus what this process wrote since (each write
says roughly how many bytes it stores), so a few large writes between two passes start a
fence as surely as many small ones. A fence that could not restart the WAL (a reader held
it) is not tried again before `FENCE_WRITES` more writes; after one that did, the next may
come as soon as the WAL is long again, whatever the size of the writes.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from typing import Final

from gateway.store.health import Condition

log = logging.getLogger(__name__)

PASS_INTERVAL_S: Final = 0.1
"""How often the thread looks for new commits to copy."""
FENCE_FRAMES: Final = 8192
"""WAL frames (pages of 4 KiB) past which writes are held for one complete pass (32 MiB)."""
FENCE_WRITES: Final = 1000
"""Writes that pass after a fence that could not restart the WAL, before the next fence."""
PAGE_BYTES: Final = 4096
"""The size of a WAL frame's page, to count a write's bytes in frames."""
RESTART_WAIT_S: Final = 0.1
"""How long a fenced pass's RESTART waits for other processes' transactions. It holds off
their writers meanwhile (a transaction held open elsewhere, say a person's sqlite3 shell,
would otherwise stall every writer for the whole busy timeout); past it, the fence lifts
and a later one tries again."""


class Checkpointer:
    """Copies a SQLite file's WAL into it from a daemon thread; see the module docstring."""

    def __init__(self, path: str, busy_timeout_s: float, interval_s: float = PASS_INTERVAL_S) -> None:
        self.path = path
        self.interval_s = interval_s
        self.writes = 0
        """Commits made through the store; bumped by the event loop, read by the thread."""
        self.frames = 0
        """The WAL's length (frames) at the last pass; 0 when the next write restarts it."""
        self.passes = 0
        """Checkpoint passes done."""
        self.fences = 0
        """Fences lifted (times writes were held for a complete pass)."""
        self.written = 0
        """Bytes this process's writes stored so far (as they said); bumped by the event loop."""
        self._written_at_pass = 0
        """`written` when the last pass began (the pass saw those in the WAL's length)."""
        self._restarted = True
        """Whether the last fence restarted the WAL (else the next waits FENCE_WRITES writes)."""
        self._fenced_at = -FENCE_WRITES
        self._fence: asyncio.Future[None] | None = None
        self._fence_request: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._wake = threading.Event()
        self._closing = False
        self._busy_timeout_s = busy_timeout_s
        self.condition = Condition(f"sqlite store {path}", log)
        """Whether passes succeed (a full disk fails them ten times a second: logged once)."""
        self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._thread = threading.Thread(target=self._run, name=f"sqlite-checkpointer:{path}", daemon=True)
        self._thread.start()

    def write(self, size: int = 0) -> asyncio.Future[None] | None:
        """Count a write about to be made, of about `size` bytes (event loop only); returns
        the fence it must await (shielded) first, if there is one, starting one when the WAL
        has grown too long."""
        self.writes += 1
        self.written += size
        frames = self.frames + (self.written - self._written_at_pass) // PAGE_BYTES
        if self._fence is None and frames >= FENCE_FRAMES and (
                self._restarted or self.writes - self._fenced_at >= FENCE_WRITES):
            loop = asyncio.get_running_loop()
            self._fenced_at = self.writes
            self._fence = loop.create_future()
            self._fence_request = (loop, self._fence)
            self._wake.set()
        return self._fence

    def _run(self) -> None:
        seen = 0
        try:
            while not self._closing:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                request, self._fence_request = self._fence_request, None
                if self.writes != seen or request is not None:
                    seen = self.writes
                    self._pass(fenced=request is not None)
                if request is not None:
                    self._lift(*request)
        finally:
            self._conn.close()

    def _pass(self, fenced: bool) -> None:
        before = self.writes
        written = self.written
        try:
            busy, frames, copied = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if fenced:
                # The fence holds this process's writes only: other processes on the file
                # (`--workers`, replicas) keep writing, and no pass would ever copy the WAL
                # whole. RESTART holds every writer of the file (their busy handlers wait)
                # while it copies the few frames the PASSIVE pass left, and makes the next
                # write restart the WAL.
                self._conn.execute(f"PRAGMA busy_timeout = {int(RESTART_WAIT_S * 1000)}")
                try:
                    busy, frames, copied = self._conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
                finally:
                    self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
        except sqlite3.Error as exc:  # the next pass tries again; the WAL keeps every commit meanwhile
            self.condition.fail(f"WAL checkpoint failed: {exc}", exc)
            return
        self.condition.recover()
        self.passes += 1
        # `frames` is the WAL's length when the pass began. All of it copied with no write
        # since (or held by a fence, or by RESTART): the next write restarts the WAL.
        done = not busy and frames == copied and (fenced or self.writes == before)
        self.frames = 0 if done else int(frames)
        self._written_at_pass = written
        if fenced:
            self._restarted = done

    def _lift(self, loop: asyncio.AbstractEventLoop, fence: asyncio.Future[None]) -> None:
        def lift() -> None:
            self.fences += 1
            if self._fence is fence:
                self._fence = None
            if not fence.done():
                fence.set_result(None)

        try:
            loop.call_soon_threadsafe(lift)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def close(self) -> None:
        """Stop the thread (after the pass in progress) and close its connection. Idempotent."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        fence, self._fence = self._fence, None
        if fence is not None and not fence.done():
            try:
                fence.set_result(None)
            except RuntimeError:  # its loop is closed: nobody is waiting any more
                pass
