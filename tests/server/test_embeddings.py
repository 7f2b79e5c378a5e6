"""POST /v1/embeddings with the real OpenAI SDK against a real gateway process: forwarded
to the model's upstream (the scripted provider's deterministic vectors), paid at price_in
from the run's and the team's budgets, counted in metrics, never a turn."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import openai
import pytest

from gateway.harness.usage import Price, Usage
from gateway.tokens import get_counter
from tests.server.conftest import OTHER_KEY, config_data
from tests.server.test_responses import load_run, sdk, serve
from tests.support.procs import Proc

PRICE = Price(2.0, 12.0)
TEXTS = ["Which file mentions a timeout?", "worker 7 timed out after 30000 ms"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = serve(tmp_path_factory.mktemp("embeddings") / "gw", config_data(other={"budget_usd": 0.00001}))
    yield proc
    proc.stop()


def scrape(proc: Proc, prefix: str) -> float:
    text = urllib.request.urlopen(proc.url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def test_embeddings_are_forwarded_and_paid_by_the_run_without_a_turn(gateway: Proc) -> None:
    client = sdk(gateway, **{"X-Run-Id": "emb-run"})
    raw = await client.embeddings.with_raw_response.create(model="scripted-plan", input=TEXTS)
    result = raw.parse()
    tokens = sum(get_counter().count_text(t) for t in TEXTS)
    assert [len(d.embedding) for d in result.data] == [8, 8] and result.usage.prompt_tokens == tokens
    assert raw.headers["X-Run-Id"] == "emb-run" and raw.headers["X-Run-Turns"] == "0"
    run = await load_run(gateway, "emb-run")
    assert run.turns == 0 and run.usage == Usage(tokens, 0)
    assert run.cost_usd == pytest.approx(PRICE.cost(Usage(tokens, 0)), abs=1e-12)
    assert float(raw.headers["X-Run-Cost-Usd"]) == pytest.approx(run.cost_usd, abs=1e-9)
    again = await sdk(gateway).embeddings.create(model="scripted-plan", input=TEXTS[0])  # no run: the team pays
    assert again.data[0].embedding == result.data[0].embedding
    assert scrape(gateway, 'gateway_cost_usd_total{model="scripted-plan",team="t"}') == pytest.approx(
        PRICE.cost(Usage(tokens + get_counter().count_text(TEXTS[0]), 0)), abs=1e-12)
    assert scrape(gateway, 'gateway_team_spend_usd{team="t"}') == pytest.approx(
        PRICE.cost(Usage(tokens + get_counter().count_text(TEXTS[0]), 0)), abs=1e-9)


async def test_a_team_budget_that_cannot_pay_refuses_before_forwarding(gateway: Proc) -> None:
    with pytest.raises(openai.RateLimitError) as refused:
        await sdk(gateway, OTHER_KEY).embeddings.create(model="scripted-plan", input=" ".join(TEXTS * 20))
    assert refused.value.code == "team_budget_exceeded"
    assert refused.value.response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"input": [{"text": "x"}]}, "input[0]"),
    ({"input": "x", "extra_body": {"frobnicate": True}}, "frobnicate"),
    ({"input": "x", "model": "gpt-nope"}, "model"),
])
async def test_bad_embeddings_input_names_the_field(gateway: Proc, kwargs: dict[str, object], param: str) -> None:
    args = {"model": "scripted-plan", **kwargs}
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as bad:
        await sdk(gateway, **{"X-Run-Id": "emb-bad"}).embeddings.create(**args)  # type: ignore[arg-type]
    assert bad.value.param == param
    assert await load_run(gateway, "emb-bad") is None


async def test_token_arrays_are_paid_at_their_length(gateway: Proc) -> None:
    client = sdk(gateway, **{"X-Run-Id": "emb-tokens"})
    result = await client.embeddings.create(model="scripted-plan", input=[[1, 2, 3], [4, 5]])
    assert len(result.data) == 2 and result.usage.prompt_tokens == 5
    run = await load_run(gateway, "emb-tokens")
    assert run.cost_usd == pytest.approx(PRICE.cost(Usage(5, 0)), abs=1e-12)
