"""`GET /openapi.json` against a real gateway: it describes every route the process serves
and nothing else, each route it names answers (never 404 or 405), and it is well formed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.config.settings import parse_config
from gateway.server import context as ctx
from gateway.server.app import build_app
from gateway.server.openapi import OPERATIONS, routes
from tests.server.served import DEMO, Served


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("openapi") / "gw")
    yield gateway
    gateway.proc.stop()


async def test_the_document_names_every_route_and_each_answers(served: Served) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{served.proc.url}/openapi.json") as resp:
            assert resp.status == 200
            doc = await resp.json()
        assert doc["openapi"] == "3.1.0" and doc["components"]["schemas"]["Error"]["required"] == ["error"]
        config = parse_config(yaml.safe_load((served.folder / "config.yaml").read_text()), served.folder / "config.yaml")
        app = build_app(config)
        live = set(routes(app))
        await app[ctx.STORE].close()
        documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
        assert documented == live
        for method, path in sorted(live):
            entry = doc["paths"][path][method.lower()]
            assert entry["summary"] and (entry["responses"].get("200") or entry["responses"].get("201")), (method,
                                                                                                          path)
            for name in re.findall(r"{(\w+)}", path):
                assert any(p["name"] == name and p["in"] == "path" for p in entry["parameters"]), (method, path, name)
            url = served.proc.url + path.replace("{id}", "no-such-run").replace("{model}", "scripted-plan")
            async with session.request(method, url, headers={"Authorization": f"Bearer {DEMO}"}, data=b"{}") as resp:
                assert resp.status not in (404, 405) or (await resp.json())["error"]["code"] not in (
                    "route_not_found", "method_not_allowed"), (method, path, resp.status)


async def test_every_route_the_code_can_add_is_described(tmp_path: Path) -> None:
    """A config with every optional part on (the scripted mount, the runs API, Responses,
    embeddings, admin): the app's routes are all in OPERATIONS, so `document` cannot fail."""
    from tests.server.served import write_config

    write_config(tmp_path, 8099)
    config = parse_config(yaml.safe_load((tmp_path / "config.yaml").read_text()), tmp_path / "config.yaml")
    app = build_app(config)
    missing = set(routes(app)) - set(OPERATIONS)
    await app[ctx.STORE].close()
    assert not missing, f"routes without an OpenAPI description: {sorted(missing)}"
