"""What a store can refuse, each failure named after what the caller must do about it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.harness.state import RunState


class StoreError(Exception):
    """The store cannot do what was asked (backend unreachable, corrupt data, bad config)."""


class SpoolNotReady(StoreError):
    """The spool has no room set aside (`Spool.intact` is false): a call is refused before
    it is forwarded, since its turn could not be kept if the store failed to take it."""


class StoreConfigError(StoreError, ValueError):
    """The `store:` section of the configuration is wrong; the message names the field."""


class RunExists(StoreError):
    """`create_run` (or an admission's `Claim.create`) was given an id that is already stored.
    `stored`: the stored run, when the store read it in the same step (else None)."""

    def __init__(self, run_id: str, stored: RunState | None = None) -> None:
        super().__init__(f"run {run_id!r} already exists")
        self.run_id = run_id
        self.stored = stored


class RunNotFound(StoreError):
    """`save_run` was given a run that was never created."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} does not exist (create_run it first)")
        self.run_id = run_id


class StaleRun(StoreError):
    """Someone else saved the run since this copy was loaded: reload it and decide again."""

    def __init__(self, run_id: str, expected: int, stored: int) -> None:
        super().__init__(
            f"run {run_id!r} was saved by someone else: this copy is at revision {expected}, "
            f"the store is at revision {stored}; reload the run"
        )
        self.run_id = run_id
        self.expected = expected
        self.stored = stored


class LeaseLost(StoreError):
    """A write made under a run's lease (`Lease`) found that lease no longer the run's: another
    process took the run over, or the lease was released. Nothing was written; the writer
    must stop driving."""

    def __init__(self, run_id: str, epoch: int) -> None:
        super().__init__(f"run {run_id!r}: this process no longer holds its lease (epoch {epoch}); "
                         "another process drives it, or will")
        self.run_id = run_id
        self.epoch = epoch


class AlreadyBooked(StoreError):
    """A `Booking(if_held=True)` whose reservation was settled or released already: the
    commit wrote nothing (the turn it books was booked before)."""

    def __init__(self, reservation_id: str) -> None:
        super().__init__(f"reservation {reservation_id!r} was booked or released already")
        self.reservation_id = reservation_id


class KeyExists(StoreError):
    """`put_key` of a new key whose id is already stored (nothing written)."""

    def __init__(self, key_id: str) -> None:
        super().__init__(f"key {key_id!r} already exists")
        self.key_id = key_id


class KeyNotFound(StoreError):
    """`put_key` of a change to a key that is not stored (nothing written)."""

    def __init__(self, key_id: str) -> None:
        super().__init__(f"key {key_id!r} does not exist")
        self.key_id = key_id


class StaleKey(StoreError):
    """`put_key` of a change made to an older revision of the key: read it again, decide again."""

    def __init__(self, key_id: str, expected: int, stored: int) -> None:
        super().__init__(f"key {key_id!r} was changed by someone else (this copy is at revision {expected}, "
                         f"the store at {stored}); read it again")
        self.key_id = key_id
        self.expected = expected
        self.stored = stored
