"""The console's routes over plain HTTP on a real gateway process: sign-in, the session
cookie, CSRF and cross-site refusals, security headers, and that a team sees through the
console exactly what the runs API lets it see."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from gateway.server.notify.message import console_link
from tests.server.served import DEMO, OPS, OTHER, Served, chat_body, request, served_fixture

ORIGIN_OK = "http://127.0.0.1"


served = served_fixture("console_http")


async def sign_in(served: Served, key: str) -> tuple[aiohttp.ClientSession, str]:
    """A client with the console session of `key` (its cookie jar) and its CSRF token."""
    jar = aiohttp.CookieJar(unsafe=True)  # cookies for an IP address host
    client = aiohttp.ClientSession(cookie_jar=jar)
    async with client.post(f"{served.url}/console/session", json={"key": key}) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        cookie = resp.cookies["gateway_console"]
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/console"
        assert not cookie["expires"] and not cookie["max-age"]  # a browser-session cookie
    return client, body["csrf_token"]


async def status_of(client: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with client.request(method, url, **kw) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw and resp.content_type == "application/json" else raw


async def test_sign_in_refuses_bad_keys_forms_and_other_sites(served: Served) -> None:
    url = f"{served.url}/console/session"
    async with aiohttp.ClientSession() as client:
        status, body = await status_of(client, "POST", url, json={"key": "sk-nobody"})
        assert status == 401 and "no team has this key" in body["error"]["message"]
        status, body = await status_of(client, "POST", url, data="key=sk-ops",
                                       headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 400 and body["error"]["code"] == "invalid_content_type"
        status, body = await status_of(client, "POST", url, json={"key": OPS},
                                       headers={"Origin": "http://evil.example"})
        assert status == 403 and body["error"]["code"] == "cross_site_request"
        status, body = await status_of(client, "POST", url, json={"key": 7})
        assert status == 400 and body["error"]["param"] == "key"
        status, body = await status_of(client, "GET", f"{served.url}/console/api/runs")
        assert status == 401  # no session


async def test_pages_carry_a_strict_policy_and_no_data(served: Served, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{served.url}/console/") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        page = await resp.text()
        csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "<script>" not in page and "style=" not in page and "on" + "click" not in page  # nothing inline
    async with session.get(f"{served.url}/console/static/console.js") as resp:
        assert resp.status == 200 and resp.content_type == "text/javascript"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        script = await resp.text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script
    async with session.get(f"{served.url}/console/static/..%2Fsession.py") as resp:
        assert resp.status == 404
    for link, page in ((console_link(served.url, "demo", "demo/a b"), "/console/#/run/demo/a%20b"),
                       (console_link(served.url, "demo", None), "/console/#/spend")):
        assert link is not None
        async with session.get(link, allow_redirects=False) as resp:  # the links webhook notices carry
            assert resp.status == 302 and resp.headers["Location"] == page
    async with session.get(f"{served.url}/openapi.json") as resp:
        paths = (await resp.json())["paths"]
    assert not [p for p in paths if p.startswith("/console")]  # the page's routes, not the API's


async def test_state_changes_need_the_csrf_token(served: Served, session: aiohttp.ClientSession) -> None:
    status, headers, _ = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                       body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    run_id = headers["X-Run-Id"]
    client, token = await sign_in(served, OPS)
    async with client:
        url = f"{served.url}/console/api/runs/{run_id}/approvals?team=demo"
        decision = {"call_id": "c2", "decision": "reject", "reason": "no"}
        status, body = await status_of(client, "POST", url, json=decision)
        assert status == 403 and body["error"]["code"] == "csrf_token_invalid"
        status, body = await status_of(client, "POST", url, json=decision,
                                       headers={"X-CSRF-Token": token, "Sec-Fetch-Site": "cross-site"})
        assert status == 403 and body["error"]["code"] == "cross_site_request"
        status, body = await status_of(client, "POST", url, json=decision, headers={"X-CSRF-Token": token})
        assert status == 200 and body["decision"]["by"] == "ops"
        status, body = await status_of(client, "DELETE", f"{served.url}/console/session")
        assert status == 403  # signing out is a change too
        status, body = await status_of(client, "DELETE", f"{served.url}/console/session",
                                       headers={"X-CSRF-Token": token})
        assert status == 200
        status, _ = await status_of(client, "GET", f"{served.url}/console/session")
        assert status == 401


async def test_a_team_sees_through_the_console_what_the_api_lets_it_see(
        served: Served, session: aiohttp.ClientSession) -> None:
    status, headers, _ = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                       body=chat_body("scripted-destructive"), headers={"X-Policy": "files"})
    run_id = headers["X-Run-Id"]
    client, _ = await sign_in(served, OPS)
    async with client:
        _, body = await status_of(client, "GET", f"{served.url}/console/api/inbox")
        item = next(i for i in body["data"] if i["run_id"] == run_id)
    assert item["tool"] == "delete_file" and item["args"] == {"path": "access.log"}
    assert item["rule"] == 'rule 2: delete_file with path "*.log" -> ask'
    assert item["team"] == "demo" and item["policy"] == "files" and item["turns"] == 2
    assert item["last_user"] == "Which file mentions a timeout?" and item["assistant"] is None
    assert item["expires_at"] == pytest.approx(item["asked_at"] + 86400)
    assert item["run_resumes_on_decision"] is False
    for key, sees, decides in ((OPS, True, True), (OTHER, False, False), (DEMO, True, False)):
        client, token = await sign_in(served, key)
        async with client:
            status, body = await status_of(client, "GET", f"{served.url}/console/api/runs/{run_id}?team=demo")
            api_status, _, _ = await request(session, "GET", f"{served.url}/v1/runs/{run_id}?team=demo", key=key)
            assert status == api_status == (200 if sees else 404), (key, body)
            status, body = await status_of(client, "GET", f"{served.url}/console/api/runs/{run_id}/trace?team=demo")
            assert status == (200 if sees else 404)
            if sees:
                assert body["lines"][0].startswith(f"run {run_id}: ") and body["turns"][1]["turn"] == 2
            async with client.get(f"{served.url}/console/api/runs/{run_id}/events?team=demo&follow=1") as resp:
                assert resp.status == (200 if sees else 404)
                if sees:  # the API's SSE follower, through the console's session
                    text = await resp.text()
                    assert "event: end" in text and '"type":"approval_required"' in text
            status, body = await status_of(client, "GET", f"{served.url}/console/api/inbox")
            keys = [i["run_id"] for i in body["data"]]
            assert (run_id in keys) == decides, (key, keys)
            status, body = await status_of(client, "GET", f"{served.url}/console/api/runs?status=interrupted")
            api = await request(session, "GET", f"{served.url}/v1/runs?status=interrupted", key=key)
            assert [r["id"] for r in body["data"]] == [r["id"] for r in api[2]["data"]]
            status, body = await status_of(client, "GET", f"{served.url}/console/api/spend")
            assert [r["team"] for r in body["data"]] == [{DEMO: "demo", OPS: "ops", OTHER: "other"}[key]]
            status, body = await status_of(client, "POST", f"{served.url}/console/api/runs/{run_id}/cancel?team=demo",
                                           json={}, headers={"X-CSRF-Token": token})
            if key == OPS:
                assert status == 403 and body["error"]["code"] == "not_run_owner"
            elif key == OTHER:
                assert status == 404
            else:
                assert status == 200 and body["cancel"] == "done"  # the owner steers its run
