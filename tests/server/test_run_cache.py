"""The per-process run cache: copies in and out, bounded, entries that age out."""

from __future__ import annotations

from gateway.harness.state import RunState
from gateway.server.runs.run_cache import RunCache


def run(run_id: str) -> RunState:
    return RunState.new("scripted-plan", [{"role": "user", "content": "go"}], run_id=run_id, team="t")


def test_a_cached_run_comes_back_as_a_copy_that_the_caller_may_change() -> None:
    cache = RunCache()
    original = run("t/a")
    cache.put(original)
    original.turns = 5  # the caller goes on with its own object: the cache keeps what was put
    got = cache.get("t/a")
    assert got is not None and got.turns == 0
    got.messages.append({"role": "assistant", "content": "x"})
    again = cache.get("t/a")
    assert again is not None and len(again.messages) == 1
    assert cache.get("t/missing") is None


def test_the_least_recently_used_run_goes_first_when_full() -> None:
    cache = RunCache(max_runs=2)
    cache.put(run("t/a"))
    cache.put(run("t/b"))
    assert cache.get("t/a") is not None  # a is used: b is now the oldest
    cache.put(run("t/c"))
    assert len(cache) == 2
    assert cache.get("t/b") is None and cache.get("t/a") is not None and cache.get("t/c") is not None
    cache.drop("t/a")
    assert cache.get("t/a") is None


def test_an_entry_past_its_age_is_not_used() -> None:
    cache = RunCache(max_age_s=-1.0)  # every entry is already too old
    cache.put(run("t/a"))
    assert cache.get("t/a") is None
