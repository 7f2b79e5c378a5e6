"""/metrics protected by the config, against real gateway processes: a bearer token read
from the environment, a separate listen address, both, and the config errors naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from gateway.config.settings import ConfigError, load_config
from tests.server.conftest import config_data
from tests.server.conftest import write_config as write_unit_config
from tests.server.served import DEMO, chat_body, request, write_config
from tests.support import rawhttp
from tests.support.procs import Proc, free_port, start_gateway

TOKEN_ENV = "GATEWAY_TEST_METRICS_TOKEN"
TOKEN = "metrics-secret-7f3a"


def start(folder: Path, metrics: dict[str, Any]) -> Proc:
    """A gateway on served.py's config plus `metrics: ...`, with the token in its environment."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    path = write_config(folder, port)
    config = yaml.safe_load(path.read_text())
    config["metrics"] = metrics
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return start_gateway(["serve", "--config", str(path)], "/healthz", port, folder / "gateway.log",
                         env={TOKEN_ENV: TOKEN})


@pytest.fixture(scope="module")
def with_token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start(tmp_path_factory.mktemp("token"), {"token_env": TOKEN_ENV})
    yield proc
    proc.stop()


async def scrape(session: aiohttp.ClientSession, url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with session.get(f"{url}/metrics", headers=headers) as resp:
        return resp.status, await resp.text()


async def test_a_token_guards_metrics(with_token: Proc, session: aiohttp.ClientSession) -> None:
    status, _, body = await request(session, "POST", f"{with_token.url}/v1/chat/completions",
                                    body=chat_body("scripted-plan"))
    assert status == 200, body
    for token in (None, "wrong", DEMO):  # a team key is not the metrics token
        status, _, body = await request(session, "GET", f"{with_token.url}/metrics", key=token or "",
                                        headers={} if token else {"Authorization": ""})
        assert status == 401 and set(body["error"]) == {"message", "type", "code", "param"}, body
        assert body["error"]["type"] == "authentication_error" and TOKEN_ENV in body["error"]["message"]
        assert TOKEN not in body["error"]["message"]
    status, text = await scrape(session, with_token.url, TOKEN)
    assert status == 200 and 'gateway_team_spend_usd{team="demo"}' in text
    assert 'route="/v1/chat/completions"' in text


async def test_a_separate_listener_serves_metrics_and_the_main_address_does_not(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    metrics_port = free_port()
    proc = start(tmp_path / "listen", {"listen": f"127.0.0.1:{metrics_port}"})
    separate = f"http://127.0.0.1:{metrics_port}"
    try:
        status, _, body = await request(session, "POST", f"{proc.url}/v1/chat/completions",
                                        body=chat_body("scripted-plan"))
        assert status == 200, body
        status, _, body = await request(session, "GET", f"{proc.url}/metrics")
        assert status == 404 and body["error"]["code"] == "route_not_found", body
        status, text = await scrape(session, separate)
        assert status == 200 and 'route="/v1/chat/completions"' in text  # the main address's traffic
        status, _, body = await request(session, "GET", f"{separate}/v1/models")  # only /metrics there
        assert status == 404 and body["error"]["code"] == "route_not_found", body
    finally:
        proc.stop()


async def test_token_and_listener_together(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    metrics_port = free_port()
    proc = start(tmp_path / "both", {"listen": f"127.0.0.1:{metrics_port}", "token_env": TOKEN_ENV})
    separate = f"http://127.0.0.1:{metrics_port}"
    try:
        status, _, body = await request(session, "GET", f"{separate}/metrics", key="wrong")
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        answer = rawhttp.send(separate, "GET", "/metrics", [(b"Authorization", b"Bearer \xff" + TOKEN.encode())])
        assert answer.status == 401 and orjson.loads(answer.body)["error"]["code"] == "invalid_api_key", answer
        assert (await scrape(session, separate, TOKEN))[0] == 200
        assert (await scrape(session, proc.url, TOKEN))[0] == 404
        assert "Traceback" not in proc.output()
    finally:
        proc.stop()


@pytest.mark.parametrize(("metrics", "field", "problem"), [
    ({"token_env": "GATEWAY_TEST_UNSET_VAR"}, "metrics.token_env", "GATEWAY_TEST_UNSET_VAR is not set"),
    ({"token_env": ""}, "metrics.token_env", "non-empty string"),
    ({"listen": "9464"}, "metrics.listen", "HOST:PORT"),
    ({"listen": "127.0.0.1:99999"}, "metrics.listen", "HOST:PORT"),
    ({"listen": "127.0.0.1:8080"}, "metrics.listen", "the gateway's own address"),
    ({"token": "inline"}, "metrics.token", "unknown field"),
    ("open", "metrics", "must be a mapping"),
])
def test_config_errors_name_the_field(tmp_path: Path, metrics: Any, field: str, problem: str) -> None:
    data = config_data(server={"port": 8080})
    data["metrics"] = metrics
    with pytest.raises(ConfigError) as caught:
        load_config(write_unit_config(tmp_path, data))
    assert caught.value.path == field and problem in caught.value.problem, str(caught.value)
