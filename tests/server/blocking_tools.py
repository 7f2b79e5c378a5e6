"""A sync python tool that blocks its thread until the test lets it go (a file appears).

The gateway process under test imports it from the repository root (its working folder);
`GATEWAY_TEST_TOOL_DIR` names the folder where each call marks that it runs and where the
test drops `release`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.harness.tools import ToolContext

GIVE_UP_S = 120.0
"""A bound, so a test that fails before releasing never leaves threads blocked for good."""


def wait_for_release(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Marks `running-<id>` in the folder, then blocks (sleeping, as sync work does) until `release` exists."""
    folder = Path(os.environ["GATEWAY_TEST_TOOL_DIR"])
    (folder / f"running-{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + GIVE_UP_S
    while not (folder / "release").exists():
        if time.monotonic() > deadline:
            return "never released"
        time.sleep(0.01)  # the blocking work a sync tool does: it holds its thread
    return "released"
