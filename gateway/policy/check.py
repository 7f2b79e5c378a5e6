"""`gateway policy check [FILES]`: validate policies and show what each tool call would meet.

For review in CI of a policy repository: every file is validated (errors name the file,
line and field, and the exit code is 1); every tool of a valid policy is printed with
its flags, its executor, and the approval outcome of representative calls (arguments
made from the rules' globs, and no arguments at all). Rules that never decide any of
those calls because an earlier rule always matches first are reported as shadowed. An
MCP server known to reach the filesystem that is started without a root (a git server
without `--repository`) is warned about (`gateway.mcp.reach`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from gateway.mcp.hub import McpHub, ServerHealth
from gateway.mcp.reach import unscoped
from gateway.policy.approval import (
    RuleApproval,
    compile_approval,
    duration_text,
    rule_matches,
)
from gateway.policy.decl import (
    AgentExecutor,
    HttpExecutor,
    McpExecutor,
    Policy,
    PythonExecutor,
    Rule,
    ToolDecl,
)
from gateway.policy.registry import load_set, policy_files

DEFAULT_DIR = Path("policies")


def policy_command(args: argparse.Namespace) -> int:
    """Entry point of `gateway policy check`; returns the exit code (1 if any file is invalid)."""
    return check(list(getattr(args, "files", None) or []), sys.stdout, sys.stderr)


def _expand(paths: Sequence[str]) -> list[Path]:
    if not paths:
        return policy_files(DEFAULT_DIR) if DEFAULT_DIR.is_dir() else []
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        out.extend(policy_files(path) if path.is_dir() else [path])
    return out


def _siblings(files: list[Path], mcp: McpHub) -> dict[str, Policy]:
    """Policies next to the checked files, so a file checked alone can name its sub-run policy."""
    others = sorted({p for f in files if f.parent.is_dir() for p in policy_files(f.parent)} - set(files))
    loaded, _ = load_set(others, mcp=mcp)
    return loaded


def check(paths: Sequence[str], out: TextIO, err: TextIO) -> int:
    """Validate `paths` (files or folders; default ./policies) and print the report.

    The MCP servers the policies name are started to discover their tools, and stopped
    before this returns."""
    files = _expand(paths)
    if not files:
        print(f"no policy files found (looked for {DEFAULT_DIR}/*.yaml)", file=err)
        return 1
    mcp = McpHub()
    try:
        policies, errors = load_set(files, _siblings(files, mcp), mcp=mcp)
        by_file = {str(p.path): p for p in policies.values()}
        failed = {e.file for e in errors}
        for file in files:
            policy = by_file.get(str(file))
            if policy is not None and str(file) not in failed:
                out.write(describe(policy, mcp))
    finally:
        mcp.close()
    for error in errors:
        print(f"error: {error}", file=err)
    bad = len(failed)
    print(f"{len(files) - bad} of {len(files)} policy file(s) valid" + (f", {bad} invalid" if bad else ""), file=out)
    return 1 if errors else 0


def describe(policy: Policy, mcp: McpHub | None = None) -> str:
    """The report of one valid policy (with `mcp`: how its MCP servers are doing)."""
    lines = [f"{policy.path}: policy {policy.name} (version {policy.version}, "
             f"{'server-side, ' + str(len(policy.tools)) + ' tool(s)' if policy.server_side else 'pass-through'})"]
    if policy.description:
        lines.append(f"  {policy.description}")
    lim = policy.limits
    lines.append(f"  limits: max_turns={lim.max_turns} max_budget_usd={lim.max_budget_usd} budget_mode={lim.budget_mode}"
                 f" max_tool_calls={lim.max_tool_calls} max_duration_s={lim.max_duration_s}")
    ask = policy.limit_ask
    if ask is not None:
        grants = f"at most {ask.max_grants} grant(s)" if ask.max_grants is not None else "no bound on grants"
        total = " ".join(f"{k}={v:g}" for k, v in ask.max_total.items()) or "none"
        lines.append(f"  on_exceed=ask: {', '.join(ask.grant)} ask {', '.join(ask.approvers)} for more; one grant "
                     f"adds {' '.join(f'{k}={v:g}' for k, v in ask.grant.items())}; {grants}; max_total: {total}")
    if policy.server_side:
        stops = ", ".join(f"repeated_call {s.n}" for s in policy.stop_when) or "none"
        te = policy.tool_errors
        lines.append(f"  dedupe={policy.dedupe}; stop_when: {stops}; tool errors: {te.text!r}"
                     f"{' (fatal)' if te.fatal else ''}, permanent: {', '.join(_permanent(te.permanent))}")
        ap = policy.approval
        expiry = f"expire after {duration_text(ap.expires_after_s)}" if ap.expires_after_s else "never expire"
        lines.append(f"  approvers: {', '.join(ap.approvers) or '(the team that owns the run)'}; "
                     f"pending approvals {expiry}; after a decision the run "
                     f"{'resumes at once' if ap.on_decision == 'resume' else 'waits for a resume'}")
        if policy.sandbox is not None:
            where = f"a fresh copy of sample '{policy.sandbox.sample}'" if policy.sandbox.sample else policy.sandbox.path
            lines.append(f"  sandbox: {where}")
        for server in policy.mcp:
            count = sum(1 for t in policy.tools if isinstance(t.executor, McpExecutor) and t.executor.server == server)
            health = _health_text(mcp.health_of(server)) if mcp is not None else "not started here"
            lines.append(f"  mcp server {server.name} ({server.transport} {server.where}): {health}; "
                         f"{count} tool(s) discovered")
            reach = unscoped(server)
            if reach is not None:
                lines.append(f"  warning: mcp server {server.name}: {reach}")
        approval = compile_approval(ap, policy.specs)
        decided: set[int] = set()
        for tool in policy.tools:
            lines.extend(_tool_lines(tool, approval, decided))
        for i, rule in enumerate(ap.rules):
            if i not in decided:
                lines.append(f"  warning: approval rule {i + 1} ({_rule_text(rule)}) never decides a representative"
                             f" call: an earlier rule always matches first")
    return "\n".join(lines) + "\n\n"


def _permanent(names: Sequence[str]) -> list[str]:
    always = "gateway.harness.tools:PermanentToolError"
    return list(names) if always in names else [*names, always + " (always)"]


def _tool_lines(tool: ToolDecl, approval: RuleApproval, decided: set[int]) -> list[str]:
    spec = tool.spec
    flags = (f"read_only={'yes' if spec.read_only else 'no'} destructive={'yes' if spec.destructive else 'no'} "
             f"needs_approval={'yes' if spec.needs_approval else 'no'}")
    if spec.timeout_s is not None:
        flags += f" timeout_s={spec.timeout_s:g}"
    lines = [f"  tool {spec.name}: {flags}; executor {_executor_text(tool)}"]
    for args in representative_args(tool, approval.rules):
        verdict, index = approval.explain(spec, args)
        by = f"rule {index + 1}" if index is not None else "the tool's needs_approval flag"
        if index is not None:
            decided.add(index)
        reason = f": {verdict.reason}" if verdict.reason else ""
        lines.append(f"    {spec.name}({orjson.dumps(args).decode()}) -> {verdict.action.upper()} ({by}{reason})")
    return lines


def _executor_text(tool: ToolDecl) -> str:
    ex = tool.executor
    if isinstance(ex, PythonExecutor):
        return f"python {ex.target}"
    if isinstance(ex, HttpExecutor):
        return f"http POST {ex.url}" + (f" (timeout {ex.timeout_s:g} s)" if ex.timeout_s else "")
    if isinstance(ex, McpExecutor):
        return f"mcp {ex.server.name}: {ex.tool}"
    assert isinstance(ex, AgentExecutor)
    return (f"agent: sub-run under policy {ex.policy} (model {ex.model or 'of the run'}, "
            f"max_turns {ex.max_turns}, max_budget_usd {ex.max_budget_usd})")


def _health_text(health: ServerHealth) -> str:
    text = f"{health.state} (started {health.starts} time(s), {health.failures} failure(s))"
    return text + (f", last error: {health.error}" if health.error else "")


def _rule_text(rule: Rule) -> str:
    parts = [f"tool {rule.tool}"]
    if rule.args:
        parts.append("args " + ", ".join(f"{k}={v}" for k, v in rule.args.items()))
    if rule.read_only is not None:
        parts.append(f"read_only={rule.read_only}")
    if rule.destructive is not None:
        parts.append(f"destructive={rule.destructive}")
    return " ".join(parts) + f" -> {rule.action}"


def example_value(glob: str, schema: Mapping[str, Any]) -> Any:
    """A value matching `glob`, typed as the argument's schema says (`true` for a boolean)."""
    text = re.sub(r"\[!?(.)[^\]]*\]", r"\1", glob).replace("*", "example").replace("?", "x")
    if schema.get("type") in ("boolean", "integer", "number"):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            return text
    return text


def representative_args(tool: ToolDecl, rules: Sequence[Rule]) -> list[dict[str, Any]]:
    """One call per rule that names arguments of this tool, then a call without arguments."""
    props: Mapping[str, Any] = tool.spec.parameters.get("properties", {})
    calls: list[dict[str, Any]] = []
    for rule in rules:
        if not rule.args or not all(k in props for k in rule.args):
            continue
        args = {k: example_value(glob, props.get(k, {})) for k, glob in rule.args.items()}
        if rule_matches(rule, tool.spec, args) and args not in calls:
            calls.append(args)
    calls.append({})
    return calls
