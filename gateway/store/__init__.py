"""Run, trace, ledger and lease stores: sqlite (default), redis (multi-replica), memory (tests)."""

from gateway.store.base import Booking, Ledger, Store
from gateway.store.errors import (
    RunExists,
    RunNotFound,
    StaleRun,
    StoreConfigError,
    StoreError,
)
from gateway.store.factory import open_store

__all__ = ["Booking", "Ledger", "RunExists", "RunNotFound", "StaleRun", "Store", "StoreConfigError", "StoreError",
           "open_store"]
