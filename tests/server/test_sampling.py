"""A server-side run passes the client's sampling settings on to every model call it makes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gateway.config.settings import load_config
from gateway.server.app import build_app
from tests.server.conftest import (
    KEY,
    PLAN_USER,
    CountingUpstream,
    config_data,
    counted_config,
    write_config,
)

ROOT = Path(__file__).resolve().parents[2]


async def test_temperature_seed_and_max_tokens_reach_every_turn(aiohttp_client: Any, tmp_path: Path,
                                                               counting_upstream: CountingUpstream) -> None:
    path = write_config(tmp_path, config_data(**counted_config(counting_upstream),
                                              team={"policies": ["files", "passthrough"]}))
    shutil.copy(ROOT / "policies" / "files.yaml", tmp_path / "policies" / "files.yaml")
    client = await aiohttp_client(build_app(load_config(path)))
    body = {"model": "scripted-plan", "messages": [PLAN_USER], "temperature": 0, "seed": 7, "max_tokens": 300,
            "top_p": 0.5}
    async with client.post("/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}", "X-Policy": "files"}) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["run"]["turns"] == 3
    calls = counting_upstream.chat_calls()
    assert len(calls) == 3
    for call in calls:
        sent = call["body"]
        assert (sent["temperature"], sent["seed"], sent["top_p"], sent["max_tokens"]) == (0, 7, 0.5, 300)
        assert {t["function"]["name"] for t in sent["tools"]} >= {"list_files", "read_file"}
