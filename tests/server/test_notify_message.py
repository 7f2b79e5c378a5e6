"""The pure parts of notifications: which lines notify whom, signatures, Slack text, retries,
and the `webhooks:` config's errors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config.fields import ConfigError
from gateway.config.settings import RetentionConfig, parse_config
from gateway.config.webhooks import WebhookConfig
from gateway.server.notify.message import (
    budget_notice,
    crossed,
    encode,
    notices_for,
    payload,
    read_record,
    retry_in,
    sign,
    slack_text,
    verify,
)
from gateway.server.app import build_app
from gateway.server.runs.retention import DAY_S, apply
from gateway.store.memory import MemoryStore
from gateway.store.outbox import Notice
from tests.support.procs import ROOT

SECRET = b"s3cret"


def hook(**kw: Any) -> WebhookConfig:
    base: dict[str, Any] = {"name": "h", "url": "https://hooks.example.com/x", "secret_env": "X", "secret": SECRET,
                            "events": frozenset({"approval_required", "approval_decided", "run_stopped",
                                                 "budget_threshold"})}
    return WebhookConfig(**{**base, **kw})


def test_a_signature_verifies_only_fresh_and_for_the_same_bytes() -> None:
    body = b'{"id":"n1"}'
    header = sign(SECRET, body, 1_000_000)
    assert header.startswith("t=1000000,v1=") and len(header.split("v1=")[1]) == 64
    assert verify(SECRET, header, body, 1_000_100)
    assert not verify(SECRET, header, body, 1_000_000 + 301)  # stale: a replay is refused
    assert not verify(SECRET, header, body + b" ", 1_000_000)
    assert not verify(b"other", header, body, 1_000_000)
    assert not verify(SECRET, header.replace("t=1000000", "t=1000001"), body, 1_000_000)
    assert not verify(SECRET, "garbage", body, 1_000_000)


def test_limit_requests_notify_as_approvals_of_kind_limit() -> None:
    lines = [{"runId": "demo/r9", "type": "limit_reached", "callId": "lim_1", "limit": "max_turns", "used": 2,
              "cap": 2, "grant": {"max_turns": 3}, "grants": 0, "asked": True, "detail": "d", "ts": 5.0},
             {"runId": "demo/r9", "type": "limit_reached", "callId": None, "limit": "max_turns", "asked": False},
             {"runId": "demo/r9", "type": "limit_granted", "callId": "lim_1", "limit": "max_turns",
              "grant": {"max_turns": 3}, "before": {"max_turns": 2}, "after": {"max_turns": 5}, "by": "ops",
              "reason": ""},
             {"runId": "demo/r9", "type": "limit_rejected", "callId": "lim_2", "limit": "max_turns",
              "reason": "<!channel> no", "by": "ops", "expired": False},
             {"runId": "demo/r9", "type": "approval_required", "toolName": "delete_file", "callId": "c2"}]
    records = [read_record(n.body) for n in notices_for([hook()], "demo/r9", lines, 1.0)]
    assert [(r["event"], r.get("kind")) for r in records] == [  # a limit reached with no grant left asks nobody
        ("approval_required", "limit"), ("approval_decided", "limit"), ("approval_decided", "limit"),
        ("approval_required", "tool_call")]
    bodies = [payload("n", r, None, "https://gw.example") for r in records]
    assert [b["kind"] for b in bodies] == ["limit", "limit", "limit", "tool_call"]
    old = dict(records[3])
    del old["kind"]  # a record written before kinds existed: a call
    assert payload("n", old, None, None)["kind"] == "tool_call"  # type: ignore[arg-type]
    assert "kind" not in payload("n", {**records[0], "event": "run_stopped"}, None, None)  # type: ignore[typeddict-item]
    texts = [slack_text(b) for b in bodies[:3]]
    assert texts[0].startswith(":raising_hand: More needed: run `r9` of team *demo* reached its `max_turns` (2 of 2)")
    assert "asks for max_turns +3" in texts[0]
    assert "was granted more of its `max_turns` by *ops*" in texts[1]
    assert "was refused more of its `max_turns` by *ops*: &lt;!channel&gt; no" in texts[2]


def test_lines_notify_the_webhooks_that_want_them() -> None:
    lines = [{"runId": "demo/r1", "type": "turn"},
             {"runId": "demo/r1", "type": "approval_required", "toolName": "delete_file", "callId": "c2", "ts": 5.0},
             {"runId": "demo/r1", "type": "run_stopped", "status": "interrupted", "reason": "approval"}]
    every = hook()
    only_budget_stops = hook(name="b", reasons=frozenset({"team_budget"}))
    other_team = hook(name="o", teams=frozenset({"ops"}))
    notices = notices_for([every, only_budget_stops, other_team], "demo/r1", lines, 9.0)
    records = [(read_record(n.body)["webhook"], read_record(n.body)["event"]) for n in notices]
    assert records == [("h", "approval_required"), ("b", "approval_required"), ("h", "run_stopped")]
    first = read_record(notices[0].body)
    assert first["team"] == "demo" and first["run_id"] == "demo/r1" and first["at"] == 5.0
    assert first["detail"] == {"toolName": "delete_file", "callId": "c2", "ts": 5.0}
    assert len({n.id for n in notices}) == 3


def test_budget_thresholds_and_their_one_id_per_period() -> None:
    assert crossed(10.0, 7.99) == [] and crossed(10.0, 8.0) == [80] and crossed(10.0, 12.0) == [80, 100]
    assert crossed(None, 5.0) == [] and crossed(0.0, 1.0) == []
    a = budget_notice(hook(), "demo", "2026-12", 80, 10.0, 8.2, 1.0)
    b = budget_notice(hook(), "demo", "2026-12", 80, 10.0, 9.9, 2.0)
    assert a.id == b.id == "budget_threshold:demo:2026-12:80:h" and a.period == "2026-12"


def test_the_body_links_the_console_and_slack_text_is_escaped() -> None:
    lines = [{"runId": "demo/r1", "type": "approval_required", "toolName": "delete_file",
              "args": '{"path": "<!channel> <https://evil.example|click> & \\"><img onerror=x>"}'}]
    [notice] = notices_for([hook(format="slack")], "demo/r1", lines, 1.0)
    body = payload(notice.id, read_record(notice.body), None, "https://gw.example.com")
    assert body["link"] == "https://gw.example.com/console/runs/demo/r1" and body["run_id"] == "r1"
    text = slack_text(body)
    assert "<!channel>" not in text and "<https://evil" not in text and "<img" not in text
    assert "&lt;!channel&gt;" in text and "&amp;" in text
    assert text.endswith("<https://gw.example.com/console/runs/demo/r1|open in the console>")
    assert orjson.loads(encode(body, "slack")) == {"text": text}
    assert orjson.loads(encode(body, "json"))["event"] == "approval_required"
    assert payload("n", read_record(notice.body), None, None)["link"] is None


def test_retries_back_off_exponentially_up_to_a_cap() -> None:
    assert [retry_in(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert retry_in(30) == 300.0
    assert [retry_in(n, 0.05) for n in (1, 2, 3)] == [0.05, 0.1, 0.2]  # webhooks[].retry_base_s


def _config(tmp_path: Path, webhooks: Any, **server: Any) -> None:
    data = {"server": {"port": 0, **server}, "upstreams": [{"name": "s", "kind": "scripted"}],
            "models": [{"match": "*", "upstream": "s"}],
            "teams": [{"name": "demo", "keys": ["k"], "policies": ["passthrough"]}], "webhooks": webhooks}
    parse_config(data, tmp_path / "config.yaml")


@pytest.mark.parametrize(("webhook", "field", "words"), [
    ({"events": ["approval_required"], "secret_env": "GW_HOOK"}, "webhooks[0].url", "is required"),
    ({"url": "ftp://x.example", "events": ["run_stopped"], "secret_env": "GW_HOOK"}, "webhooks[0].url", "http://"),
    ({"url": "https://", "events": ["run_stopped"], "secret_env": "GW_HOOK"}, "webhooks[0].url", "with a host"),
    ({"url": "https://x.example", "events": ["run_finished"], "secret_env": "GW_HOOK"}, "webhooks[0].events[0]",
     "unknown event 'run_finished'"),
    ({"url": "https://x.example", "events": [], "secret_env": "GW_HOOK"}, "webhooks[0].events", "at least one"),
    ({"url": "https://x.example", "events": ["run_stopped"], "secret_env": "GW_HOOK", "teams": ["nobody"]},
     "webhooks[0].teams[0]", "unknown team 'nobody'"),
    ({"url": "https://x.example", "events": ["approval_required"], "secret_env": "GW_HOOK",
      "reasons": ["completed"]}, "webhooks[0].reasons", "does not list run_stopped"),
    ({"url": "https://x.example", "events": ["run_stopped"], "secret_env": "GW_HOOK", "reasons": ["done"]},
     "webhooks[0].reasons[0]", "unknown run_stopped reason 'done'"),
    ({"url": "https://x.example", "events": ["run_stopped"], "secret_env": "GW_HOOK", "format": "xml"},
     "webhooks[0].format", "json, slack"),
    ({"url": "https://x.example", "events": ["run_stopped"], "secret_env": "GW_HOOK", "retry_base_s": 0},
     "webhooks[0].retry_base_s", "> 0"),
])
def test_webhook_config_errors_name_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              webhook: dict[str, Any], field: str, words: str) -> None:
    monkeypatch.setenv("GW_HOOK", "secret")
    monkeypatch.delenv("GW_NOT_SET", raising=False)
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, [webhook])
    assert err.value.path == field and words in err.value.problem


def test_serving_needs_every_secret_and_reading_the_config_does_not(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GW_NOT_SET", raising=False)
    data = {"server": {"port": 0}, "store": {"kind": "memory"}, "policies_dir": str(ROOT / "policies"),
            "upstreams": [{"name": "s", "kind": "scripted"}], "models": [{"match": "*", "upstream": "s"}],
            "teams": [{"name": "demo", "keys": ["k"], "policies": ["passthrough"]}],
            "webhooks": [{"url": "https://x.example", "events": ["run_stopped"], "secret_env": "GW_NOT_SET"}]}
    config = parse_config(data, tmp_path / "config.yaml")  # gateway prune and trace send nothing
    with pytest.raises(ConfigError) as err:
        build_app(config)
    assert err.value.path == "webhooks[0].secret_env"
    assert "GW_NOT_SET is not set" in err.value.problem


def test_two_webhooks_on_one_host_need_names_and_public_url_is_checked(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_HOOK", "secret")
    one = {"url": "https://x.example/a", "events": ["run_stopped"], "secret_env": "GW_HOOK"}
    _config(tmp_path, [one, {**one, "url": "https://x.example/b"}])  # named x.example and x.example#1
    with pytest.raises(ConfigError, match="defined twice"):
        _config(tmp_path, [{**one, "name": "a"}, {**one, "name": "a"}])
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, [], public_url="gateway.example.com")
    assert err.value.path == "server.public_url"


async def test_retention_prunes_sent_notices_after_outbox_days() -> None:
    store = MemoryStore()
    await store.enqueue_notices([Notice("n1", b"{}")])
    [claim] = await store.claim_notices("a", 1, 30.0)
    await store.notice_sent(claim.id)
    keep = RetentionConfig(outbox_days=None)
    assert (await apply(store, keep, now=time.time() + 30 * DAY_S)).notices == 0
    assert (await apply(store, RetentionConfig(outbox_days=7), now=time.time() + 6 * DAY_S)).notices == 0
    pruned = await apply(store, RetentionConfig(outbox_days=7), now=time.time() + 8 * DAY_S)
    assert pruned.notices == 1 and "1 sent or abandoned notice(s)" in str(pruned)
