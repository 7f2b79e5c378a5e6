"""Embeddings are routed like chat calls: the deployment's `model` is the name the upstream
is asked for (in the body and in a `{model}` path), a failed deployment is retried on the
next, every attempt is in the run's trace, and the call is booked at the price of the
deployment that answered."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from gateway.config.upstreams import AZURE_PATHS, UpstreamConfig
from gateway.providers.upstream import Upstream

from gateway.harness.state import scoped_run_id
from tests.server.conftest import KEY, CountingUpstream, MakeGateway, counted_config
from tests.support.procs import free_port


async def test_embeddings_take_the_deployment_s_model_fail_over_and_trace_their_attempts(
        make_gateway: MakeGateway, counting_upstream: CountingUpstream) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    config = counted_config(counting_upstream)
    config["upstreams"].append({"name": "dead", "base_url": dead})
    config["models"] = [
        {"match": "text-embedding-3-small", "retries": 1, "price_in": 1.0,
         "deployments": [{"upstream": "dead", "weight": 1000, "price_in": 5.0},
                         {"upstream": "counted", "model": "scripted-plan", "price_in": 0.5}]},
    ]
    gw = await make_gateway(**config)
    async with gw.client.post("/v1/embeddings", data=orjson.dumps({"model": "text-embedding-3-small",
                                                                   "input": "hello there"}),
                              headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": "emb-routed"}) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    [call] = [c for c in counting_upstream.calls if c["path"].endswith("/embeddings")]
    assert call["body"] == {"model": "scripted-plan", "input": "hello there"}
    run = await gw.store.load_run(scoped_run_id("t", "emb-routed"))
    assert run is not None
    assert run.cost_usd == pytest.approx(run.usage.prompt_tokens * 0.5 / 1e6)  # the answering deployment's price
    events = [e for _, e in await gw.store.events(scoped_run_id("t", "emb-routed"))]
    attempts = [(e["upstream"], e["model"], e["outcome"]) for e in events if e["type"] == "upstream_attempt"]
    assert attempts == [("dead", "text-embedding-3-small", "unreachable"), ("counted", "scripted-plan", "ok")]
    assert events[-1]["type"] == "embeddings"


@pytest.mark.parametrize(("model", "path"), [
    ("gpt4o-prod", "/openai/deployments/gpt4o-prod/embeddings"),
    ("../../admin", "/openai/deployments/..%2F..%2Fadmin/embeddings"),
    ("..", "/openai/deployments/%2E%2E/embeddings"),
    ("a b?c#d", "/openai/deployments/a%20b%3Fc%23d/embeddings"),
])
def test_a_model_name_in_a_path_stays_in_its_segment(model: str, path: str) -> None:
    """Glob routes take the name from the client: quoted, it never names another path."""
    config = UpstreamConfig("az", kind="azure", base_url="https://r.openai.azure.com", api_key_env="K",
                            query=(("api-version", "2024-10-21"),), paths=AZURE_PATHS)
    url = Upstream(config, SimpleNamespace(request=None), lambda: None).url(  # type: ignore[arg-type]
        "embeddings", model)
    assert str(url) == f"https://r.openai.azure.com{path}?api-version=2024-10-21"
