"""Where a policy's `python: "module:function"` comes from, on a real `.venv/bin/gateway serve`
started from a folder outside the repository with no PYTHONPATH (as a new user runs it):

- a module in the policy file's own folder is imported, and its tool runs in a run driven
  through the OpenAI client;
- a module in a `python_path` folder (relative to the policy file) too;
- a module found nowhere stops the start with one line naming the module and where it looked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.mcptools.fixtures import plan_task, planning_upstream
from tests.support.procs import ROOT, Proc, free_port, wait_http
from tests.support.upstreams import chat_app, in_thread

BIN = Path(sys.executable).parent
KEY = "sk-pytools"
FORECAST = "def forecast(args, ctx):\n    return f\"sunny in {args['city']}\"\n"
TIDES = "def tides(args, ctx):\n    return 'high tide at noon'\n"


@pytest.fixture(scope="module")
def upstream_url() -> Iterator[str]:
    with in_thread(lambda: chat_app(planning_upstream)) as root:
        yield root + "/v1"


def write(folder: Path, upstream_url: str, tools: list[dict[str, object]], **policy: object) -> Path:
    """A gateway folder (config, SQLite) whose policy `weather` lives in `folder/policies`."""
    assert not folder.resolve().is_relative_to(ROOT)
    policies = folder / "policies"
    policies.mkdir(parents=True)
    (policies / "weather.yaml").write_text(yaml.safe_dump({"name": "weather", "limits": {"max_turns": 4},
                                                          "tools": tools, **policy}))
    port = free_port()
    config = {"server": {"host": "127.0.0.1", "port": port}, "store": {"kind": "sqlite", "path": "./gateway.db"},
              "policies_dir": "./policies", "upstreams": [{"name": "planner", "base_url": upstream_url}],
              "models": [{"match": "*", "upstream": "planner", "price_in": 1.0, "price_out": 1.0}],
              "teams": [{"name": "demo", "keys": [KEY], "policies": ["weather"]}]}
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder / "config.yaml"


def tool(name: str, target: str) -> dict[str, object]:
    return {"name": name, "description": f"{name}.", "read_only": True, "executor": {"python": target},
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`.venv/bin/gateway serve` in the test's folder, with no PYTHONPATH (stopped at the end)."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        Proc(proc, "", tmp_path / "gateway.log").stop()


def start(folder: Path, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with (folder / "gateway.log").open("wb") as out:
        proc = subprocess.Popen([str(BIN / "gateway"), "serve", "--config", str(folder / "config.yaml")], cwd=folder,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    procs.append(proc)
    return proc


async def answer(folder: Path, task: str) -> str:
    port = yaml.safe_load((folder / "config.yaml").read_text())["server"]["port"]
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                                  timeout=60) as client:
        reply = await client.chat.completions.create(model="planner", messages=[{"role": "user", "content": task}])
    return reply.choices[0].message.content or ""


async def test_a_module_beside_the_policy_file_and_one_on_its_python_path_are_imported(
        tmp_path: Path, upstream_url: str, serve: list[subprocess.Popen[bytes]]) -> None:
    config = write(tmp_path, upstream_url, [tool("forecast", "weather_tools:forecast"),
                                            tool("tides", "sea.tides:tides")], python_path=["../lib"])
    (tmp_path / "policies" / "weather_tools.py").write_text(FORECAST)
    (tmp_path / "lib" / "sea").mkdir(parents=True)
    (tmp_path / "lib" / "sea" / "__init__.py").write_text("")
    (tmp_path / "lib" / "sea" / "tides.py").write_text(TIDES)
    proc = start(tmp_path, serve)
    port = yaml.safe_load(config.read_text())["server"]["port"]
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, log=tmp_path / "gateway.log")
    text = await answer(tmp_path, plan_task(("forecast", {"city": "Oslo"}), ("tides", {})))
    assert text == "results: sunny in Oslo | high tide at noon"


def test_a_module_found_nowhere_stops_the_start_naming_the_module_and_where_it_looked(
        tmp_path: Path, upstream_url: str, serve: list[subprocess.Popen[bytes]]) -> None:
    write(tmp_path, upstream_url, [tool("forecast", "weathr_tools:forecast")])
    (tmp_path / "policies" / "weather_tools.py").write_text(FORECAST)
    proc = start(tmp_path, serve)
    assert proc.wait(timeout=120) == 2
    log = (tmp_path / "gateway.log").read_text()
    policies = (tmp_path / "policies").resolve()
    assert (f"tools[0].executor.python: cannot import module 'weathr_tools': no module named 'weathr_tools' "
            f"(looked in the gateway's module path, then {policies})") in log, log
    assert "Traceback" not in log
