"""Tools from declarations, and a policy compiled into the harness's `RunOptions`.

Four executor kinds: `python` (a sync function runs on a thread of the process's tool
pool, `gateway.policy.threads`; an async one is awaited), `http` (POST the call as JSON;
the response body is the result; non-2xx is a tool error), `agent` (a sub-run under
another policy, with its own transcript and limits, capped by the parent's remaining
budget and stopped with its parent) and `mcp` (a tool discovered on an MCP server,
called through the process's session to it). Every kind
first checks the arguments against the tool's JSON schema: a mismatch is a tool error
the model reads, never a crash. Timeouts (`timeout_s`) are enforced by the harness.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import orjson

from gateway.harness.model import Model
from gateway.harness.options import (
    Checkpoint,
    RunOptions,
    StopCondition,
    ToolErrorPolicy,
)
from gateway.harness.stops import RepeatedCall as RepeatedCallStop
from gateway.harness.subrun import run_subrun
from gateway.harness.trace import Event, EventSink
from gateway.harness.tools import (
    PermanentToolError,
    Tool,
    ToolContext,
    ToolError,
    ToolFunction,
    ToolOutput,
    ToolResult,
    ToolSpec,
)
from gateway.harness.usage import Price
from gateway.mcp.hub import McpUnavailable
from gateway.policy.approval import compile_approval
from gateway.policy.decl import (
    AgentExecutor,
    HttpExecutor,
    McpExecutor,
    Policy,
    PythonExecutor,
    StopRule,
    ToolDecl,
    ToolErrorConfig,
)
from gateway.policy.registry import PolicyRegistry
from gateway.policy.resolve import resolve_callable, resolve_exception
from gateway.policy.threads import ToolThreads

DEFAULT_SUBRUN_SYSTEM = "You are a sub-agent. Use your tools to work on the task, then reply with a short summary."
BODY_EXCERPT = 300
SUBRUN_STOP_GRACE_S = 0.05  # how long a stopped sub-run may take to record its own stop


class CompileError(ValueError):
    """A policy that cannot be turned into tools here (e.g. its sub-run policy is gone)."""


def _drop(event: Event) -> None:
    return None


@dataclass
class ToolEnv:
    """What executors need from the gateway for one run (shared by its sub-runs)."""

    session: aiohttp.ClientSession | None = None
    model: Model | None = None
    model_name: str = ""  # the run's model: a sub-run's default
    model_resolver: Callable[[str], Model] | None = None
    price_for: Callable[[str], Price] | None = None
    registry: PolicyRegistry | None = None
    sandbox_root: Path | None = None
    on_event: EventSink = _drop
    checkpoint: Checkpoint | None = None  # where sub-run states are saved, if anywhere
    propagate: Callable[[MutableMapping[str, str]], None] | None = None
    """Adds the calling tool span's `traceparent` to an HTTP tool's request (tracing on)."""
    threads: ToolThreads | None = None
    """Where sync python tools run (the process's tool pool); None: asyncio's default executor."""

    def model_for(self, name: str) -> Model:
        """The model a sub-run asking for `name` talks to."""
        if self.model_resolver is not None:
            return self.model_resolver(name)
        if self.model is None:
            raise CompileError(f"no model is available for a sub-run on {name!r}")
        return self.model


@dataclass
class PolicyToolContext(ToolContext):
    """The context python executors get: the harness's, plus the run's sandbox folder."""

    sandbox: Path | None = None


def check_arguments(spec: ToolSpec, args: Mapping[str, Any]) -> None:
    """Raise a `ToolError` naming the field when `args` do not match the tool's schema."""
    validator = jsonschema.Draft202012Validator(spec.parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(dict(args)))
    if error is None:
        return
    where = ".".join(str(p) for p in error.absolute_path)
    field = f" (argument '{where}')" if where else ""
    raise ToolError(f"invalid arguments for {spec.name}{field}: {error.message}. "
                    f"Call it again with arguments matching its parameters.")


def _output(value: Any) -> ToolOutput:
    if isinstance(value, (str, ToolResult)):
        return value
    if value is None:
        return ""
    return orjson.dumps(value, default=str).decode()


def python_tool(spec: ToolSpec, config: PythonExecutor, env: ToolEnv) -> ToolFunction:
    """`python: "module:function"`; sync functions run on a thread of `env.threads` with a
    thread-safe progress()."""
    func = resolve_callable(config.target, config.search)
    is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))

    async def run(args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ToolContext)}
        if is_async:
            out = await func(args, PolicyToolContext(**fields, sandbox=env.sandbox_root))
        else:
            loop = asyncio.get_running_loop()
            progress = ctx.progress
            fields["progress"] = lambda label: loop.call_soon_threadsafe(progress, label)
            call_ctx = PolicyToolContext(**fields, sandbox=env.sandbox_root)
            if env.threads is not None:
                out = await env.threads.run(func, args, call_ctx)
            else:
                out = await asyncio.to_thread(func, args, call_ctx)
        if inspect.isawaitable(out):
            out = await out
        return _output(out)

    return run


def http_tool(spec: ToolSpec, config: HttpExecutor, env: ToolEnv) -> ToolFunction:
    """`http: {url, timeout_s, headers}`: POST `{tool, arguments, run_id, call_id, idempotency_key}`."""

    async def post(session: aiohttp.ClientSession, args: Mapping[str, Any], ctx: ToolContext) -> str:
        body = {"tool": spec.name, "arguments": dict(args), "run_id": ctx.run_id, "call_id": ctx.call_id,
                "idempotency_key": ctx.idempotency_key}
        headers = {"Content-Type": "application/json", "Idempotency-Key": ctx.idempotency_key, **config.headers}
        if env.propagate is not None:
            env.propagate(headers)
        timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        try:
            async with session.post(config.url, data=orjson.dumps(body), headers=headers, timeout=timeout) as resp:
                text = await resp.text(errors="replace")
        except TimeoutError:
            raise ToolError(f"{spec.name} did not answer within {config.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise ToolError(f"cannot reach the {spec.name} server at {config.url}: {exc or type(exc).__name__}") from None
        if not 200 <= resp.status < 300:
            excerpt = text[:BODY_EXCERPT] + ("..." if len(text) > BODY_EXCERPT else "")
            raise ToolError(f"the {spec.name} server answered HTTP {resp.status}: {excerpt.strip() or resp.reason}")
        return text

    async def run(args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        if env.session is not None:
            return await post(env.session, args, ctx)
        async with aiohttp.ClientSession() as session:
            return await post(session, args, ctx)

    return run


def agent_tool(spec: ToolSpec, config: AgentExecutor, env: ToolEnv) -> ToolFunction:
    """`agent: {policy, model, max_turns, max_budget_usd}`: one sub-run per call."""
    child = env.registry.get(config.policy) if env.registry is not None else None
    if child is None:
        raise CompileError(f"tool {spec.name} runs policy {config.policy!r}, which is not loaded")
    limits = dataclasses.replace(
        child.limits,
        max_turns=config.max_turns or child.limits.max_turns,
        max_budget_usd=config.max_budget_usd or child.limits.max_budget_usd,
    )
    system = config.system_prompt or child.system_prompt or DEFAULT_SUBRUN_SYSTEM

    async def run(args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        model_name = config.model or env.model_name
        options = compile_options(child, dataclasses.replace(env, model_name=model_name))
        if env.checkpoint is not None:
            options.checkpoint = env.checkpoint
        # The child gets its own Stop button, pressed with the parent's or when this call is
        # cancelled for any other reason (a timeout): then it stops through its own exit and
        # records how it ended instead of being torn down mid-step.
        child_ctx = dataclasses.replace(ctx, cancelled=asyncio.Event())
        forward = asyncio.ensure_future(_forward(ctx.cancelled, child_ctx.cancelled))
        task = asyncio.ensure_future(run_subrun(child_ctx, model=env.model_for(model_name), model_name=model_name,
                                                options=options, system=system, task=_task(args), limits=limits))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            child_ctx.cancelled.set()
            await asyncio.wait({task}, timeout=SUBRUN_STOP_GRACE_S)
            task.cancel()
            raise
        finally:
            forward.cancel()

    return run


async def _forward(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def _task(args: Mapping[str, Any]) -> str:
    """The sub-run's user message: the one string argument, or all arguments as JSON."""
    strings = [v for v in args.values() if isinstance(v, str)]
    if len(args) == 1 and strings:
        return strings[0]
    return orjson.dumps(dict(args)).decode()


def mcp_tool(spec: ToolSpec, config: McpExecutor) -> ToolFunction:
    """`tools/call` on the tool's MCP server; progress notifications become `ctx.progress`,
    an `isError` result or a server that died is a tool error (data the model reads)."""

    async def run(args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        try:
            result = await config.hub.call(config.server, config.tool, args, ctx.progress)
        except McpUnavailable as exc:
            raise ToolError(str(exc)) from None
        if result.is_error:
            raise ToolError(result.text or f"{spec.name} failed (the MCP server gave no reason)")
        return result.text

    return run


def build_tool(decl: ToolDecl, env: ToolEnv) -> Tool:
    """The harness `Tool` for one declaration, arguments checked before it runs."""
    ex = decl.executor
    inner: ToolFunction
    if isinstance(ex, PythonExecutor):
        inner = python_tool(decl.spec, ex, env)
    elif isinstance(ex, HttpExecutor):
        inner = http_tool(decl.spec, ex, env)
    elif isinstance(ex, McpExecutor):
        inner = mcp_tool(decl.spec, ex)
    else:
        inner = agent_tool(decl.spec, ex, env)
    spec = decl.spec

    async def run(args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        check_arguments(spec, args)
        return await inner(args, ctx)

    return Tool(spec, run)


def tool_error_policy(config: ToolErrorConfig) -> ToolErrorPolicy:
    """`tool_errors` -> the harness's policy; `PermanentToolError` is always permanent."""
    permanent = tuple(dict.fromkeys((*(resolve_exception(n, config.search) for n in config.permanent),
                                     PermanentToolError)))
    return ToolErrorPolicy(text=config.text, fatal=config.fatal, permanent=permanent)


def stop_conditions(rules: tuple[StopRule, ...]) -> list[StopCondition]:
    return [RepeatedCallStop(rule.n) for rule in rules]


def compile_options(policy: Policy, env: ToolEnv, **overrides: Any) -> RunOptions:
    """Everything the loop needs from a policy; `overrides` set any other `RunOptions` field
    (client_tools, price, max_tokens, checkpoint, on_event, ...)."""
    fields: dict[str, Any] = {
        "tools": {decl.name: build_tool(decl, env) for decl in policy.tools},
        "tool_errors": tool_error_policy(policy.tool_errors),
        "dedupe": policy.dedupe,
        "tool_rounds": policy.tool_rounds,
        "stop_when": stop_conditions(policy.stop_when),
        "approval": compile_approval(policy.approval, policy.specs),
        "limit_ask": policy.limit_ask,
        "on_event": env.on_event,
    }
    if env.price_for is not None and env.model_name:
        fields["price"] = env.price_for(env.model_name)
    fields.update(overrides)
    return RunOptions(**fields)
