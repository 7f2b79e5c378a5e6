"""How long a Stop takes to end a run whose tool is working: the loop's return and the tool's own notice.

The unit tests prove that a Stop ends such a run (interrupted, resumable, the call left
pending) and that the tool saw it; how fast is a figure of the machine as much as of the
code, so it is measured here instead, on the real parts the tests use: the harness loop
with a tool that waits on the Stop, the policy executors' python tools (async, and sync in
a thread checking the event between slices of work), an http tool whose server never
answers (a real aiohttp server on loopback), and a sub-run (agent executor) whose child's
tool is working when the parent is stopped.

For each case it starts the run `--runs` times, presses the Stop once the tool reports
progress, and prints the p50, p95 and max of:
- `returned`: Stop pressed -> the run's `run()` returned;
- `noticed`: Stop pressed -> the tool's own "stopping" progress line (tools that report it).

Target: <= 50 ms at p95 for both (a person pressing Stop sees the run end at once).

Run: `.venv/bin/python benchmarks/stop_latency.py [--runs 50]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.harness.execute import CancelScope  # noqa: E402
from gateway.harness.loop import run  # noqa: E402
from gateway.harness.model import ModelRequest  # noqa: E402
from gateway.harness.options import RunOptions  # noqa: E402
from gateway.harness.state import Limits, Message, RunState  # noqa: E402
from gateway.harness.tools import Tool, ToolContext, ToolSpec  # noqa: E402
from gateway.policy.executors import ToolEnv, compile_options  # noqa: E402
from gateway.policy.registry import PolicyRegistry  # noqa: E402
from tests.policy.conftest import Events, FnModel, answer, tool_call, turns  # noqa: E402
from tests.policy.test_agent import CHILD, PARENT, Saved, is_child  # noqa: E402
from tests.policy.test_executors import TOOLS as PY_TOOLS  # noqa: E402  (tools slow and slow_sync)
from tests.support.upstreams import never_answering  # noqa: E402

TARGET_MS = 50.0
HTTP_TOOL = """
name: web
tools:
  - name: stuck_long
    description: Never answers.
    executor: {{http: {{url: "http://127.0.0.1:{port}/hang"}}}}
"""

Case = Callable[[], Awaitable[tuple[float, float | None]]]


def new_state() -> RunState:
    return RunState.new("bench", [{"role": "user", "content": "work"}], limits=Limits(max_turns=10, max_budget_usd=1.0))


def first_call(name: str) -> Callable[[ModelRequest], Message]:
    return lambda req: tool_call("c1", name, {}) if turns(req) == 0 else answer("done")


async def stop_when(started: Callable[[], Awaitable[None]], options: RunOptions, model: Any,
                    events: Events | None) -> tuple[float, float | None]:
    """Run until `started()` returns, press the Stop; (returned ms, noticed ms or None)."""
    scope = CancelScope()
    task = asyncio.create_task(run(new_state(), model, options, scope))
    await started()
    pressed = time.perf_counter()
    scope.cancel("user pressed Stop")
    out = await task
    returned = (time.perf_counter() - pressed) * 1000
    if out.state.status != "interrupted":
        raise RuntimeError(f"the run ended {out.state.status}, not interrupted")
    noticed = None
    if events is not None:
        stopping = await events.wait(lambda e: e.get("label") == "stopping", timeout=5.0)
        noticed = (stopping["at"] - pressed) * 1000
    return returned, noticed


def harness_case() -> Case:
    async def case() -> tuple[float, float | None]:
        began = asyncio.Event()

        async def slow(args: Any, ctx: ToolContext) -> str:
            began.set()
            await asyncio.wait_for(ctx.cancelled.wait(), 10)
            return "stopped early"

        tool = Tool(ToolSpec("scan_archive", "scan", {"type": "object"}), slow)
        return await stop_when(began.wait, RunOptions(tools={"scan_archive": tool}), FnModel(first_call("scan_archive")),
                               None)

    return case


def policy_case(folder: Path, text: str, policy: str, tool: str, *, sub_run: bool = False) -> Case:
    (folder / f"{policy}.yaml").write_text(textwrap.dedent(text).lstrip("\n"))
    registry = PolicyRegistry(folder)
    registry.load()
    found = registry.get(policy)
    if found is None:
        raise RuntimeError(f"policy {policy} did not load")

    async def case() -> tuple[float, float | None]:
        events = Events()
        if sub_run:
            def reply(req: ModelRequest) -> Message:
                if is_child(req):
                    return tool_call("k1", tool, {}) if turns(req) == 0 else answer("ok")
                return tool_call("p1", "research", {"question": "q"}) if turns(req) == 0 else answer("ok")
            model = FnModel(reply)
            options = compile_options(found, ToolEnv(model=model, registry=registry, on_event=events,
                                                     checkpoint=Saved()))
        else:
            model = FnModel(first_call(tool))
            options = compile_options(found, ToolEnv(registry=registry, on_event=events))

        async def progress() -> None:
            await events.wait(lambda e: e["type"] == "tool_progress")

        return await stop_when(progress, options, model, events)

    return case


def http_case(folder: Path, port: int, seen: list[object], session: aiohttp.ClientSession) -> Case:
    (folder / "web.yaml").write_text(HTTP_TOOL.format(port=port).lstrip("\n"))
    registry = PolicyRegistry(folder)
    registry.load()
    found = registry.get("web")
    if found is None:
        raise RuntimeError("policy web did not load")

    async def case() -> tuple[float, float | None]:
        seen.clear()
        options = compile_options(found, ToolEnv(session=session))

        async def reached() -> None:
            while not seen:  # the request reached the server
                await asyncio.sleep(0.002)

        return await stop_when(reached, options, FnModel(first_call("stuck_long")), None)

    return case


def line(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    verdict = "met" if p95 <= TARGET_MS else "NOT met"
    return (f"  {name:<9} p50 {statistics.median(ordered):7.2f} ms  p95 {p95:7.2f} ms  max {ordered[-1]:7.2f} ms"
            f"  (target p95 <= {TARGET_MS:g} ms: {verdict})")


async def main_async(runs: int) -> int:
    release = asyncio.Event()
    seen: list[object] = []
    app = web.Application()
    app.router.add_post("/hang", never_answering(seen, release))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        with tempfile.TemporaryDirectory(prefix="gw-stop-") as tmp:
            folder = Path(tmp)
            (folder / "kid.yaml").write_text(CHILD.lstrip("\n"))
            async with aiohttp.ClientSession() as session:
                cases: dict[str, Case] = {
                    "harness loop, async tool waiting on the Stop": harness_case(),
                    "python executor, async tool": policy_case(folder, PY_TOOLS, "py", "slow"),
                    "python executor, sync tool in a thread": policy_case(folder, PY_TOOLS, "py", "slow_sync"),
                    "http executor, a server that never answers": http_case(folder, port, seen, session),
                    "agent executor, the child's tool working": policy_case(folder, PARENT % "0.05", "boss", "slow",
                                                                           sub_run=True),
                }
                print(f"Stop pressed while a tool works, {runs} runs per case (ms from the press):")
                for name, case in cases.items():
                    returned: list[float] = []
                    noticed: list[float] = []
                    for _ in range(runs):
                        r, n = await case()
                        returned.append(r)
                        if n is not None:
                            noticed.append(n)
                    print(name)
                    print(line("returned", returned))
                    if noticed:
                        print(line("noticed", noticed))
    finally:
        release.set()
        await runner.cleanup()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=50, help="Stops measured per case")
    args = parser.parse_args()
    return asyncio.run(main_async(args.runs))


if __name__ == "__main__":
    raise SystemExit(main())
