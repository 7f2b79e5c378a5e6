"""How many requests and seconds a turn-cap refusal takes to reach each client, at its
default settings, with the refusal sent as 429 (the default) and as 402
(`server.refusal_status`); other statuses as arguments (`... refusal_clients.py 429 400 403`).

Each client runs a tool loop against a real gateway (scripted upstream) under a policy
capped at two turns (`scripted-runaway` never stops), so its third call is refused; the
requests are counted by the gateway (`gateway_requests_total`: `refused` with the refusal's
status, `all` every model call of the loop), the seconds are the client's whole loop.
Clients: over the Responses API the OpenAI Python SDK, the OpenAI Agents SDK, pydantic-ai
(`openai:` models) and Vercel's `ai` SDK (node; `npm install` in benchmarks/clients first);
over chat completions (one `X-Run-Id` per client) langchain-openai's ChatOpenAI (a bound-tools
loop), LangGraph's prebuilt `create_react_agent`, `litellm.completion` (default, and with
`num_retries`) and instructor (`from_openai`, three structured calls in one run; default and
`max_retries=3`). A client that is not installed is skipped (`pip install -e '.[clients]'`).

Run: `.venv/bin/python benchmarks/refusal_clients.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of litellm's price list
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from tests.server.conftest import KEY, config_data  # noqa: E402
from tests.server.test_responses import TOOLS, serve  # noqa: E402
from tests.support.procs import Proc  # noqa: E402

CLIENTS_DIR = ROOT / "benchmarks" / "clients"
HEADERS = {"X-Policy": "two"}
STATUSES = [int(a) for a in sys.argv[1:]] or [429, 402]


def refused_requests(proc: Proc, status: int | None) -> float:
    """Requests the gateway answered with `status` (all of them for None)."""
    text = urllib.request.urlopen(proc.url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gateway_requests_total{") and "/metrics" not in line
               and (status is None or f'code="{status}"' in line))


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


def run_headers(name: str, url: str) -> dict[str, str]:
    """Chat-completions clients name their run (X-Run-Id), one per client and gateway."""
    return {**HEADERS, "X-Run-Id": f"{name}-{url.rsplit(':', 1)[1]}"}


def list_files() -> str:
    """List the files in the folder."""
    return "a.txt"


async def pydantic_ai_agent(url: str) -> str:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    # what `Agent("openai:...")` builds, pointed at the gateway
    model = OpenAIResponsesModel("scripted-runaway", provider=OpenAIProvider(base_url=url + "/v1", api_key=KEY))
    agent = Agent(model, tools=[list_files], model_settings={"extra_headers": HEADERS})
    try:
        await agent.run("go")
    except ModelHTTPError as exc:
        return f"{type(exc).__name__} {exc.status_code}"
    return "not refused"


def chat_openai(url: str, name: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="scripted-runaway", base_url=url + "/v1", api_key=KEY,  # type: ignore[arg-type]
                      default_headers=run_headers(name, url))


async def langchain_loop(url: str) -> str:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    files = tool(list_files)
    model = chat_openai(url, "langchain").bind_tools([files])
    messages: list[Any] = [HumanMessage("go")]
    try:
        for _ in range(5):
            reply = await model.ainvoke(messages)
            messages.append(reply)
            messages += [ToolMessage(files.invoke(c["args"]), tool_call_id=c["id"]) for c in reply.tool_calls]
    except openai.APIStatusError as exc:
        return type(exc).__name__
    return "not refused"


async def langgraph_agent(url: str) -> str:
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():  # moved to `langchain.agents.create_agent` (the `langchain` package)
        warnings.simplefilter("ignore")
        agent = create_react_agent(chat_openai(url, "langgraph"), [tool(list_files)])
    try:
        await agent.ainvoke({"messages": [("user", "go")]})
    except openai.APIStatusError as exc:
        return type(exc).__name__
    return "not refused"


def litellm_loop(url: str, name: str, **options: Any) -> str:
    import litellm

    litellm.suppress_debug_info = True
    messages: list[Any] = [{"role": "user", "content": "go"}]
    tools = [{"type": "function", "function": {"name": "list_files", "description": "List the files.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        for _ in range(5):
            reply = litellm.completion(model="openai/scripted-runaway", api_base=url + "/v1", api_key=KEY,
                                       messages=messages, tools=tools, extra_headers=run_headers(name, url),
                                       **options)
            message = reply.choices[0].message
            messages.append(message.model_dump())
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "a.txt"} for c in message.tool_calls]
    except Exception as exc:  # litellm's own exception classes
        return type(exc).__name__
    return "not refused"


async def litellm_default(url: str) -> str:
    return await asyncio.to_thread(litellm_loop, url, "litellm")


async def litellm_num_retries(url: str) -> str:
    return await asyncio.to_thread(litellm_loop, url, "litellm-retries", num_retries=3)


async def instructor_calls(url: str, name: str = "instructor", **options: Any) -> str:
    import instructor
    from pydantic import create_model

    # named after the one tool `scripted-runaway` calls, so each call parses and is one turn
    files = create_model("list_files", names=(list[str], []))

    client = instructor.from_openai(openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY,
                                                       default_headers=run_headers(name, url)))
    try:
        for _ in range(5):  # one structured call per turn of the same run
            await client.chat.completions.create(model="scripted-runaway", response_model=files,
                                                 messages=[{"role": "user", "content": "go"}], **options)
    except Exception as exc:  # instructor wraps what it gives up on
        return type(exc).__name__
    return "not refused"


async def instructor_retries(url: str) -> str:
    return await instructor_calls(url, "instructor-retries", max_retries=3)


def available() -> dict[str, Callable[[str], Awaitable[str]]]:
    clients: dict[str, Callable[[str], Awaitable[str]]] = {"openai-python (max_retries 2)": openai_python}
    try:
        import agents  # noqa: F401

        clients["openai-agents"] = agents_sdk
    except ImportError:
        print("skipped: openai-agents is not installed")
    optional: list[tuple[str, str, Callable[[str], Awaitable[str]]]] = [
        ("pydantic_ai", "pydantic-ai (openai: Responses)", pydantic_ai_agent),
        ("langchain_openai", "langchain ChatOpenAI loop", langchain_loop),
        ("langgraph", "langgraph create_react_agent", langgraph_agent),
        ("litellm", "litellm.completion (default)", litellm_default),
        ("litellm", "litellm.completion num_retries=3", litellm_num_retries),
        ("instructor", "instructor (from_openai)", instructor_calls),
        ("instructor", "instructor max_retries=3", instructor_retries),
    ]
    for module, name, run in optional:
        try:
            __import__(module)
            clients[name] = run
        except ImportError:
            print(f"skipped: {module} is not installed (pip install -e '.[clients]')")
    if shutil.which("node") and (CLIENTS_DIR / "node_modules" / "ai").is_dir():
        clients["ai SDK (maxRetries 2)"] = ai_sdk
    else:
        print("skipped: Vercel's ai SDK (node, and `npm install` in benchmarks/clients)")
    return clients


async def main_async() -> int:
    rows = []
    clients = available()
    for status in STATUSES:
        with tempfile.TemporaryDirectory(prefix="gw-refusal-") as tmp:
            proc = serve(Path(tmp) / "gw", config_data(server={"refusal_status": status}))
            try:
                for name, run in clients.items():
                    before, before_all = refused_requests(proc, status), refused_requests(proc, None)
                    started = time.perf_counter()
                    outcome = await run(proc.url)
                    seconds = time.perf_counter() - started
                    rows.append((name, status, refused_requests(proc, status) - before,
                                 refused_requests(proc, None) - before_all, seconds, outcome))
            finally:
                proc.stop()
    print(f"{'client':<36}{'status':>7}{'refused':>8}{'all':>5}{'seconds':>9}  surfaces as")
    for name, status, refused, every, seconds, outcome in rows:
        print(f"{name:<36}{status:>7}{refused:>8.0f}{every:>5.0f}{seconds:>9.2f}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async()))
