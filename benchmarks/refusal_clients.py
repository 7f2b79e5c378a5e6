"""How many requests and seconds a turn-cap refusal takes to reach each client, at its
default settings, with the refusal sent as 429 (the default) and as 402
(`server.refusal_status`).

Each client runs a tool loop over the Responses API against a real gateway (scripted
upstream) under a policy capped at two turns (`scripted-runaway` never stops), so its third
call is refused; the requests are counted by the gateway (`gateway_requests_total` with the
refusal's status), the seconds are the client's whole loop. Clients: the OpenAI Python SDK,
the OpenAI Agents SDK, Vercel's `ai` SDK (node; `npm install` in benchmarks/clients first);
a client that is not installed is skipped.

Run: `.venv/bin/python benchmarks/refusal_clients.py`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from tests.server.conftest import KEY, config_data  # noqa: E402
from tests.server.test_responses import TOOLS, serve  # noqa: E402
from tests.support.procs import Proc  # noqa: E402

CLIENTS_DIR = ROOT / "benchmarks" / "clients"
HEADERS = {"X-Policy": "two"}


def refused_requests(proc: Proc, status: int) -> float:
    text = urllib.request.urlopen(proc.url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gateway_requests_total{") and f'code="{status}"' in line)


async def openai_python(url: str) -> str:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, default_headers=HEADERS)
    previous: str | None = None
    items: Any = "go"
    try:
        for _ in range(5):
            response = await client.responses.create(model="scripted-runaway", input=items, tools=TOOLS,
                                                     **({"previous_response_id": previous} if previous else {}))
            previous = response.id
            items = [{"type": "function_call_output", "call_id": response.output[0].call_id,  # type: ignore[union-attr]
                      "output": "a.txt"}]
    except openai.APIStatusError as exc:
        return type(exc).__name__
    return "not refused"


async def agents_sdk(url: str) -> str:
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)

    @function_tool
    def list_files() -> str:
        """List the files in the folder."""
        return "a.txt"

    agent = Agent(name="files", model="scripted-runaway", tools=[list_files],
                  model_settings=ModelSettings(extra_headers=HEADERS))
    config = RunConfig(model_provider=OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=url + "/v1",
                                                                                      api_key=KEY)))
    try:
        await Runner.run(agent, "go", run_config=config)
    except openai.APIStatusError as exc:
        return type(exc).__name__
    return "not refused"


async def ai_sdk(url: str) -> str:
    proc = await asyncio.create_subprocess_exec("node", str(CLIENTS_DIR / "ai_sdk_loop.mjs"), url, KEY,
                                                "scripted-runaway", json.dumps(HEADERS), cwd=CLIENTS_DIR,
                                                stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    result = json.loads(out.decode().strip().splitlines()[-1])
    return "not refused" if result["ok"] else str(result["error"])


def available() -> dict[str, Callable[[str], Awaitable[str]]]:
    clients: dict[str, Callable[[str], Awaitable[str]]] = {"openai-python (max_retries 2)": openai_python}
    try:
        import agents  # noqa: F401

        clients["openai-agents"] = agents_sdk
    except ImportError:
        print("skipped: openai-agents is not installed")
    if shutil.which("node") and (CLIENTS_DIR / "node_modules" / "ai").is_dir():
        clients["ai SDK (maxRetries 2)"] = ai_sdk
    else:
        print("skipped: Vercel's ai SDK (node, and `npm install` in benchmarks/clients)")
    return clients


async def main_async() -> int:
    rows = []
    clients = available()
    for status in (429, 402):
        with tempfile.TemporaryDirectory(prefix="gw-refusal-") as tmp:
            proc = serve(Path(tmp) / "gw", config_data(server={"refusal_status": status}))
            try:
                for name, run in clients.items():
                    before = refused_requests(proc, status)
                    started = time.perf_counter()
                    outcome = await run(proc.url)
                    seconds = time.perf_counter() - started
                    rows.append((name, status, refused_requests(proc, status) - before, seconds, outcome))
            finally:
                proc.stop()
    print(f"{'client':<32}{'status':>7}{'requests':>10}{'seconds':>9}  surfaces as")
    for name, status, requests, seconds, outcome in rows:
        print(f"{name:<32}{status:>7}{requests:>10.0f}{seconds:>9.2f}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async()))
