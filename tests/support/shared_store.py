"""A store several gateway processes share, of either kind made for replicas: Redis or PostgreSQL.

Tests of exactness across replicas run on both (`SHARED_KINDS`, a fixture's params): each
gets a store of its own on the session's server, a Redis key prefix or a PostgreSQL schema.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gateway.store import Store, open_store
from tests.support.postgres import new_schema

SHARED_KINDS = ("redis", "postgres")


def shared_store(kind: str, request: pytest.FixtureRequest, name: str) -> dict[str, Any]:
    """The `store:` config of a new, empty store of `kind` on the session's server."""
    if kind == "redis":
        return {"kind": "redis", "url": request.getfixturevalue("redis_url"), "prefix": f"{name}-{uuid.uuid4().hex[:8]}:"}
    return {"kind": "postgres", "dsn": request.getfixturevalue("postgres_dsn"), "schema": new_schema(name),
            "timeout_s": 10}


def view(config: dict[str, Any]) -> Store:
    """Another client of a shared store (a replica's view), to read what the gateways wrote."""
    return open_store(config)
