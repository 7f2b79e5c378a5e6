"""Fixtures for the scripted provider: the app on a real aiohttp test server, a fresh sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from gateway.providers.scripted import standalone_app
from gateway.tools.files import Sandbox, fresh_sandbox


@pytest.fixture
async def client(aiohttp_client) -> TestClient:  # type: ignore[no-untyped-def]
    """The provider served as `gateway scripted` serves it (`/v1/...`, `/healthz`)."""
    return await aiohttp_client(standalone_app())


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(fresh_sandbox(tmp_path / "runs"))
