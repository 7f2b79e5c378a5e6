"""Conditions that fail and recover, logged once per change rather than once per attempt.

A full disk fails every write, every checkpoint pass and every trace line, many times a
second: logged per attempt, the log drowns (and, on the same disk, makes it worse). A
`Condition` logs the first failure (with its error), counts the ones that follow
silently, and logs the recovery once with how many failed meanwhile; `on_change(ok)`
tells whoever shows it (a readiness check, a metric) at each change, on any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


def _ignore(ok: bool) -> None:
    return None


class Condition:
    """One named condition (`store`, `spool`, a WAL's checkpoints): ok until `fail`ed."""

    def __init__(self, name: str, logger: logging.Logger, on_change: Callable[[bool], None] = _ignore) -> None:
        self.name = name
        self.on_change = on_change
        self.detail = ""
        """The first error of the current failure ("" while ok)."""
        self.failures = 0
        """Failures since the condition last changed to failing."""
        self._log = logger
        self._since = 0.0
        self._lock = threading.Lock()  # a checkpointer thread and the event loop may both report

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, detail: str, exc: BaseException | None = None) -> None:
        """One more failure; logged (with `exc`'s traceback, if given) only if it was ok."""
        with self._lock:
            self.failures += 1
            if self.failures > 1:
                return
            self.detail, self._since = detail, time.monotonic()
        self._log.error("%s: %s (logged once until it recovers)", self.name, detail, exc_info=exc)
        self.on_change(False)

    def recover(self) -> None:
        """It works again; logged (with how long and how often it failed) only if it was failing."""
        if not self.failures:  # the usual case, on every write: no lock
            return
        with self._lock:
            if not self.failures:
                return
            failures, self.failures, self.detail = self.failures, 0, ""
            lasted = time.monotonic() - self._since
        self._log.warning("%s: recovered after %d failure%s in %.1f s", self.name, failures,
                          "" if failures == 1 else "s", lasted)
        self.on_change(True)
