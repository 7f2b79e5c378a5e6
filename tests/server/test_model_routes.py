"""Which route a model name takes, on real gateway processes:

- the shipped config.yaml routes only names that exist: a typo'd model is a 404
  `model_not_found`, not a call to the `local` upstream;
- a glob route whose upstream cannot be reached says which route matched the model and why,
  for a plain call, a stream and a server-side run alike.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.server.served import request
from tests.support.procs import ROOT, START_TIMEOUT_S, Proc, free_port, start_gateway

TYPO = "gpt-4o-mni"


def _serve(folder: Path, config: dict[str, object] | None = None) -> Proc:
    """`gateway serve` on the shipped config (copied with the shipped policies), or on `config`
    changed into it."""
    shutil.copytree(ROOT / "policies", folder / "policies")
    data = yaml.safe_load((ROOT / "config.yaml").read_text())
    data.update(config or {})
    port = free_port()
    data["server"]["port"] = port
    (folder / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return start_gateway(["serve", "--config", str(folder / "config.yaml")], "/healthz", port,
                         folder / "gateway.log", timeout=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = _serve(tmp_path_factory.mktemp("shipped"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def catch_all(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """The shipped config with a catch-all route to a `local` upstream nothing listens on."""
    nowhere = free_port()
    proc = _serve(tmp_path_factory.mktemp("catch-all"), {
        "upstreams": [{"name": "scripted", "kind": "scripted"},
                      {"name": "local", "kind": "local", "base_url": f"http://127.0.0.1:{nowhere}/v1"}],
        "models": [{"match": "scripted-*", "upstream": "scripted"},
                   {"match": "*", "upstream": "local", "price_in": 0.0, "price_out": 0.0}]})
    proc.nowhere = nowhere  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def chat(session: aiohttp.ClientSession, proc: Proc, model: str, **extra: object) -> tuple[int, object]:
    status, _, body = await request(session, "POST", f"{proc.url}/v1/chat/completions", key="sk-demo",
                                    body={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})
    return status, body


async def test_the_shipped_config_answers_a_typo_with_model_not_found(shipped: Proc,
                                                                     session: aiohttp.ClientSession) -> None:
    status, body = await chat(session, shipped, TYPO)
    assert status == 404, body
    assert body["error"]["code"] == "model_not_found" and TYPO in body["error"]["message"]  # type: ignore[index]
    status, _ = await chat(session, shipped, "scripted-plan")
    assert status == 200
    status, body = await chat(session, shipped, "qwen2.5-coder-0.5b")  # routed to `gateway local`, not running here
    assert status == 502 and "upstream 'local' is unreachable" in body["error"]["message"]  # type: ignore[index]
    assert "route '" not in body["error"]["message"]  # type: ignore[index]  # routed by its name


async def test_a_glob_route_that_cannot_connect_names_the_route_and_the_model(catch_all: Proc,
                                                                               session: aiohttp.ClientSession) -> None:
    nowhere = catch_all.nowhere  # type: ignore[attr-defined]
    words = f"route '*' (model '{TYPO}') -> upstream 'local' is unreachable: cannot connect to 127.0.0.1:{nowhere}"
    status, body = await chat(session, catch_all, TYPO)
    assert status == 502 and words in body["error"]["message"], body  # type: ignore[index]
    async with session.post(f"{catch_all.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-demo"},
                            json={"model": TYPO, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                            ) as resp:
        streamed = await resp.json(content_type=None)
    assert resp.status == 502 and words in streamed["error"]["message"], streamed
    status, _, body = await request(session, "POST", f"{catch_all.url}/v1/chat/completions", key="sk-demo",
                                    body={"model": TYPO, "messages": [{"role": "user", "content": "hi"}]},
                                    headers={"X-Policy": "files", "X-Run-Id": "glob-server-side"})
    assert words in str(body), body  # the server-side run's stop says it too
