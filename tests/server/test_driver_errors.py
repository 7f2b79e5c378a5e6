"""A run the loop could not finish is saved with a sentence, never an exception's class name."""

from __future__ import annotations

from pathlib import Path

from gateway.harness.model import ModelReply, ModelRequest
from gateway.harness.state import RunState
from gateway.harness.usage import DEFAULT_PRICE
from gateway.policy.registry import PolicyRegistry
from gateway.server.chat.answers import exit_sentence
from gateway.server.runs.driver import INTERNAL_ERROR, RunDriver
from gateway.store.memory import MemoryStore


class BrokenModel:
    """A model adapter with a bug: it raises something no layer expects."""

    async def complete(self, request: ModelRequest) -> ModelReply:
        raise KeyError("choices")


async def test_an_unexpected_error_ends_the_run_with_a_sentence_and_no_class_name(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "p.yaml").write_text(
        "name: p\ntools:\n  - name: list_files\n    description: List.\n"
        "    executor: {python: \"gateway.tools.files:list_files\"}\n")
    registry = PolicyRegistry(policies)
    registry.load()
    policy = registry.get("p")
    assert policy is not None
    store = MemoryStore()
    state = RunState.new("m", [{"role": "user", "content": "x"}], run_id="r1", team="t", policy="p",
                         policy_version=policy.version)
    await store.create_run(state)
    driver = RunDriver(store, registry, model_for=lambda s: BrokenModel(), price_for=lambda m: DEFAULT_PRICE,
                       runs_dir=tmp_path / "runs")
    drive = await driver.drive("r1")
    saved = await store.load_run("r1")
    assert saved is not None and saved.status == "failed" and saved.reason == "internal_error"
    assert saved.error == INTERNAL_ERROR == drive.state.error
    sentence = exit_sentence(saved)
    assert "KeyError" not in sentence and sentence == f"The run failed: {INTERNAL_ERROR}."
    stopped = [e for _, e in await store.events("r1") if e["type"] == "run_stopped"]
    assert len(stopped) == 1 and "KeyError" not in str(stopped[0])
