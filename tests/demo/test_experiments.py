"""The chapter's experiments, run for real (scripted provider over HTTP), against its relations."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.demo.main import ORDER, run_experiments
from gateway.demo.report import Result
from tests.support.procs import run_gateway

CHAPTER_PLAN_PROMPTS = (204, 269, 342)


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], Result]:
    out = asyncio.run(run_experiments(ORDER, emit=False))
    return {(r.experiment, r.variant): r for r in out}


def of(results: dict[tuple[str, str], Result], experiment: str) -> list[Result]:
    return [r for (e, _), r in results.items() if e == experiment]


def test_plan_is_three_turns_two_tools_and_prompts_grow(results: dict[tuple[str, str], Result]) -> None:
    plan = results["plan", "cap 20"]
    assert (plan.status, plan.turns, plan.tool_runs) == ("completed", 3, ["list_files", "read_file:errors.log"])
    assert plan.prompt_tokens == sum(plan.per_turn_prompt_tokens)
    assert all(b > a for a, b in zip(plan.per_turn_prompt_tokens, plan.per_turn_prompt_tokens[1:]))
    for ours, chapter in zip(plan.per_turn_prompt_tokens, CHAPTER_PLAN_PROMPTS, strict=True):
        assert abs(ours - chapter) <= 0.10 * chapter
    assert plan.cost_usd == pytest.approx((plan.prompt_tokens * 2 + plan.completion_tokens * 12) / 1e6, abs=1e-6)
    assert "worker 7" in plan.answer


def test_runaway_input_grows_quadratically(results: dict[tuple[str, str], Result]) -> None:
    runs = {r.variant: r for r in of(results, "runaway")}
    for cap in (8, 20, 50, 100):
        r = runs[f"cap {cap}"]
        assert r.status == "max_turns_exceeded" and r.turns == cap and len(r.tool_runs) == cap - 1
    assert 3.5 <= runs["cap 100"].cost_usd / runs["cap 50"].cost_usd <= 4.2
    assert runs["cap 20"].cost_usd == pytest.approx(0.038, rel=0.1)


def test_every_budget_run_overshoots_by_less_than_one_turn(results: dict[tuple[str, str], Result]) -> None:
    runs = of(results, "budget")
    assert len(runs) == 3
    for r in runs:
        assert r.status == "budget_exceeded"
        assert 0 <= r.extra["overshoot_usd"] < r.extra["last_turn_usd"]
    assert len({r.turns for r in runs}) == 3  # the budget buys a different number of turns each time


def test_only_the_actionable_error_text_recovers(results: dict[tuple[str, str], Result]) -> None:
    fatal, vague, actionable = (results["recover", v] for v in ("fatal", 'vague "Error"', "actionable text"))
    assert fatal.status == "failed" and "timeout.log" in str(fatal.reason)
    assert vague.status == "completed" and "do not know" in vague.answer
    assert actionable.status == "completed" and "errors.log" in actionable.answer
    assert actionable.tool_runs == ["read_file:timeout.log", "list_files", "read_file:errors.log"]
    assert actionable.cost_usd > 3.5 * fatal.cost_usd


def test_permanent_error_stops_early_cheaper_and_says_why(results: dict[tuple[str, str], Result]) -> None:
    old, new = results["forbidden", "retry until cap 12"], results["forbidden", "permanent error stops"]
    assert old.status == "max_turns_exceeded" and old.turns == 12 and len(old.tool_runs) == 11
    assert new.status == "failed" and new.turns < 12 and new.cost_usd < old.cost_usd
    assert "permission denied" in str(new.reason)


def test_dedupe_saves_the_tool_run_not_the_turn(results: dict[tuple[str, str], Result]) -> None:
    base = results["repeat", "baseline (one read)"]
    plain = results["repeat", "same read twice, no dedupe"]
    cached = results["repeat", "same read twice, dedupe"]
    assert len(plain.tool_runs) == 2 and len(cached.tool_runs) == 1
    assert plain.turns == cached.turns == base.turns + 1
    assert cached.cost_usd > base.cost_usd and cached.cost_usd == pytest.approx(plain.cost_usd, rel=0.05)


def test_naive_write_cache_deletes_once_the_gate_twice(results: dict[tuple[str, str], Result]) -> None:
    naive = results["repeat", "naive cache on every tool"]
    gate = results["repeat", "cache only on read-only tools"]
    assert (len(naive.tool_runs), naive.deleted) == (1, ["access.log"])
    assert (len(gate.tool_runs), gate.deleted) == (2, ["access.log", "access.log"])


def test_approval_decides_and_answers_never_claim_a_deletion_that_did_not_happen(
        results: dict[tuple[str, str], Result]) -> None:
    paused = results["destructive", "paused for approval"]
    assert (paused.status, paused.reason, paused.turns, paused.deleted) == ("interrupted", "approval", 2, [])
    approved = results["destructive", "approved"]
    assert approved.turns == 3 and approved.deleted == ["access.log"] and "Deleted access.log" in approved.answer
    for variant in ("rejected with a reason", "rejected with nothing"):
        rejected = results["destructive", variant]
        assert rejected.turns == 3 and rejected.deleted == []
        assert "Deleted" not in rejected.answer and "did not delete" in rejected.answer
    # the chapter's harness wrote an empty result: nothing was deleted and the agent says it was
    silent = results["destructive", "rejected, empty result (chapter)"]
    assert silent.deleted == [] and silent.answer == "Deleted access.log to free space."


def test_killed_and_resumed_run_costs_the_same_and_runs_each_tool_once(results: dict[tuple[str, str], Result]) -> None:
    restored, finished = results["resume", "restored after SIGKILL"], results["resume", "resumed and finished"]
    plan = results["plan", "cap 20"]
    assert (restored.turns, restored.extra["messages"], restored.status) == (2, 6, "running")
    assert restored.cost_usd == pytest.approx(0.001570, abs=1e-6)
    assert finished.status == "completed" and finished.cost_usd == plan.cost_usd
    assert finished.tool_runs == plan.tool_runs  # across both processes: no tool ran twice
    assert finished.per_turn_prompt_tokens == plan.per_turn_prompt_tokens  # no turn paid twice


def test_stop_reaches_into_the_slow_tool(results: dict[tuple[str, str], Result]) -> None:
    full, stopped = results["cancel", "no Stop"], results["cancel", "Stop at 1.2 s"]
    assert full.status == "completed" and full.ms >= 3000 and full.extra["progress"] == 6
    assert stopped.status == "interrupted" and stopped.reason == "user pressed Stop"
    # The Stop cut the 3 s scan short (the milliseconds are benchmarks/stop_latency.py's figure).
    assert 1200 <= stopped.ms < full.ms and stopped.extra["stop_to_end_ms"] < 3000 - 1200


def test_wall_time_is_turns_times_latency_plus_a_small_harness(results: dict[tuple[str, str], Result]) -> None:
    runs = {r.variant: r for r in of(results, "latency")}
    slow = runs["provider 500 ms"]
    # The harness is small next to one model call (its own time is benchmarks/harness_overhead.py's
    # figure: a loaded machine stretches it, so no milliseconds are asserted here).
    assert slow.ms >= 3 * 500 and all(0 <= r.extra["harness_ms"] < 500 for r in runs.values())


def test_research_runs_a_child_with_its_own_transcript(results: dict[tuple[str, str], Result]) -> None:
    r = results["research", "sub-run"]
    assert r.status == "completed" and r.tool_runs == ["research"]
    assert r.extra["child_turns"] == 3 and r.extra["child_tools"] == 2 and "errors.log" in r.answer
    assert r.prompt_tokens > sum(r.per_turn_prompt_tokens)  # the child's tokens rolled up into the parent


def test_demo_json_lines_carry_the_contract_fields() -> None:
    done = run_gateway(["demo", "--json", "--only", "plan", "--only", "destructive"])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 6
    for row in rows:
        for key in ("experiment", "variant", "status", "reason", "turns", "tool_runs", "prompt_tokens",
                    "completion_tokens", "per_turn_prompt_tokens", "cost_usd", "answer", "deleted", "ms"):
            assert key in row
    assert rows[0]["cost_usd"] == 0.00247 and rows[2]["deleted"] == ["access.log"]


def test_unknown_experiment_is_refused_by_name() -> None:
    proc = run_gateway(["demo", "--only", "nope"])
    assert proc.returncode != 0 and "unknown experiment(s) nope" in proc.stderr
