"""Read and validate a policy file (`policies/*.yaml`) into a frozen `Policy`.

Every problem raises `PolicyError` naming the file, the line, the field path and what is
wrong; a file is parsed completely before anything is returned, so a bad policy never
half-loads. The dataclasses live in `gateway.policy.decl` and are re-exported here.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from pathlib import Path
from typing import Any, Literal, cast, get_args
from urllib.parse import urlparse

import jsonschema

from gateway.harness.options import ApprovalAction, Dedupe, LimitAsk
from gateway.harness.state import DEFAULT_MAX_TOOL_CALLS, LIMIT_NAMES, WHOLE_LIMITS, Amounts, LimitName, Limits
from gateway.harness.tools import ToolSpec
from gateway.mcp.config import McpServerConfig
from gateway.mcp.hub import McpHub
from gateway.policy.decl import (
    DEFAULT_PERMANENT,
    TOOL_NAME,
    AgentExecutor,
    ApprovalConfig,
    ExecutorConfig,
    HttpExecutor,
    Policy,
    PythonExecutor,
    OnDecision,
    Recovery,
    RepeatedCall,
    Rule,
    SandboxConfig,
    StopRule,
    ToolDecl,
    ToolErrorConfig,
    arg_text,
)
from gateway.policy.errors import PolicyError
from gateway.policy.mcp_source import (
    ToolOverride,
    apply_overrides,
    discover,
    parse_override,
    parse_servers,
    version_input,
)
from gateway.policy.resolve import ResolveError, resolve_callable, resolve_exception
from gateway.policy.source import At, Fields, Source

# sandbox.py imports the registry, which imports this module: take only the sample names
_SAMPLES_DIR = Path(__file__).resolve().parents[1] / "data"


def sample_names() -> dict[str, Path]:
    """Packaged sample folders by the name a policy uses for them."""
    return {"chapter": _SAMPLES_DIR / "sandbox"}

__all__ = [
    "AgentExecutor", "ApprovalConfig", "ExecutorConfig", "HttpExecutor", "Policy", "PolicyError",
    "PythonExecutor", "RepeatedCall", "Rule", "SandboxConfig", "StopRule", "ToolDecl", "ToolErrorConfig",
    "load_policy", "parse_policy",
]

TOP_FIELDS = ("name", "description", "limits", "tools", "tool_errors", "dedupe", "stop_when", "approval",
              "sandbox", "system_prompt", "recovery", "mcp",
              "tool_rounds", "python_path")
TOOL_FIELDS = ("name", "description", "parameters", "read_only", "destructive", "needs_approval", "timeout_s",
               "executor")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def load_policy(path: str | Path, mcp: McpHub | None = None) -> Policy:
    """Read one policy file. Raises `PolicyError` (file, line, field, problem)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError(str(path), None, (), f"cannot read the file: {exc.strerror or exc}") from exc
    return parse_policy(raw, path, mcp)


def parse_policy(raw: bytes, path: str | Path, mcp: McpHub | None = None) -> Policy:
    """Validate the bytes of a policy file; `path` names it in errors and in the result.

    The tools of its `mcp:` servers are discovered through `mcp` (the process's sessions)."""
    path = Path(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(str(path), None, (), f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    src = Source(str(path), text)
    root = src.root()
    f = root.fields(TOP_FIELDS)
    take = src.take
    name_at = f.get("name")
    name = take(lambda: name_at.string(), path.stem) if name_at else path.stem
    if not _NAME.match(name):
        take(lambda: (name_at or root).fail(f"policy name '{name}' may only hold letters, digits, '_', '-' and '.'"),
             None)
    no_folders: tuple[Path, ...] = ()
    search = (path.parent.resolve(), *take(lambda: _python_path(f.get("python_path"), path.parent), no_folders))
    no_tools: tuple[tuple[ToolDecl, ...], list[ToolOverride]] = ((), [])
    declared, overrides = take(lambda: _tools(f.get("tools"), f.has("mcp"), search), no_tools)
    servers: list[tuple[McpServerConfig, At]] = take(lambda: parse_servers(f.get("mcp"), path.parent), [])
    fields: dict[str, Any] = dict(
        name=name,
        description=take(lambda: d.string(non_empty=False), "") if (d := f.get("description")) else "",
        limits=take(lambda: _limits(f.get("limits")), Limits()),
        tool_errors=take(lambda: _tool_errors(f.get("tool_errors"), search), ToolErrorConfig(search=search)),
        dedupe=take(lambda: _dedupe(f.get("dedupe")), "read_only"),
        stop_when=tuple(w.each(_stop_rule)) if (w := f.get("stop_when")) else (),
        path=path,
        sandbox=take(lambda: _sandbox(f.get("sandbox")), None),
        system_prompt=take(lambda: s.string(), None) if (s := f.get("system_prompt")) else None,
        recovery=take(lambda: cast(Recovery, r.choice(get_args(Recovery))), "interrupt") if (r := f.get("recovery"))
        else "interrupt",
        tool_rounds=take(lambda: n.positive_int(), None) if (n := f.get("tool_rounds")) else None,
        python_path=search,
    )
    src.raise_any()  # every error of the file so far, at once
    # Discovery starts servers: only for a file valid up to here.
    discovered, found = discover(servers, mcp, {t.name for t in declared})
    tools = (*declared, *apply_overrides(discovered, overrides))
    approval = take(lambda: _approval(f.get("approval"), tools), None)
    limit_ask = (take(lambda: _limit_ask(f.get("limits"), fields["limits"], approval), None)
                 if approval is not None else None)
    src.raise_any()
    assert approval is not None
    return Policy(
        **fields,
        tools=tools,
        approval=approval,
        limit_ask=limit_ask,
        version=hashlib.sha256(version_input(raw, found)).hexdigest()[:12],
        mcp=tuple(config for config, _ in servers),
    )


def _dedupe(at: At | None) -> Dedupe:
    if at is None:
        return "read_only"
    if at.value is False:  # YAML 1.1 reads a bare `off` as false
        return "off"
    return cast(Dedupe, at.choice(get_args(Dedupe)))


def _limits(at: At | None) -> Limits:
    if at is None:
        return Limits()
    f = at.fields(("max_turns", "max_budget_usd", "budget_mode", "max_tool_calls", "max_duration_s", "on_exceed",
                   "ask"))
    return Limits(
        max_turns=t.positive_int() if (t := f.get("max_turns")) else None,
        max_budget_usd=b.positive_number() if (b := f.get("max_budget_usd")) else None,
        budget_mode=cast(Any, m.choice(("turn", "strict"))) if (m := f.get("budget_mode")) else "turn",
        max_tool_calls=c.positive_int() if (c := f.get("max_tool_calls")) else DEFAULT_MAX_TOOL_CALLS,
        max_duration_s=d.positive_number() if (d := f.get("max_duration_s")) else None,
    )


def _python_path(at: At | None, base: Path) -> tuple[Path, ...]:
    """`python_path`: folders (relative to the policy file) its modules are imported from."""
    if at is None:
        return ()
    folders: list[Path] = []
    for item in at.items():
        folder = (base / item.string()).resolve()
        if not folder.is_dir():
            item.fail(f"'{item.value}' is not a folder (looked for {folder})")
        folders.append(folder)
    return tuple(folders)


OnExceed = Literal["stop", "ask"]


def _limit_ask(at: At | None, limits: Limits, approval: ApprovalConfig) -> LimitAsk | None:
    """`limits.on_exceed` and `limits.ask`: None for `stop` (the default)."""
    if at is None:
        return None
    f = Fields(at)  # `_limits` read it first: a mapping of known fields
    on_exceed = cast(OnExceed, o.choice(get_args(OnExceed))) if (o := f.get("on_exceed")) else "stop"
    ask_at = f.get("ask")
    if on_exceed == "stop":
        if ask_at is not None:
            ask_at.fail("on_exceed is 'stop', so no limit asks anyone: set limits.on_exceed: ask, or remove ask")
        return None
    if ask_at is None:
        at.child("on_exceed", on_exceed).fail("'ask' needs limits.ask with a grant (what one grant adds to "
                                             "which limits)")
    a = ask_at.fields(("approvers", "grant", "max_grants", "max_total"), required=("grant",))
    grant = _amounts(a.req("grant"), limits, "raise")
    if not grant:
        a.req("grant").fail("must name at least one limit to raise (max_turns, max_budget_usd, max_tool_calls, "
                            "max_duration_s)")
    max_total = _amounts(m, limits, "bound") if (m := a.get("max_total")) is not None else {}
    for name, total in max_total.items():
        cap = limits.value(name)
        if cap is not None and total < cap:
            assert m is not None
            m.child(name, total).fail(f"{total:g} is below limits.{name} ({cap:g}): a total bounds what grants "
                                      "may raise the limit to")
    approvers_at = a.get("approvers")
    approvers = tuple(x.string() for x in approvers_at.items()) if approvers_at else approval.approvers
    if not approvers:
        (approvers_at or ask_at).fail("no approvers: name the teams that may grant more in limits.ask.approvers "
                                      "(or approval.approvers); a run's own team raises its limits by resuming it")
    return LimitAsk(approvers=approvers, grant=grant,
                    max_grants=g.positive_int() if (g := a.get("max_grants")) else None, max_total=max_total)


def _amounts(at: At, limits: Limits, verb: str) -> Amounts:
    """A mapping of limit name to a positive amount (whole for turns and tool calls); each
    limit named must be one the policy sets."""
    if not isinstance(at.value, dict):
        at.fail(f"must be a mapping of limit name to amount ({', '.join(LIMIT_NAMES)})")
    out: Amounts = {}
    for key, value in at.value.items():
        item = at.child(str(key), value)
        if key not in LIMIT_NAMES:
            item.fail(f"unknown limit (expected one of: {', '.join(LIMIT_NAMES)})")
        name = cast(LimitName, key)
        if limits.value(name) is None:
            item.fail(f"the policy sets no limits.{name} to {verb}")
        out[name] = item.positive_int() if name in WHOLE_LIMITS else item.positive_number()
    return out


def _tools(at: At | None, mcp: bool, search: tuple[Path, ...]) -> tuple[tuple[ToolDecl, ...], list[ToolOverride]]:
    """Declared tools, and (in a policy with `mcp:` servers) entries without an executor:
    overrides of discovered tools."""
    if at is None:
        return (), []
    tools: list[ToolDecl] = []
    overrides: list[ToolOverride] = []

    def one(item: At) -> None:
        if mcp and isinstance(item.value, dict) and "executor" not in item.value:
            override = parse_override(item)
            if any(o.name == override.name for o in overrides):
                item.child("name", override.name).fail(f"tool '{override.name}' is overridden twice")
            overrides.append(override)
            return
        tool = _tool(item, search)
        if any(t.name == tool.name for t in tools):
            item.child("name", tool.name).fail(f"tool '{tool.name}' is declared twice")
        tools.append(tool)

    at.each(one)
    return tuple(tools), overrides


def _tool(at: At, search: tuple[Path, ...]) -> ToolDecl:
    f = at.fields(TOOL_FIELDS, required=("name", "description", "executor"))
    name_at = f.req("name")
    name = name_at.string()
    if not TOOL_NAME.match(name):
        name_at.fail("a tool name holds 1 to 64 letters, digits, '_' or '-'")
    read_only = r.boolean() if (r := f.get("read_only")) is not None else False
    spec = ToolSpec(
        name=name,
        description=f.req("description").string(),
        parameters=_parameters(f.get("parameters")),
        read_only=read_only,
        destructive=d.boolean() if (d := f.get("destructive")) is not None else not read_only,
        needs_approval=n.boolean() if (n := f.get("needs_approval")) is not None else False,
        timeout_s=t.positive_number() if (t := f.get("timeout_s")) else None,
    )
    return ToolDecl(spec=spec, executor=_executor(f.req("executor"), search))


def _parameters(at: At | None) -> dict[str, Any]:
    if at is None:
        return dict(_EMPTY_PARAMETERS)
    if not isinstance(at.value, dict):
        at.fail("must be a JSON schema (a mapping)")
    try:
        jsonschema.Draft202012Validator.check_schema(at.value)
    except jsonschema.SchemaError as exc:
        raise at.src.error((*at.path, *exc.path), f"not a valid JSON schema: {exc.message}") from None
    if at.value.get("type") != "object":
        at.fail("the parameters schema must have type: object (tool arguments are a JSON object)")
    return dict(at.value)


def _executor(at: At, search: tuple[Path, ...]) -> ExecutorConfig:
    f = at.fields(("python", "http", "agent"))
    kinds = [k for k in ("python", "http", "agent") if f.has(k)]
    if len(kinds) != 1:
        at.fail(f"an executor names exactly one of python, http, agent (got {', '.join(kinds) or 'none'})")
    kind = f.req(kinds[0])
    if kinds[0] == "python":
        target = kind.string()
        try:
            resolve_callable(target, search)
        except ResolveError as exc:
            kind.fail(str(exc))
        return PythonExecutor(target, search=search)
    if kinds[0] == "http":
        return _http(kind)
    a = kind.fields(("policy", "model", "max_turns", "max_budget_usd", "system_prompt"), required=("policy",))
    return AgentExecutor(
        policy=a.req("policy").string(),
        model=m.string() if (m := a.get("model")) else None,
        max_turns=t.positive_int() if (t := a.get("max_turns")) else None,
        max_budget_usd=b.positive_number() if (b := a.get("max_budget_usd")) else None,
        system_prompt=s.string() if (s := a.get("system_prompt")) else None,
    )


def _http(at: At) -> HttpExecutor:
    headers: dict[str, str] = {}
    if isinstance(at.value, str):
        url_at, timeout = at, None
    else:
        h = at.fields(("url", "timeout_s", "headers"), required=("url",))
        url_at = h.req("url")
        timeout = t.positive_number() if (t := h.get("timeout_s")) else None
        if (hs := h.get("headers")) is not None:
            if not isinstance(hs.value, dict):
                hs.fail("must be a mapping of header name to value")
            for key, value in hs.value.items():
                headers[str(key)] = hs.child(str(key), value).string(non_empty=False)
    url = url_at.string()
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        url_at.fail(f"'{url}' is not an http:// or https:// URL")
    return HttpExecutor(url=url, timeout_s=timeout, headers=headers)


def _tool_errors(at: At | None, search: tuple[Path, ...]) -> ToolErrorConfig:
    if at is None:
        return ToolErrorConfig(search=search)
    f = at.fields(("text", "fatal", "permanent"))
    text = ToolErrorConfig.text
    if (t := f.get("text")) is not None:
        text = t.string()
        try:
            text.format(message="m", tool="t", error_type="E")
        except (KeyError, IndexError, ValueError) as exc:
            t.fail(f"bad template ({type(exc).__name__}: {exc}); it may use {{message}}, {{tool}}, {{error_type}}")
    permanent = DEFAULT_PERMANENT
    if (p := f.get("permanent")) is not None:
        names: list[str] = []
        for item in p.items():
            try:
                resolve_exception(item.string(), search)
            except ResolveError as exc:
                item.fail(str(exc))
            names.append(item.value)
        permanent = tuple(names)
    return ToolErrorConfig(text=text, fatal=x.boolean() if (x := f.get("fatal")) is not None else False,
                           permanent=permanent, search=search)


def _stop_rule(at: At) -> StopRule:
    f = at.fields(("repeated_call",))
    n = f.req("repeated_call")
    if n.positive_int() < 2:
        n.fail("must be at least 2 (one call is not a repetition)")
    return RepeatedCall(n.value)


def _approval(at: At | None, tools: tuple[ToolDecl, ...]) -> ApprovalConfig:
    if at is None:
        return ApprovalConfig()
    f = at.fields(("approvers", "expires_after_s", "rules", "on_decision"))
    approvers = tuple(p.each(lambda a: a.string())) if (p := f.get("approvers")) else ()
    rules = tuple(r.each(lambda item: _rule(item, tools))) if (r := f.get("rules")) else ()
    return ApprovalConfig(
        approvers=approvers,
        expires_after_s=e.positive_number() if (e := f.get("expires_after_s")) else None,
        rules=rules,
        on_decision=_on_decision(f.get("on_decision"), tools),
    )


def _on_decision(at: At | None, tools: tuple[ToolDecl, ...]) -> OnDecision:
    if at is None:
        return "wait"
    value = cast(OnDecision, at.choice(get_args(OnDecision)))
    if value == "resume" and not tools:
        at.fail("'resume' needs a server-side policy (one with tools): a pass-through run is driven by its client")
    return value


def _rule(at: At, tools: tuple[ToolDecl, ...]) -> Rule:
    f = at.fields(("tool", "args", "read_only", "destructive", "action", "reason"), required=("action",))
    tool_at = f.get("tool")
    tool = tool_at.string() if tool_at else "*"
    matching = [t for t in tools if fnmatch.fnmatchcase(t.name, tool)]
    if not matching:
        known = ", ".join(t.name for t in tools) or "none: this policy has no tools"
        (tool_at or at).fail(f"'{tool}' matches none of this policy's tools ({known})")
    args: dict[str, str] = {}
    if (a := f.get("args")) is not None:
        if not isinstance(a.value, dict):
            a.fail("must be a mapping of argument name to glob")
        for key, value in a.value.items():
            arg = a.child(str(key), value)
            if not isinstance(value, (str, int, float, bool)):
                arg.fail("must be a glob (a string) matched against the argument's value")
            if not any(str(key) in t.spec.parameters.get("properties", {}) for t in matching):
                arg.fail(f"no tool matched by '{tool}' has an argument '{key}'")
            args[str(key)] = arg_text(value)
    return Rule(
        action=cast(ApprovalAction, f.req("action").choice(get_args(ApprovalAction))),
        tool=tool,
        args=args,
        read_only=r.boolean() if (r := f.get("read_only")) is not None else None,
        destructive=d.boolean() if (d := f.get("destructive")) is not None else None,
        reason=s.string(non_empty=False) if (s := f.get("reason")) else "",
    )


def _sandbox(at: At | None) -> SandboxConfig | None:
    if at is None:
        return None
    f = at.fields(("sample", "path"))
    if f.has("sample") == f.has("path"):
        at.fail("a sandbox names exactly one of 'sample' (a packaged sample folder) or 'path' (a folder)")
    if (s := f.get("sample")) is not None:
        known = sample_names()
        if s.string() not in known:
            s.fail(f"no packaged sample named '{s.value}' (known: {', '.join(known)})")
        return SandboxConfig(sample=s.value)
    return SandboxConfig(path=f.req("path").string())
