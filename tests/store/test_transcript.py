"""A run's transcript beside its head, on every backend: each message stored once, a save
writes the head and what is new, a rewritten history is stored as it is, and runs stored
before heads (schemas 1 to 4: one body holding everything) are read and take the new shape on
their next save."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from gateway.harness.state import SCHEMA_VERSION, RunState
from gateway.harness.usage import Usage
from gateway.store.base import Store
from gateway.store.errors import RunExists, StaleRun
from tests.store.conftest import Stores

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def make_run(run_id: str) -> RunState:
    return RunState.new("scripted-plan", [{"role": "user", "content": "go"}], run_id=run_id, team="demo",
                        policy="files")


def a_turn(run: RunState, i: int, size: int = 200) -> None:
    run.messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]})
    run.model_call_ids.append(f"c{i}")  # as own_calls records a call of the run's model
    run.messages.append({"role": "tool", "tool_call_id": f"c{i}", "name": "read_file", "content": "x" * size})
    run.count_turn(Usage(100 + i, 10), 0.001)


async def test_each_save_rewrites_the_head_only_and_a_load_gives_back_the_whole_run(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    run = make_run("demo/long")
    await a.create_run(run)
    sizes = []
    for i in range(40):
        a_turn(run, i, size=20_000)
        await a.commit_turn(run, [{"type": "turn", "turn": i}])
        sizes.append(len(await stores.stored_head(a, "demo/long")))
    assert max(sizes) - min(sizes) < 40  # 800 KB of transcript and 40 calls of the model do not grow it (counts do)
    loaded = await b.load_run("demo/long")
    assert loaded is not None
    assert loaded.to_json() == run.to_json() and len(loaded.messages) == 81 and len(loaded.per_turn) == 40
    assert [r.to_json() for r in await b.list_runs(team="demo")] == [run.to_json()]


async def test_the_head_is_the_same_size_after_200_turns_as_after_10(stores: Stores) -> None:
    """What a save rewrites does not grow with the run: the ids of its model's calls are
    kept with their turns beside the head (schema 6), not in it."""
    store = stores.open()
    run = make_run("demo/flat")
    await store.create_run(run)
    heads: dict[int, dict[str, object]] = {}
    for i in range(200):
        a_turn(run, 1000 + i, size=10)
        run.cost_usd, run.usage = 0.25, Usage(500_000, 5_000)  # figures kept as they are: only the ids could change
        await store.commit_turn(run, [{"type": "turn"}])
        heads[i + 1] = orjson.loads(await stores.stored_head(store, "demo/flat"))
    for head in heads.values():  # the counters (of a width that grows by a digit or two), and the clock
        for counter in ("turns", "revision", "transcript", "updated_at"):
            del head[counter]
    assert heads[10] == heads[200]  # nothing else in the head tells 10 turns from 200
    loaded = await stores.open().load_run("demo/flat")
    assert loaded is not None and loaded.model_call_ids == [f"c{1000 + i}" for i in range(200)]


async def test_a_run_saved_under_v5_keeps_its_ids_when_continued(stores: Stores) -> None:
    """A 2-turn run whose head holds its calls' ids (schema 5) loads with them, keeps them
    through a save without a turn, and after its next turns holds them all, in order."""
    store = stores.open()
    v5 = orjson.loads((FIXTURES / "run_v5_stored.json").read_bytes())
    head = dict(v5["head"], run_id="demo/v5", team="demo", policy="files")
    seed = make_run("demo/v5")
    await store.create_run(seed)
    await stores.put_stored(store, "demo/v5", orjson.dumps(head), v5["messages"], v5["per_turn"])
    run = await store.load_run("demo/v5")
    assert run is not None and run.model_call_ids == ["c1", "c2"] and run.turns == 2
    run.status, run.interruption = "running", None  # a decision's save: no turn
    await store.save_run(run)
    again = await stores.open().load_run("demo/v5")
    assert again is not None and again.model_call_ids == ["c1", "c2"] and again.version == SCHEMA_VERSION
    again.messages.append({"role": "tool", "tool_call_id": "c2", "name": "delete_file", "content": "deleted"})
    for i in range(3, 5):
        a_turn(again, i)
        await store.commit_turn(again, [{"type": "turn"}])
    final = await stores.open().load_run("demo/v5")
    assert final is not None and final.model_call_ids == ["c1", "c2", "c3", "c4"]
    assert final.to_json() == again.to_json()
    assert b"c1" not in await stores.stored_head(store, "demo/v5")  # moved to the turn that came next


async def test_a_history_sent_again_adds_only_what_is_new_and_a_rewritten_one_replaces_it(store: Store) -> None:
    run = make_run("demo/passthrough")
    await store.create_run(run)
    for i in range(3):
        a_turn(run, i)
        await store.save_run(run)
    # a pass-through client sends its whole history again: equal messages, new objects
    again = [dict(m) for m in run.messages] + [{"role": "user", "content": "and then?"}]
    run.messages = again
    await store.save_run(run)
    loaded = await store.load_run("demo/passthrough")
    assert loaded is not None and loaded.messages == again
    # another client edits its history (drops the last turns, rewrites the first answer)
    edited = [run.messages[0], {"role": "assistant", "content": "an edited answer"}]
    loaded.messages = edited
    loaded.per_turn = loaded.per_turn[:1]
    await store.save_run(loaded)
    final = await store.load_run("demo/passthrough")
    assert final is not None and final.messages == edited and final.per_turn == [Usage(100, 10)]
    a_turn(final, 9)
    await store.commit_turn(final, [])
    assert (await store.load_run("demo/passthrough")).to_json() == final.to_json()  # type: ignore[union-attr]


@pytest.mark.parametrize("fixture", ["run_v1.json", "run_v2.json", "run_v3.json", "run_v4.json"])
async def test_a_run_stored_before_heads_is_read_and_saved_in_the_new_shape(stores: Stores, fixture: str) -> None:
    store = stores.open()
    legacy = orjson.loads((FIXTURES / fixture).read_bytes())
    legacy.update(run_id="demo/old", team="demo", policy="files", status="running")
    body = orjson.dumps(legacy)
    seed = make_run("demo/old")
    await store.create_run(seed)  # the run's row and indexes; its body is then put back whole
    await stores.put_whole_body(store, "demo/old", body)
    run = await store.load_run("demo/old")
    assert run is not None
    assert run.messages == legacy["messages"] and [u.to_json() for u in run.per_turn] == legacy["per_turn"]
    assert run.model_call_ids == ["c1", "c2"] and run.version == SCHEMA_VERSION
    assert (run.key_id, run.user) == (legacy.get("key_id", ""), legacy.get("user"))
    run.messages.append({"role": "tool", "tool_call_id": "c2", "name": "delete_file", "content": "deleted"})
    await store.save_run(run)
    assert b'"messages":[' not in await stores.stored_head(store, "demo/old")
    again = await stores.open().load_run("demo/old")
    assert again is not None and again.to_json() == run.to_json()


async def test_a_refused_create_leaves_the_run_saving_only_what_is_new(store: Store) -> None:
    run = make_run("demo/twice")
    await store.create_run(run)
    a_turn(run, 1)
    await store.commit_turn(run, [{"type": "turn"}])
    with pytest.raises(RunExists):
        await store.create_run(run)  # what it would have written is made apart from the run
    a_turn(run, 2)
    await store.commit_turn(run, [{"type": "turn"}])
    loaded = await store.load_run("demo/twice")
    assert loaded is not None and loaded.to_json() == run.to_json() and loaded.model_call_ids == ["c1", "c2"]


async def test_a_refused_save_writes_none_of_its_transcript(store: Store) -> None:
    run = make_run("demo/r")
    await store.create_run(run)
    stale = run.copy()
    a_turn(run, 1)
    await store.save_run(run)
    a_turn(stale, 2, size=50)
    with pytest.raises(StaleRun):
        await store.commit_turn(stale, [{"type": "turn"}])
    loaded = await store.load_run("demo/r")
    assert loaded is not None and loaded.to_json() == run.to_json()


async def test_retention_deletes_a_runs_transcript_with_it(stores: Stores) -> None:
    store = stores.open()
    run = make_run("demo/done")
    await store.create_run(run)
    for i in range(3):
        a_turn(run, i)
        await store.commit_turn(run, [{"type": "turn"}])
    run.status = "completed"
    await store.save_run(run)
    assert await stores.stored_items(store, "demo/done") == 7 + 3  # messages, per_turn pairs
    assert await store.prune_runs(time.time() + 3600) == 1
    assert await store.load_run("demo/done") is None
    assert await stores.stored_items(store, "demo/done") == 0
