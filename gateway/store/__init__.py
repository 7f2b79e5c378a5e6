"""Run, trace, ledger and lease stores: sqlite (default), redis (multi-replica), memory (tests)."""

from gateway.store.base import Booking, Ledger, Store
from gateway.store.errors import (
    KeyExists,
    KeyNotFound,
    RunExists,
    RunNotFound,
    StaleKey,
    StaleRun,
    StoreConfigError,
    StoreError,
)
from gateway.store.factory import open_store

__all__ = ["Booking", "KeyExists", "KeyNotFound", "Ledger", "RunExists", "RunNotFound", "StaleKey", "StaleRun", "Store", "StoreConfigError", "StoreError",
           "open_store"]
