"""`upstreams[]`'s auth, headers, query, path, kind azure, tls, proxy and discover_models:
read as documented, every mistake one line naming the field (docs/config.md, docs/upstreams.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.settings import ConfigError, load_config
from gateway.config.upstreams import AZURE_API_VERSION, Auth, EnvValue, require_upstreams
from gateway.server.app import build_app
from tests.server.conftest import config_data, write_config
from tests.support.certs import make_pki
from tests.support.procs import ROOT, run_gateway

AZURE = {"name": "az", "kind": "azure", "base_url": "https://res.openai.azure.com", "api_key_env": "AZ_KEY"}


def load(tmp_path: Path, *upstreams: dict[str, Any]) -> Any:
    data = config_data(upstreams=[{"name": "scripted", "kind": "scripted"}, *upstreams])
    return load_config(write_config(tmp_path, data))


def test_kind_azure_is_a_preset_of_auth_query_and_paths(tmp_path: Path) -> None:
    az = load(tmp_path, AZURE, {**AZURE, "name": "az2", "api_version": "2025-03-01-preview",
                                "query": {"extra": "1"}, "path": {"responses": "/openai/v1/responses"}},
              {**AZURE, "name": "az3", "api": "responses", "api_version": "2025-04-01-preview"}).upstreams
    one, two = az["az"], az["az2"]
    assert (one.auth, one.api_key_env) == (Auth("header", "api-key"), "AZ_KEY")
    assert one.query == (("api-version", AZURE_API_VERSION),)
    assert one.paths.chat == "/openai/deployments/{deployment}/chat/completions"
    assert one.paths.embeddings == "/openai/deployments/{deployment}/embeddings"
    assert one.paths.models is None and not one.own_transport
    assert two.query == (("api-version", "2025-03-01-preview"), ("extra", "1"))
    assert two.paths.responses == "/openai/v1/responses" and two.paths.chat == one.paths.chat


def test_auth_kinds_headers_query_and_paths(tmp_path: Path) -> None:
    ups = load(tmp_path,
               {"name": "h", "base_url": "https://h.example/v1", "auth": {"kind": "header", "name": "X-Api-Key",
                                                                         "api_key_env": "H_KEY", "required": True},
                "headers": {"OpenAI-Organization": "org-1", "X-Secret": {"env": "SECRET_VAR", "required": True}},
                "query": {"tenant": "t1"}, "path": "/v2/{model}/chat"},
               {"name": "n", "base_url": "http://127.0.0.1:9/v1", "auth": {"kind": "none"},
                "headers": {"Authorization": {"env": "BASIC_AUTH"}}, "discover_models": True}).upstreams
    h, n = ups["h"], ups["n"]
    assert (h.auth, h.api_key_env) == (Auth("header", "X-Api-Key", required=True), "H_KEY")
    assert h.headers == (("OpenAI-Organization", "org-1"), ("X-Secret", EnvValue("SECRET_VAR", True)))
    assert "org-1" not in repr(h) and "SECRET_VAR" not in repr(h)  # config reprs never show header values
    assert h.query == (("tenant", "t1"),) and h.paths.chat == "/v2/{model}/chat"
    assert h.paths.embeddings == "/embeddings" and n.discover_models and n.auth.kind == "none"
    assert n.headers == (("Authorization", EnvValue("BASIC_AUTH")),)


def _upstream(**fields: Any) -> Any:
    return lambda d: d["upstreams"].append({"name": "u", "base_url": "https://u.example/v1", **fields})


ERRORS = [
    (_upstream(auth={"kind": "token"}), "upstreams[1].auth.kind", "bearer, header, none"),
    (_upstream(auth={"kind": "header"}), "upstreams[1].auth.name", "is required"),
    (_upstream(auth={"kind": "header", "name": "Content-Type"}), "upstreams[1].auth.name", "does not set itself"),
    (_upstream(auth={"kind": "none"}, api_key_env="K"), "upstreams[1].api_key_env", "sends no key"),
    (_upstream(auth={"api_key_env": "A"}, api_key_env="B"), "upstreams[1].auth.api_key_env", "given twice"),
    (_upstream(auth={"kind": "bearer", "name": "X"}), "upstreams[1].auth.name", "for auth kind header"),
    (_upstream(auth={"required": True}), "upstreams[1].auth.required", "needs api_key_env"),
    (_upstream(api_key_env="not a name"), "upstreams[1].api_key_env", "environment variable name"),
    (_upstream(headers={"Host": "x"}), "upstreams[1].headers.Host", "cannot be configured"),
    (_upstream(headers={"Bad Name": "x"}), "upstreams[1].headers.Bad Name", "not a valid header name"),
    (_upstream(headers={"X-A": "one\r\nX-B: two"}), "upstreams[1].headers.X-A", "no line breaks"),
    (_upstream(headers={"X-A": {"env": "A", "secret": 1}}), "upstreams[1].headers.X-A.secret", "unknown field"),
    (_upstream(headers={"X-A": {"required": True}}), "upstreams[1].headers.X-A.env", "is required"),
    (_upstream(api_key_env="K", headers={"authorization": "Bearer x"}), "upstreams[1].headers.authorization",
     "where auth sends the key"),
    (_upstream(headers={"X-A": "1", "x-a": "2"}), "upstreams[1].headers.x-a", "given twice"),
    (_upstream(headers=["X-A: 1"]), "upstreams[1].headers", "must be a mapping"),
    (_upstream(query={"api-version": 2024}), "upstreams[1].query.api-version", "quote it"),
    (_upstream(path="chat/completions"), "upstreams[1].path", "must start with /"),
    (_upstream(path="/x?a=1"), "upstreams[1].path", "no query"),
    (_upstream(path="/d/{name}/chat"), "upstreams[1].path", "got name"),
    (_upstream(path="/d/{model/chat"), "upstreams[1].path", "brace"),
    (_upstream(path={"models": "/{model}/models"}), "upstreams[1].path.models", "no placeholder"),
    (_upstream(path={"chat": None}), "upstreams[1].path.chat", "only models may be null"),
    (_upstream(path={"completions": "/c"}), "upstreams[1].path.completions", "unknown field"),
    (_upstream(api_version="2024-10-21"), "upstreams[1].api_version", "is for kind azure"),
    (_upstream(base_url="https://u.example/v1?x=1"), "upstreams[1].base_url", "no query"),
    (_upstream(base_url="https://u.example/my models"), "upstreams[1].base_url", "URL-encoded"),
    (_upstream(tls={"ca_file": "ca.pem"}, base_url="http://u.example/v1"), "upstreams[1].tls", "https://"),
    (_upstream(tls={"key_file": "k.pem"}), "upstreams[1].tls.key_file", "needs cert_file"),
    (_upstream(tls={"verify": False, "ca_file": "ca.pem"}), "upstreams[1].tls.verify", "one or the other"),
    (_upstream(tls={"cafile": "ca.pem"}), "upstreams[1].tls.cafile", "unknown field"),
    (_upstream(proxy="socks5://p:1080"), "upstreams[1].proxy", "http:// or https:// proxy"),
    (_upstream(proxy="http://p:1080/path"), "upstreams[1].proxy", "without a path"),
    (_upstream(proxy="http://p:99999"), "upstreams[1].proxy", "valid port"),
    (_upstream(discover_models="yes"), "upstreams[1].discover_models", "true or false"),
    (lambda d: d["upstreams"].append({**AZURE, "api_key_env": None}), "upstreams[1].api_key_env",
     "required for kind azure"),
    (lambda d: d["upstreams"].append({**AZURE, "base_url": "https://r.openai.azure.com/openai/"}),
     "upstreams[1].base_url", "without /openai"),
    (lambda d: d["upstreams"].append({**AZURE, "query": {"api-version": "x"}}), "upstreams[1].query",
     "give it there"),
    (lambda d: d["upstreams"].append({**AZURE, "discover_models": True}), "upstreams[1].discover_models",
     "not your deployments"),
    (lambda d: d["upstreams"].append({**AZURE, "api_version": None}) or d["upstreams"][-1].update(
        api_version=20241021), "upstreams[1].api_version", "quote it"),
    (lambda d: d["upstreams"][0].update(proxy="http://p:3128"), "upstreams[0].proxy", "needs a base_url"),
    (lambda d: d["upstreams"].append({**AZURE, "api": "responses"}), "upstreams[1].api_version",
     "needs api_version 2025-03-01-preview or later"),  # not the GA default, which Azure answers 400
    (lambda d: d["upstreams"].append({**AZURE, "api": "responses", "api_version": "2024-12-01-preview"}),
     "upstreams[1].api_version", "got '2024-12-01-preview'"),
]


@pytest.mark.parametrize(("change", "field", "problem"), ERRORS)
def test_errors_name_the_field(tmp_path: Path, change: Any, field: str, problem: str) -> None:
    data = config_data()
    change(data)
    path = write_config(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.path, str(info.value).startswith(f"{path}: {field}: ")) == (field, True), info.value
    assert problem in info.value.problem


def test_the_config_proxy_wins_over_the_environment_which_no_proxy_can_turn_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw@env-proxy.example:3128")
    monkeypatch.setenv("HTTP_PROXY", "http://plain-proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "internal.example,.corp.example")
    ups = load(tmp_path,
               {"name": "env", "base_url": "https://api.example/v1"},
               {"name": "plain", "base_url": "http://api.example/v1"},
               {"name": "bypassed", "base_url": "https://llm.corp.example/v1"},
               {"name": "bypassed_host", "base_url": "https://internal.example:8443/v1"},
               {"name": "configured", "base_url": "https://internal.example/v1", "proxy": "http://mine.example:8080"},
               {"name": "direct", "base_url": "https://api.example/v1", "proxy": False}).upstreams
    assert (ups["env"].proxy, ups["env"].proxy_from) == ("http://user:pw@env-proxy.example:3128", "HTTPS_PROXY")
    assert "pw" not in repr(ups["env"])  # a proxy URL may hold a password: never in a repr
    assert (ups["plain"].proxy, ups["plain"].proxy_from) == ("http://plain-proxy.example:3128", "HTTP_PROXY")
    assert ups["bypassed"].proxy is None and ups["bypassed_host"].proxy is None and ups["direct"].proxy is None
    assert (ups["configured"].proxy, ups["configured"].proxy_from) == ("http://mine.example:8080", "proxy")
    assert ups["scripted"].proxy is None  # this process's own mount is never proxied
    assert ups["env"].own_transport and not ups["direct"].own_transport


def test_an_environment_proxy_aiohttp_cannot_use_stops_serving_not_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "socks5://user:secret@p.example:1080")
    config = load(tmp_path, {"name": "hosted", "base_url": "https://api.example/v1"})  # gateway trace still reads it
    with pytest.raises(ConfigError) as info:
        require_upstreams(str(config.path), config.upstreams)
    assert info.value.path == "upstreams[1].proxy" and "HTTPS_PROXY" in info.value.problem
    assert "proxy: false" in info.value.problem and "secret" not in str(info.value)


def test_tls_files_are_checked_when_serving_naming_the_field(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    cases = [
        ({"ca_file": "missing-ca.pem"}, "tls.ca_file", "cannot read"),
        ({"ca_file": str(tmp_path / "junk.pem")}, "tls.ca_file", "holds no usable PEM certificate"),
        ({"ca_file": str(pki.ca), "cert_file": "missing.pem"}, "tls.cert_file", "cannot read"),
        ({"cert_file": str(pki.client_cert), "key_file": "missing.key"}, "tls.key_file", "cannot read"),
        ({"cert_file": str(pki.client_cert), "key_file": str(pki.stranger_key)}, "tls.cert_file",
         "as the client certificate and key"),
    ]
    for i, (tls, field, problem) in enumerate(cases):
        folder = tmp_path / f"c{i}"
        config = load(folder, {"name": "secure", "base_url": "https://127.0.0.1:9/v1", "tls": tls})
        with pytest.raises(ConfigError) as info:
            build_app(config)
        assert info.value.path == f"upstreams[1].{field}", info.value
        assert problem in info.value.problem
    good = load(tmp_path / "good", {"name": "secure", "base_url": "https://127.0.0.1:9/v1",
                                    "tls": {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert),
                                            "key_file": str(pki.client_key)}})
    require_upstreams(str(good.path), good.upstreams)
    assert good.upstreams["secure"].tls is not None and good.upstreams["secure"].tls.ca_file == pki.ca


def test_required_variables_stop_the_start_others_fail_the_call(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_TEST_UNSET_A", raising=False)
    lazy = load(tmp_path / "lazy", {"name": "h", "base_url": "https://h.example/v1", "api_key_env": "GATEWAY_TEST_UNSET_A",
                                    "headers": {"X-T": {"env": "GATEWAY_TEST_UNSET_A"}}})
    require_upstreams(str(lazy.path), lazy.upstreams)  # not required: each call fails instead (test_azure)
    for upstream, field in [
        ({"headers": {"X-T": {"env": "GATEWAY_TEST_UNSET_A", "required": True}}}, "upstreams[1].headers.X-T"),
        ({"api_key_env": "GATEWAY_TEST_UNSET_A", "auth": {"required": True}}, "upstreams[1].api_key_env"),
    ]:
        config = load(tmp_path / field, {"name": "h", "base_url": "https://h.example/v1", **upstream})
        with pytest.raises(ConfigError) as info:
            require_upstreams(str(config.path), config.upstreams)
        assert info.value.path == field and "GATEWAY_TEST_UNSET_A is not set" in info.value.problem


def test_gateway_serve_refuses_an_unreadable_ca_file_in_one_line(tmp_path: Path) -> None:
    data = config_data(upstreams=[{"name": "scripted", "kind": "scripted"},
                                  {"name": "secure", "base_url": "https://127.0.0.1:9/v1",
                                   "tls": {"ca_file": "./certs/ca.pem"}}])
    path = write_config(tmp_path, data)
    got = run_gateway(["serve", "--config", str(path)])
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip() == (f"gateway: config error: {path}: upstreams[1].tls.ca_file: cannot read "
                                  f"{tmp_path / 'certs' / 'ca.pem'}: no such file or directory")
    assert yaml.safe_load(path.read_text())  # nothing rewritten


def _yaml_blocks(text: str) -> list[Any]:
    return [yaml.safe_load(block.split("\n", 1)[1]) for block in text.split("```yaml")[1:]
            for block in [block.split("```", 1)[0]]]


def test_every_example_of_docs_upstreams_md_is_a_valid_config(tmp_path: Path) -> None:
    blocks = _yaml_blocks((ROOT / "docs" / "upstreams.md").read_text())
    assert len(blocks) >= 7
    for i, block in enumerate(blocks):
        data = config_data()
        data["upstreams"] += block["upstreams"]
        data["models"] += block["models"]
        config = load_config(write_config(tmp_path / str(i), data))
        for upstream in block["upstreams"]:
            assert upstream["name"] in config.upstreams
    azure = load_config(write_config(tmp_path / "az", {**config_data(), **{
        "upstreams": blocks[1]["upstreams"], "models": blocks[1]["models"]}})).upstreams["azure"]
    assert azure.kind == "azure" and azure.query == (("api-version", "2024-10-21"),)


def test_the_shipped_config_s_commented_upstreams_are_valid_uncommented(tmp_path: Path) -> None:
    text = (ROOT / "config.yaml").read_text()
    block = text.split("# --- upstream examples", 1)[1].split("# --- end of upstream examples", 1)[0]
    lines = [line.replace("  # ", "  ", 1) for line in block.splitlines()[1:]
             if line.startswith(("  # - ", "  #   "))]
    examples = yaml.safe_load("\n".join(lines))
    assert {u["name"] for u in examples} == {"azure", "openai_project", "vllm", "internal"}
    data = config_data()
    data["upstreams"] += examples
    config = load_config(write_config(tmp_path, data))
    assert config.upstreams["azure"].auth == Auth("header", "api-key")
    assert config.upstreams["vllm"].discover_models and config.upstreams["internal"].proxy is not None
