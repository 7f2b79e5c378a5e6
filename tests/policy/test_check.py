"""`gateway policy check` as a user runs it: a real subprocess, its output and exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.policy.conftest import WriteFile
from tests.support.procs import run_gateway

REPO = Path(__file__).resolve().parents[2]


def gateway(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return run_gateway(["policy", "check", *args], cwd=cwd, env=env)


def test_the_shipped_policies_pass_with_each_tool_and_its_outcome() -> None:
    done = gateway()  # default: policies/*.yaml of the current folder
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "policies/files.yaml: policy files (version " in out
    assert "policies/passthrough.yaml: policy passthrough" in out and "pass-through" in out
    assert "tool delete_file: read_only=no destructive=yes needs_approval=yes; executor python gateway.tools.files:delete_file" in out
    assert ('delete_file({"path":"notes.txt"}) -> DENY (rule 1: notes.txt is the team\'s runbook; '
            'it is never deleted.)') in out
    assert 'delete_file({"path":"example.log"}) -> ASK (rule 2)' in out
    assert "delete_file({}) -> ASK (rule 3)" in out
    assert "list_files({}) -> ALLOW (the tool's needs_approval flag)" in out
    assert "executor agent: sub-run under policy files (model scripted-plan, max_turns 6, max_budget_usd 0.05)" in out
    assert "approvers: ops; pending approvals expire after 1 day" in out
    assert ("  on_exceed=ask: max_turns, max_budget_usd ask ops for more; one grant adds max_turns=3 "
            "max_budget_usd=0.25; at most 3 grant(s); max_total: max_turns=12 max_budget_usd=2") in out
    assert out.rstrip().endswith("4 of 4 policy file(s) valid")


def test_a_file_checked_alone_may_name_its_siblings() -> None:
    done = gateway("policies/research.yaml")
    assert done.returncode == 0, done.stderr
    assert "policy research" in done.stdout and "policies/files.yaml" not in done.stdout
    assert "1 of 1 policy file(s) valid" in done.stdout


def test_invalid_files_exit_1_naming_file_line_and_field(policy_dir: Path, write: WriteFile) -> None:
    good = write("good.yaml", "name: good\nlimits: {max_turns: 3}\n")
    bad = write("bad.yaml", "name: bad\ntools:\n  - name: t\n    description: T.\n"
                "    executor: {python: 'no.such.module:f'}\n")
    done = gateway(str(good), str(bad))
    assert done.returncode == 1
    assert f"error: {bad}:5: tools[0].executor.python: cannot import module 'no.such.module'" in done.stderr
    assert f"{good}: policy good" in done.stdout and "policy bad" not in done.stdout
    assert "1 of 2 policy file(s) valid, 1 invalid" in done.stdout


def test_shadowed_rules_are_reported(tmp_path: Path, write: WriteFile, policy_dir: Path) -> None:
    write("p.yaml", """
        name: p
        tools:
          - name: delete_file
            description: D.
            parameters: {type: object, properties: {path: {type: string}, force: {type: boolean}}}
            executor: {python: "tests.policy.sample_tools:echo_sync"}
        approval:
          rules:
            - {tool: "*", read_only: false, action: ask}
            - {tool: delete_file, args: {path: "*.log", force: true}, action: allow}
        """)
    done = gateway(cwd=tmp_path)  # a folder named policies in the current directory
    assert done.returncode == 0, done.stderr
    assert 'delete_file({"path":"example.log","force":true}) -> ASK (rule 1)' in done.stdout
    assert "warning: approval rule 2 (tool delete_file args path=*.log, force=true -> allow) never decides" \
        in done.stdout


def test_no_files_is_an_error(tmp_path: Path) -> None:
    done = gateway(cwd=tmp_path)
    assert done.returncode == 1 and "no policy files found" in done.stderr


def test_the_shipped_mcp_example_lists_its_discovered_tools_with_their_outcomes() -> None:
    bin_dir = str(Path(sys.executable).parent)  # where pip put mcp-server-git
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    done = run_gateway(["policy", "check", "policies/mcp/git.yaml"], cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert ("mcp server git (stdio mcp-server-git --repository .): up (started 1 time(s), 0 failure(s)); "
            "10 tool(s) discovered") in out
    assert "warning: mcp server git" not in out  # pinned to one repository
    assert ("tool git_status: read_only=yes destructive=no needs_approval=no timeout_s=30; "
            "executor mcp git: git_status") in out
    assert "git_status({}) -> ALLOW (the tool's needs_approval flag)" in out
    assert "git_reset({}) -> ASK (rule 1)" in out  # destructiveHint: the one-line rule asks
    assert "git_commit({}) -> ASK (the tool's needs_approval flag)" in out  # the override
    assert "git_checkout" not in out  # excluded
    assert out.rstrip().endswith("1 of 1 policy file(s) valid")


def test_every_error_of_a_file_is_reported_at_once_one_line_each(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text(
        "name: broken\n"                                  # 1
        "colour: blue\n"                                  # 2: unknown field
        "limits: {max_turns: -1}\n"                       # 3
        "tools:\n"                                        # 4
        "  - name: read\n"                                # 5
        "    description: R.\n"
        "    executor: {python: 'no_such_module:read'}\n"  # 7
        "  - name: ok\n"
        "    description: O.\n"
        "    executor: {python: 'tests.policy.sample_tools:echo_sync'}\n"
        "    timeout_s: soon\n"                           # 11
        "recovery: later\n")                              # 12
    done = gateway(str(tmp_path / "broken.yaml"))
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    file = tmp_path / "broken.yaml"
    assert [e.split(": ", 3)[1:3] for e in errors] == [
        [f"{file}:2", "colour"], [f"{file}:3", "limits.max_turns"], [f"{file}:7", "tools[0].executor.python"],
        [f"{file}:11", "tools[1].timeout_s"], [f"{file}:12", "recovery"]], done.stderr
    assert "0 of 1 policy file(s) valid, 1 invalid" in done.stdout


def test_a_git_server_started_without_a_repository_is_warned_about(tmp_path: Path) -> None:
    shipped = (REPO / "policies" / "mcp" / "git.yaml").read_text()
    unpinned = shipped.replace('command: [mcp-server-git, --repository, "."]', "command: [mcp-server-git]")
    assert unpinned != shipped
    (tmp_path / "git.yaml").write_text(unpinned.replace("cwd: ../..", f"cwd: {REPO}"))
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    done = run_gateway(["policy", "check", str(tmp_path / "git.yaml")], cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr  # a warning, not an error
    assert ("warning: mcp server git: mcp-server-git is started without a root, so it reaches any git repository "
            "the gateway's user can read; pin one with `--repository PATH`") in done.stdout
