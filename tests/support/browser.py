"""A real headless Chromium for console tests: Debian's `chromium` package (installed by
scripts/install-test-deps.sh), driven by Playwright. Playwright's own browser downloads are
not used: it launches the system binary (`CHROMIUM`, default /usr/bin/chromium)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

from playwright.async_api import Browser, async_playwright

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """A headless Chromium, closed on exit."""
    async with async_playwright() as pw:
        # --no-sandbox: tests run as root in CI containers, where Chromium's sandbox cannot start
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                           args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            await browser.close()
