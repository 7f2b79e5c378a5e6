"""Fixtures for the file tools: a fresh copy of the sample sandbox, a tool context."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.harness.tools import ToolContext
from gateway.tools.files import Sandbox, fresh_sandbox


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(fresh_sandbox(tmp_path / "runs"))


@pytest.fixture
def make_ctx() -> Callable[..., ToolContext]:
    def make(call_id: str = "c1", run_id: str = "run-1", tool: str = "tool",
             progress: Callable[[str], None] = lambda label: None) -> ToolContext:
        return ToolContext(run_id=run_id, call_id=call_id, tool_name=tool, cancelled=asyncio.Event(),
                           progress=progress)
    return make
