"""`gateway demo --local`: the chapter's six tasks, run by the gateway against a local model.

Everything is real: a `gateway local` process (started here unless something already
answers at `--local-url`), a `gateway serve` process with a temporary config (one `local`
upstream at price 0, a SQLite store, the shipped policies) and, for each task, one
chat completion with `X-Policy: files`, so the gateway runs the loop and the tools. The
run is then read back from the runs API (turns, status, tool runs from the trace).

Each answer is marked RIGHT or WRONG against the sample folder's real contents
(`judge`, a pure function): the chapter's point is that the harness makes an agent
governable, not correct.

The upstream is of kind `local`: every call is capped (`max_tokens`) and has a deadline,
and the model's tool calls are repaired (`--no-repair` turns that off, to compare). The
demo names the model the server really loaded (`general.name` of its GGUF, via llama.cpp's
/props), and each task's line says its turns, repairs, exit and RIGHT/WRONG. The run is
capped at DEMO_MAX_TURNS turns (the shipped policy allows 20). `--task KIND` runs only some
tasks. A `gateway local` started here has its prompt cache off, so a task's answers do not
depend on the tasks before it. `--oracle` runs no task: it asks the model for each answer
after the calls a right agent makes (`oracle_check`), to tell bad calls from bad answers.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
import orjson
import yaml

from gateway.demo.report import tool_runs
from gateway.harness.loop import ANSWER_NOW
from gateway.harness.tools import ToolContext
from gateway.local.gguf import GGUFError, model_name
from gateway.tools.catalog import SYSTEM_PROMPT
from gateway.tools.files import SAMPLE, Sandbox

TaskKind = Literal["timeout", "count", "notes", "read_all", "largest", "rotating"]


@dataclass(frozen=True)
class Task:
    kind: TaskKind
    question: str


TASKS: Final = (
    Task("timeout", "Which file mentions a timeout?"),
    Task("count", "How many files are in the directory?"),
    Task("notes", "Read notes.txt and tell me what it says."),
    Task("read_all", "List the files and then read each one."),
    Task("largest", "Which file is the largest?"),
    Task("rotating", "Is there a file about rotating logs?"),
)
CHAPTER_REFERENCE: Final = ("chapter (Qwen2.5-0.5B-Instruct, its machine): every task 2 turns, "
                            "TOTAL turns=12  toolruns=7  wall=82,896ms  mean turn=6,908ms")
POLICIES_DIR: Final = Path(__file__).resolve().parents[2] / "policies"
KEY: Final = "sk-demo"
LOCAL_START_TIMEOUT_S: Final = 600.0  # the first start assembles the model (seconds to minutes)
GATEWAY_START_TIMEOUT_S: Final = 120.0  # a loaded 2-core machine starts a Python process slowly
DEMO_MAX_TURNS: Final = 6
DEMO_TOOL_ROUNDS: Final = 1  # measured best of 1, 2 and always (docs/local-models.md)
DEMO_MAX_TOKENS: Final = 256  # a call or a one-sentence answer needs under 100 tokens
# On two shared cores under load the model writes 0.3-3 tokens a second (measured 2026-12-01),
# so the demo gives a call ten minutes; still a deadline, and the cap bounds the work.
DEMO_CALL_DEADLINE_S: Final = 600.0
TASK_TIMEOUT_S: Final = 1800.0  # six capped turns of a slow CPU model on a loaded machine
POLL_S: Final = 0.1

_TIMEOUT = re.compile(r"\btime[sd]?[\s-]?outs?\b|\btimed[\s-]?out\b", re.IGNORECASE)
_ROTATING = re.compile(r"\brotat", re.IGNORECASE)
_WORD = re.compile(r"[a-z]+")
_NUMBER_WORDS: Final = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                        "eleven", "twelve")
_NUMBER = re.compile(r"\b(\d+|" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


@dataclass(frozen=True)
class Truth:
    """What the sandbox really holds: each file's text and size."""

    texts: Mapping[str, str]
    sizes: Mapping[str, int]

    @classmethod
    def of(cls, folder: Path = SAMPLE) -> Truth:
        files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        return cls({p.name: p.read_text("utf-8", errors="replace") for p in files},
                   {p.name: p.stat().st_size for p in files})

    @property
    def largest(self) -> str:
        return max(self.sizes, key=lambda name: self.sizes[name])

    def mentioning(self, pattern: re.Pattern[str]) -> frozenset[str]:
        return frozenset(name for name, text in self.texts.items() if pattern.search(text))

    def keywords(self, name: str) -> tuple[str, ...]:
        """The file's words of four letters or more, cut to five (so "rotate" matches "rotating")."""
        return tuple(dict.fromkeys(w[:5] for w in _WORD.findall(self.texts[name].lower()) if len(w) >= 4))


def first_file_named(answer: str, names: Sequence[str]) -> str | None:
    """The sandbox file the answer names first (None if it names none)."""
    low = answer.lower()
    found = [(low.find(n.lower()), n) for n in names if n.lower() in low]
    return min(found)[1] if found else None


def first_number(answer: str) -> int | None:
    """The first number in the answer, in digits or words (zero to twelve)."""
    found = _NUMBER.search(answer)
    if found is None:
        return None
    token = found.group(1).lower()
    return int(token) if token.isdigit() else _NUMBER_WORDS.index(token)


def judge(kind: TaskKind, answer: str, runs: Sequence[str], truth: Truth) -> bool:
    """Is this answer (and, for `read_all`, this run's tool runs) right about `truth`?

    `runs` are the run's executed tools as `name` or `name:path` (report.tool_runs).
    """
    names = list(truth.texts)
    named = first_file_named(answer, names)
    if kind == "timeout":
        return named is not None and named in truth.mentioning(_TIMEOUT)
    if kind == "count":
        return first_number(answer) == len(names)
    if kind == "notes":
        words = truth.keywords("notes.txt")
        low = answer.lower()
        return bool(words) and sum(w in low for w in words) * 2 >= len(words)
    if kind == "read_all":
        read = {Path(r.split(":", 1)[1]).name for r in runs if r.startswith("read_file:")}
        return set(names) <= read
    if kind == "largest":
        return named == truth.largest
    # rotating: name the file about rotation, or say yes without pointing at a wrong file
    about = truth.mentioning(_ROTATING)
    if named is not None:
        return named in about
    return bool(about) and answer.strip().lower().startswith("yes")


# The oracle check (`--oracle`): for each task, the calls a right agent makes, as rounds of
# (tool, path). "enough": only what the answer follows from; "everything": list, then read all.
OracleRounds = tuple[tuple[tuple[str, str | None], ...], ...]
_LIST: Final = (("list_files", None),)
_READ_ALL: Final = tuple(("read_file", name) for name in ("access.log", "errors.log", "notes.txt"))
ORACLE: Final[dict[str, dict[TaskKind, OracleRounds]]] = {
    "enough": {"timeout": (_LIST, (("read_file", "errors.log"),)), "count": (_LIST,),
               "notes": ((("read_file", "notes.txt"),),), "largest": (_LIST,),
               "rotating": (_LIST, (("read_file", "notes.txt"),))},
    "everything": {kind: (_LIST, _READ_ALL) for kind in ("timeout", "count", "notes", "largest", "rotating")},
}


async def oracle_transcript(task: Task, rounds: OracleRounds, folder: Path = SAMPLE) -> list[dict[str, Any]]:
    """The task's messages after `rounds` of calls, each answered by the real file tool over `folder`:
    what the run's transcript would be had the model made exactly these calls."""
    box = Sandbox(folder)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": task.question}]
    for r, calls in enumerate(rounds):
        ids = [f"oracle-{r}-{i}" for i in range(len(calls))]
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {
                "name": name, "arguments": orjson.dumps({} if path is None else {"path": path}).decode()}}
            for cid, (name, path) in zip(ids, calls, strict=True)]})
        for cid, (name, path) in zip(ids, calls, strict=True):
            ctx = ToolContext(run_id="oracle", call_id=cid, tool_name=name, cancelled=asyncio.Event())
            result = await (box.list_files({}, ctx) if path is None else box.read_file({"path": path}, ctx))
            messages.append({"role": "tool", "tool_call_id": cid, "name": name, "content": result})
    return messages


async def oracle_check(session: aiohttp.ClientSession, local_url: str, model: str,
                       tasks: Sequence[Task]) -> list[str]:
    """Ask the model for each task's answer as the gateway's answer turn does (the transcript, then
    ANSWER_NOW, no tools, greedy, capped), after the calls a right agent makes, and judge it: what the
    model answers when its calls are not the problem. read_all is judged by its calls alone: skipped."""
    truth = Truth.of()
    lines = []
    for label, plans in ORACLE.items():
        right = 0
        asked = [t for t in tasks if t.kind in plans]
        for task in asked:
            messages = await oracle_transcript(task, plans[task.kind])
            body = {"model": model, "temperature": 0, "seed": 0, "max_tokens": DEMO_MAX_TOKENS,
                    "messages": [*messages, {"role": "user", "content": ANSWER_NOW}]}
            async with session.post(local_url.rstrip("/") + "/chat/completions", data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=DEMO_CALL_DEADLINE_S)) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise DemoError(f"the local model answered {resp.status}: {raw.decode(errors='replace')[:300]}")
            answer = str(orjson.loads(raw)["choices"][0]["message"].get("content") or "")
            reads = [f"read_file:{p}" for rnd in plans[task.kind] for n, p in rnd if n == "read_file"]
            ok = judge(task.kind, answer, reads, truth)
            right += ok
            calls = "; ".join(", ".join(n if p is None else f"{n}({p})" for n, p in rnd) for rnd in plans[task.kind])
            short = shortened(answer)
            lines.append(f"oracle {label:<10} {task.kind:<9} after {calls:<58} -> \"{short}\"  "
                         f"{'RIGHT' if ok else 'WRONG'}")
            print(lines[-1], flush=True)
        total = f"oracle {label:<10} right={right}/{len(asked)} (read_all is judged by its calls: not asked)"
        lines.append(total)
        print(total, flush=True)
    return lines


def shortened(answer: str) -> str:
    """An answer on one line of at most 70 characters, for the demo's report lines."""
    short = " ".join(answer.split())
    return short if len(short) <= 70 else short[:67] + "..."


@dataclass
class TaskResult:
    """One task as the gateway ran it."""

    task: str
    kind: str
    run_id: str
    status: str
    reason: str | None
    turns: int
    repairs: int
    tool_runs: list[str]
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    wall_ms: int
    answer: str
    right: bool

    def line(self) -> str:
        short = shortened(self.answer)
        text = (f"turns={self.turns} repairs={self.repairs} tools={len(self.tool_runs)} wall={self.wall_ms:>7,}ms  "
                f"exit={self.exit:<18} {self.task:<36} -> \"{short}\"  {'RIGHT' if self.right else 'WRONG'}")
        if self.status != "completed" and self.reason:
            text += f' ({" ".join(self.reason.split())[:120]})'
        return text

    @property
    def exit(self) -> str:
        """How the run ended: its status (completed, failed, max_turns_exceeded...)."""
        return self.status

    def json(self) -> str:
        return orjson.dumps(asdict(self)).decode()


def total_line(results: Sequence[TaskResult]) -> str:
    turns = sum(r.turns for r in results)
    wall = sum(r.wall_ms for r in results)
    mean = round(wall / turns) if turns else 0
    right = sum(r.right for r in results)
    return (f"TOTAL turns={turns}  repairs={sum(r.repairs for r in results)}  "
            f"toolruns={sum(len(r.tool_runs) for r in results)}  wall={wall:,}ms  "
            f"mean turn={mean:,}ms  right={right}/{len(results)}")


class DemoError(Exception):
    """The demo cannot run (no local model, the gateway did not start...)."""


def _say(message: str) -> None:
    print(f"gateway demo --local: {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    """A `python -m gateway ...` process this demo started (stopped at the end)."""

    popen: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, args: Sequence[str], log: Path) -> Child:
        with log.open("wb") as out:
            popen = subprocess.Popen([sys.executable, "-m", "gateway", *args], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        return cls(popen, log)

    def check_alive(self, what: str) -> None:
        if self.popen.poll() is not None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
            raise DemoError(f"{what} exited with {self.popen.returncode}:\n{tail}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


async def _models(session: aiohttp.ClientSession, base_url: str) -> list[str] | None:
    """The model ids served at `base_url` once it answers 200; None while nothing (ready) answers."""
    try:
        async with session.get(base_url.rstrip("/") + "/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            body = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else []


async def _answers_at_all(session: aiohttp.ClientSession, base_url: str) -> bool:
    try:
        async with session.get(base_url.rstrip("/") + "/models", timeout=aiohttp.ClientTimeout(total=5)):
            return True
    except (TimeoutError, aiohttp.ClientError):
        return False


async def ensure_local(session: aiohttp.ClientSession, base_url: str, folder: Path,
                       model: str = "0.5b") -> tuple[str, Child | None]:
    """The local model's id, and the `gateway local --model MODEL` process started for it (None if one already ran)."""
    child: Child | None = None
    if not await _answers_at_all(session, base_url):
        url = urllib.parse.urlsplit(base_url)
        if url.hostname not in ("127.0.0.1", "localhost") or url.port is None:
            raise DemoError(f"nothing answers at {base_url}, and it is not a local address with a port to start "
                            "`gateway local` on (e.g. http://127.0.0.1:8081/v1)")
        _say(f"nothing answers at {base_url}: starting `gateway local --model {model} --port {url.port} "
             "--no-prompt-cache` "
             f"(log {folder}/local.log)")
        # Without the prompt cache, a task's answers do not depend on the tasks before it (docs/local-models.md).
        child = Child.start(["local", "--model", model, "--host", url.hostname, "--port", str(url.port),
                             "--no-prompt-cache"], folder / "local.log")
    deadline = time.monotonic() + LOCAL_START_TIMEOUT_S
    try:
        while (names := await _models(session, base_url)) is None:
            if child is not None:
                child.check_alive("gateway local")
            if time.monotonic() > deadline:
                raise DemoError(f"{base_url}/models did not answer 200 within {LOCAL_START_TIMEOUT_S:.0f}s")
            await asyncio.sleep(POLL_S)  # readiness probe interval
    except BaseException:
        if child is not None:
            child.stop()
        raise
    return (names[0] if names else "qwen2.5-coder-0.5b"), child


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """What the server really loaded: `general.name` of the GGUF that llama.cpp's /props names,
    or a sentence saying why that is unknown."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        async with session.get(root + "/props", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            props = await resp.json(content_type=None) if resp.status == 200 else {}
    except (TimeoutError, aiohttp.ClientError, ValueError):
        props = {}
    path = props.get("model_path") if isinstance(props, dict) else None
    if not isinstance(path, str) or not path:
        return "unknown (the server does not name its model file at /props)"
    try:
        name = model_name(Path(path))
    except (OSError, GGUFError) as exc:
        return f"unknown ({Path(path).name}: {exc})"
    return f"{name or 'no general.name'} ({Path(path).name})"


def demo_policies(folder: Path, source: Path = POLICIES_DIR, tool_rounds: int | None = DEMO_TOOL_ROUNDS) -> Path:
    """The shipped `files` policy with its turn cap lowered to DEMO_MAX_TURNS and, unless
    `tool_rounds` is None, tools offered for that many turns only, in `folder`/policies."""
    policy = yaml.safe_load((source / "files.yaml").read_text())
    policy.setdefault("limits", {})["max_turns"] = DEMO_MAX_TURNS
    if tool_rounds is not None:
        policy["tool_rounds"] = tool_rounds
    out = folder / "policies"
    out.mkdir(parents=True, exist_ok=True)
    (out / "files.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    return out


def gateway_config(local_url: str, port: int, policies_dir: Path = POLICIES_DIR, *,
                   repair: bool = True) -> dict[str, Any]:
    """A gateway that routes every model name to the local upstream (kind `local`: capped calls with
    a deadline, tool-call repair unless `repair` is False) at price 0, for team key sk-demo."""
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "store": {"kind": "sqlite", "path": "./gateway.db"},
        "policies_dir": str(policies_dir),
        "upstreams": [{"name": "local", "kind": "local", "base_url": local_url, "tool_repair": repair,
                       "max_tokens": DEMO_MAX_TOKENS, "timeout_s": DEMO_CALL_DEADLINE_S}],
        "models": [{"match": "*", "upstream": "local", "price_in": 0.0, "price_out": 0.0}],
        "teams": [{"name": "demo", "keys": [KEY], "budget_usd": None, "policies": ["files"]}],
    }


async def start_gateway(session: aiohttp.ClientSession, folder: Path, local_url: str,
                        repair: bool = True, tool_rounds: int | None = DEMO_TOOL_ROUNDS) -> tuple[str, Child]:
    """`gateway serve` on a free port with a temporary config in `folder`; its URL once /healthz is 200."""
    if not (POLICIES_DIR / "files.yaml").is_file():
        raise DemoError(f"the shipped policies are not at {POLICIES_DIR} (policies/files.yaml is needed)")
    port = _free_port()
    config = folder / "config.yaml"
    policies = demo_policies(folder, tool_rounds=tool_rounds)
    config.write_text(yaml.safe_dump(gateway_config(local_url, port, policies, repair=repair), sort_keys=False))
    child = Child.start(["serve", "--config", str(config)], folder / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
    try:
        while True:
            child.check_alive("gateway serve")
            try:
                async with session.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return url, child
            except (TimeoutError, aiohttp.ClientError):
                pass
            if time.monotonic() > deadline:
                raise DemoError(f"gateway serve did not answer {url}/healthz within {GATEWAY_START_TIMEOUT_S:.0f}s")
            await asyncio.sleep(POLL_S)  # readiness probe interval
    except BaseException:
        child.stop()
        raise


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, headers={"Authorization": f"Bearer {KEY}"}) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise DemoError(f"GET {url} answered {resp.status}: {raw.decode(errors='replace')[:300]}")
    return orjson.loads(raw)


async def run_task(session: aiohttp.ClientSession, gateway: str, model: str, task: Task, truth: Truth) -> TaskResult:
    """POST the task with X-Policy: files, then read the run and its trace back."""
    run_id = f"local-{task.kind}-{uuid.uuid4().hex[:8]}"
    # Greedy decoding, as in the chapter: the server-side run sends it with every model call.
    body = {"model": model, "temperature": 0, "seed": 0,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.question}]}
    headers = {"Authorization": f"Bearer {KEY}", "X-Policy": "files", "X-Run-Id": run_id}
    started = time.perf_counter()
    async with session.post(gateway + "/v1/chat/completions", data=orjson.dumps(body), headers=headers,
                            timeout=aiohttp.ClientTimeout(total=TASK_TIMEOUT_S)) as resp:
        raw = await resp.read()
        http_status = resp.status
    wall_ms = round((time.perf_counter() - started) * 1000)
    reply: Any = orjson.loads(raw) if raw else {}
    if http_status == 200:
        answer = str(reply["choices"][0]["message"].get("content") or "")
    else:
        answer = str((reply.get("error") or {}).get("message") or raw.decode(errors="replace"))
    run = await _get_json(session, f"{gateway}/v1/runs/{run_id}")
    async with session.get(f"{gateway}/v1/runs/{run_id}/events", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        events = [orjson.loads(line) for line in (await resp.read()).splitlines() if line.strip()]
    runs = tool_runs(events, run_id)
    status = str(run["status"])
    return TaskResult(
        task=task.question, kind=task.kind, run_id=run_id, status=status, reason=run.get("reason"),
        turns=int(run["turns"]), repairs=sum(e.get("type") == "tool_call_repaired" for e in events), tool_runs=runs, prompt_tokens=int(run["usage"]["prompt_tokens"]),
        completion_tokens=int(run["usage"]["completion_tokens"]), cost_usd=float(run["cost_usd"]),
        wall_ms=wall_ms, answer=answer, right=status == "completed" and judge(task.kind, answer, runs, truth),
    )


def chosen_tasks(kinds: Sequence[str] = ()) -> tuple[Task, ...]:
    """The tasks of these kinds, in TASKS' order (all six when none is named)."""
    unknown = set(kinds) - {t.kind for t in TASKS}
    if unknown:
        raise DemoError(f"no such task: {', '.join(sorted(unknown))} (the tasks: {', '.join(t.kind for t in TASKS)})")
    return tuple(t for t in TASKS if not kinds or t.kind in kinds)


async def run_oracle(local_url: str, model_key: str = "0.5b", kinds: Sequence[str] = ()) -> list[str]:
    """`--oracle`: start the model if nothing answers, then oracle_check (no gateway is needed)."""
    tasks = chosen_tasks(kinds)
    with tempfile.TemporaryDirectory(prefix="gateway-demo-oracle-") as tmp:
        async with aiohttp.ClientSession() as session:
            model, local = await ensure_local(session, local_url, Path(tmp), model_key)
            try:
                print(f"model served: {await served_model(session, local_url)}; the answer turn after the "
                      "calls a right agent makes", flush=True)
                return await oracle_check(session, local_url, model, tasks)
            finally:
                if local is not None:
                    local.stop()


async def run_demo(local_url: str, as_json: bool = False, repair: bool = True,
                   tool_rounds: int | None = DEMO_TOOL_ROUNDS, model_key: str = "0.5b",
                   kinds: Sequence[str] = ()) -> list[TaskResult]:
    """Start what is missing, run the six tasks (or those of `kinds`) through the gateway, print a line
    (or JSON) each."""
    tasks = chosen_tasks(kinds)
    truth = Truth.of()
    results: list[TaskResult] = []
    with tempfile.TemporaryDirectory(prefix="gateway-demo-local-") as tmp:
        folder = Path(tmp)
        async with aiohttp.ClientSession() as session:
            model, local = await ensure_local(session, local_url, folder, model_key)
            try:
                gateway, served = await start_gateway(session, folder, local_url, repair, tool_rounds)
                weights = await served_model(session, local_url)
                setup = (f"tool-call repair {'on' if repair else 'off'}, at most {DEMO_MAX_TURNS} turns, tools offered "
                         + (f"for {tool_rounds} turn(s)" if tool_rounds else "on every turn"))
                count = "six tasks" if len(tasks) == len(TASKS) else ", ".join(t.kind for t in tasks)
                _say(f"model {model} at {local_url}, gateway {gateway} (policy files; {setup}); {count}, one at a time")
                if not as_json:
                    print(f"model served: {weights}; {setup}", flush=True)
                try:
                    for task in tasks:
                        result = await run_task(session, gateway, model, task, truth)
                        results.append(result)
                        print(result.json() if as_json else result.line(), flush=True)
                finally:
                    served.stop()
            finally:
                if local is not None:
                    local.stop()
    if not as_json:
        print(total_line(results))
        print(CHAPTER_REFERENCE)
    return results


def local_demo(args: argparse.Namespace) -> int:
    """`gateway demo --local [--local-url URL] [--json] [--task KIND]...`: 0 once the tasks ran, 1 if the demo
    could not run."""
    try:
        if getattr(args, "oracle", False):
            asyncio.run(run_oracle(args.local_url, model_key=str(getattr(args, "model", "0.5b")),
                                   kinds=tuple(getattr(args, "task", None) or ())))
            return 0
        rounds = getattr(args, "tool_rounds", None)
        asyncio.run(run_demo(args.local_url, as_json=bool(getattr(args, "json", False)),
                             repair=not getattr(args, "no_repair", False),
                             tool_rounds=DEMO_TOOL_ROUNDS if rounds is None else (rounds or None),
                             model_key=str(getattr(args, "model", "0.5b")),
                             kinds=tuple(getattr(args, "task", None) or ())))
    except DemoError as exc:
        _say(str(exc))
        return 1
    return 0
