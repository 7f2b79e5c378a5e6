"""The web console in a real headless Chromium against a real gateway process.

The approver team (ops) signs in, sees a pending `delete_file` call arrive while the page
is open, approves it, and the run (policy `files_auto`: on_decision resume) completes with
no resume call; another is rejected with a reason, and the transcript holds the honest
answer. Hostile tool arguments render as text; a cross-site POST is refused. Set
`CONSOLE_SCREENSHOTS=docs/img` to write the README's screenshots.

One gateway (with an extra upstream whose model writes hostile tool calls), one Chromium
and the event loop they run on serve the module's tests; each test opens its own pages and
uses its own run ids.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from playwright.async_api import Browser, Page, expect

from tests.server.served import ASK_GRANT_TURNS, DEMO, OPS, Served, chat_body, get_run, poll, request, write_config
from tests.server.test_admission import serving
from tests.support.browser import chromium
from tests.support.procs import free_port, start_gateway

HOSTILE_PATH = '<script>window.__xss = 1</script>"><img src=x onerror="window.__xss = 2">.log'
UI_TIMEOUT_MS = 20_000  # a loaded 2-core machine: seconds of margin

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hostile_upstream() -> AsyncIterator[str]:
    async with serving(_hostile) as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory, hostile_upstream: str) -> AsyncIterator[Served]:
    """The served.py gateway, plus model `hostile` on the hostile upstream."""
    folder = tmp_path_factory.mktemp("console") / "gw"
    folder.mkdir()
    port = free_port()
    config_path = write_config(folder, port)
    config = yaml.safe_load(config_path.read_text())
    config["upstreams"].append({"name": "hostile", "base_url": hostile_upstream})
    config["models"].append({"match": "hostile", "upstream": "hostile", "price_in": 1.0, "price_out": 1.0})
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = await asyncio.to_thread(start_gateway, ["serve", "--config", str(config_path)], "/healthz", port,
                                   folder / "gateway-1.log")
    yield Served(folder, port, proc)
    await asyncio.to_thread(proc.stop)  # the loop keeps serving the hostile upstream meanwhile


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chromium_browser() -> AsyncIterator[Browser]:
    async with chromium() as b:
        yield b


@pytest_asyncio.fixture(loop_scope="module")
async def browser(chromium_browser: Browser) -> AsyncIterator[Browser]:
    """The module's Chromium; the pages (and their sessions) a test opened are closed after it."""
    yield chromium_browser
    for context in chromium_browser.contexts:
        await context.close()


@pytest_asyncio.fixture(loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def screenshot_dir() -> Path | None:
    where = os.environ.get("CONSOLE_SCREENSHOTS")
    return Path(where) if where else None


async def sign_in(browser: Browser, url: str, key: str) -> Page:
    page = await browser.new_page(viewport={"width": 1200, "height": 900})
    page.set_default_timeout(UI_TIMEOUT_MS)
    await page.goto(f"{url}/console/")
    await page.fill("#key", key)
    await page.click("#signin button[type=submit]")
    await expect(page.locator("#inbox-live")).to_contain_text("Live")
    return page


async def start_destructive(session: aiohttp.ClientSession, served: Served, run_id: str,
                            policy: str = "files_auto") -> None:
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                    body=chat_body("scripted-destructive"),
                                    headers={"X-Policy": policy, "X-Run-Id": run_id})
    assert status == 200 and body["run"]["status"] == "interrupted", body


async def completed(session: aiohttp.ClientSession, served: Served, run_id: str) -> dict[str, Any]:
    """The run once it completed."""
    async def check() -> dict[str, Any] | None:
        run = await get_run(session, served.url, run_id)
        return run if run["status"] == "completed" else None

    found: dict[str, Any] = await poll(check, timeout=UI_TIMEOUT_MS / 1000)
    return found


async def test_an_approver_decides_in_the_console_and_runs_go_on_by_themselves(
        served: Served, session: aiohttp.ClientSession, browser: Browser) -> None:
    page = await sign_in(browser, served.url, OPS)
    await expect(page.locator("#who")).to_contain_text("team ops")
    # the call arrives while the page is open
    await start_destructive(session, served, "console-approve")
    card = page.locator("#pending-list article.pending", has_text="run console-approve")
    await expect(card).to_be_visible()
    await expect(card.locator(".tool")).to_have_text("delete_file")
    await expect(card.locator("pre.args")).to_have_text('{\n  "path": "access.log"\n}')
    await expect(card.locator(".rule")).to_have_text('rule 2: delete_file with path "*.log" -> ask')
    await expect(card.locator(".msg.user")).to_have_text("Which file mentions a timeout?")
    await expect(card.locator(".meta")).to_contain_text("team demo · policy files_auto · model scripted-destructive")
    await expect(card.locator(".expiry")).to_contain_text("expires in 23h")
    shots = screenshot_dir()
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(shots / "console-inbox.png"), full_page=True)

    await card.locator("button.approve").click()
    decided = page.locator("#decided-list article", has_text="run console-approve")
    await expect(decided.locator(".verdict")).to_have_text("approved by ops")

    run = await completed(session, served, "console-approve")  # nobody calls resume: the gateway does
    assert run["transcript"][-1]["content"] == "Deleted access.log to free space."
    assert served.deleted("console-approve") == ["access.log"]

    # the run page: transcript, cost per turn, the trace timeline, the stop reason
    await page.goto(f"{served.url}/console/#/run/demo/console-approve")
    await expect(page.locator("h1 .status")).to_have_text("completed")
    await expect(page.locator("#transcript .msg.assistant").last).to_contain_text("Deleted access.log to free space.")
    await expect(page.locator("#turns tbody tr")).to_have_count(3)
    timeline = page.locator("#timeline")
    await expect(timeline).to_contain_text("approval needed: delete_file")
    await expect(timeline).to_contain_text("decision=approve")
    await expect(timeline).to_contain_text("run_resumed")
    await expect(timeline).to_contain_text("stopped: completed (completed)")
    await expect(page.locator("#no-steer")).to_contain_text("belong to team demo")  # an approver does not steer
    owner = await sign_in(browser, served.url, DEMO)
    await owner.goto(f"{served.url}/console/#/run/demo/console-approve")
    await expect(owner.locator("#timeline")).to_contain_text("stopped: completed (completed)")
    await expect(owner.locator("#resume")).to_be_enabled()
    if shots is not None:
        await owner.screenshot(path=str(shots / "console-run.png"), full_page=True)
    await owner.close()

    # reject another with a reason: the model reads it and says so
    await page.goto(f"{served.url}/console/#/inbox")
    await expect(page.locator("#inbox-live")).to_contain_text("Live")
    await start_destructive(session, served, "console-reject")
    card = page.locator("#pending-list article.pending", has_text="run console-reject")
    await card.locator("input.reason").fill("access.log is evidence for the incident review")
    await card.locator("button.reject").click()
    decided = page.locator("#decided-list article", has_text="run console-reject")
    await expect(decided.locator(".verdict")).to_have_text("rejected by ops")
    await page.goto(f"{served.url}/console/#/run/demo/console-reject")
    await expect(page.locator("h1 .status")).to_have_text("completed")
    transcript = page.locator("#transcript")
    await expect(transcript.locator(".msg.tool").last).to_contain_text(
        "A person declined the call delete_file")
    await expect(transcript.locator(".msg.tool").last).to_contain_text(
        "The reviewer said: access.log is evidence for the incident review")
    await expect(transcript.locator(".msg.assistant").last.locator(".content")).to_have_text(
        "I did not delete anything: you declined the deletion.")
    assert served.deleted("console-reject") == []


async def test_a_decision_taken_elsewhere_shows_who_took_it(
        served: Served, session: aiohttp.ClientSession, browser: Browser) -> None:
    page = await sign_in(browser, served.url, OPS)
    await start_destructive(session, served, "decided-by-api")
    card = page.locator("#pending-list article.pending", has_text="run decided-by-api")
    await expect(card).to_be_visible()
    status, _, body = await request(session, "POST", f"{served.url}/v1/runs/decided-by-api/approvals", key=OPS,
                                    body={"call_id": "c2", "decision": "reject", "reason": "not today"})
    assert status == 200, body
    decided = page.locator("#decided-list article", has_text="run decided-by-api")
    await expect(decided.locator(".verdict")).to_have_text("rejected by ops")
    await expect(decided).to_contain_text("not today")
    await expect(decided.locator("button.approve")).to_be_disabled()


async def test_an_approver_grants_a_run_more_turns_in_the_console_and_it_goes_on(
        served: Served, session: aiohttp.ClientSession, browser: Browser) -> None:
    page = await sign_in(browser, served.url, OPS)
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                    body=chat_body("scripted-plan"),
                                    headers={"X-Policy": "files_ask", "X-Run-Id": "console-grant"})
    assert status == 200 and body["run"]["reason"] == "limit", body  # paused at its cap of 2 turns
    card = page.locator("#pending-list article.pending.limit", has_text="run console-grant")
    await expect(card).to_be_visible()
    await expect(card.locator(".tool")).to_have_text("limit max_turns")
    await expect(card.locator(".used")).to_have_text("2 of 2 turns used")
    await expect(card.locator(".meta")).to_contain_text("2 turns · $")
    await expect(card.locator(".msg.assistant")).to_have_text('read_file({"path":"errors.log"})')
    grant = card.locator("input.grant[data-limit=max_turns]")
    await expect(grant).to_have_value(str(ASK_GRANT_TURNS))
    await grant.fill("1")  # a smaller grant than the policy proposes: the run needs one more turn
    await card.locator("button.approve").click()
    decided = page.locator("#decided-list article", has_text="run console-grant")
    await expect(decided.locator(".verdict")).to_have_text("granted by ops")

    run = await completed(session, served, "console-grant")  # nobody calls resume: the gateway does
    assert run["turns"] == 3 and run["limits"]["max_turns"] == 3
    assert [(g["by"], g["grant"]) for g in run["grants"]] == [("ops", {"max_turns": 1})]


async def test_a_decision_without_a_reason_reads_plainly_and_the_run_says_it_waits_for_its_resume(
        served: Served, session: aiohttp.ClientSession, browser: Browser) -> None:
    page = await sign_in(browser, served.url, OPS)
    await start_destructive(session, served, "no-reason", policy="files")  # on_decision: wait
    card = page.locator("#pending-list article.pending", has_text="run no-reason")
    await card.locator("button.approve").click()
    decided = page.locator("#decided-list article", has_text="run no-reason")
    await expect(decided.locator(".outcome")).to_have_text("approved by ops")  # before: "approved by opsnull"
    await page.goto(f"{served.url}/console/#/run/demo/no-reason")
    await expect(page.locator("h1 .status")).to_have_text("interrupted")
    await expect(page.locator("#waiting")).to_have_text("Approved: delete_file; waits to be resumed by its team.")


async def test_the_owner_sees_its_runs_but_no_inbox_it_may_not_decide(
        served: Served, session: aiohttp.ClientSession, browser: Browser) -> None:
    await start_destructive(session, served, "owner-view")
    page = await sign_in(browser, served.url, DEMO)  # files names ops as its approvers
    await expect(page.locator("#pending-empty")).to_be_visible()
    await page.goto(f"{served.url}/console/#/runs?status=interrupted&policy=files_auto")
    await expect(page.locator("#runs tbody")).to_contain_text("owner-view")
    await page.goto(f"{served.url}/console/#/run/demo/owner-view")
    await expect(page.locator("#run-facts")).to_contain_text("interrupted")
    await page.click("#cancel")
    await expect(page.locator("h1 .status")).to_have_text("interrupted")
    await expect(page.locator("#timeline")).to_contain_text("stopped: interrupted (cancelled)")
    await expect(page.locator("#cancel")).to_be_disabled()
    assert (await get_run(session, served.url, "owner-view"))["reason"] == "cancelled"
    await page.goto(f"{served.url}/console/#/spend")
    await expect(page.locator("#spend tbody tr")).to_have_count(1)  # its own team only: not an admin
    await expect(page.locator("#spend tbody tr")).to_contain_text("demo")


def _hostile_reply(body: dict[str, Any]) -> dict[str, Any]:
    if body["messages"][-1]["role"] == "tool":
        message: dict[str, Any] = {"role": "assistant", "content": "ok"}
        finish = "stop"
    else:
        args = orjson.dumps({"path": HOSTILE_PATH}).decode()
        message = {"role": "assistant", "content": '<img src=x onerror="window.__xss = 3">I will delete it.',
                   "tool_calls": [{"id": "h1", "type": "function",
                                   "function": {"name": "delete_file", "arguments": args}}]}
        finish = "tool_calls"
    return {"id": "chatcmpl-h", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


async def _hostile(request: web.Request) -> web.Response:
    return web.json_response(_hostile_reply(await request.json()))


async def test_hostile_arguments_render_as_text_and_cross_site_posts_are_refused(
        served: Served, session: aiohttp.ClientSession, browser: Browser) -> None:
    await _check_hostile(served.url, session, browser)


async def _check_hostile(url: str, session: aiohttp.ClientSession, browser: Browser) -> None:
    status, _, body = await request(session, "POST", f"{url}/v1/chat/completions", body=chat_body("hostile"),
                                    headers={"X-Policy": "files", "X-Run-Id": "hostile"})
    assert status == 200 and body["run"]["interruption"]["tool_name"] == "delete_file", body
    page = await sign_in(browser, url, OPS)
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    card = page.locator("#pending-list article.pending", has_text="run hostile")
    await expect(card.locator("pre.args")).to_have_text(orjson.dumps({"path": HOSTILE_PATH},
                                                                      option=orjson.OPT_INDENT_2).decode())
    await expect(card.locator(".msg.assistant")).to_have_text('<img src=x onerror="window.__xss = 3">I will delete it.')
    assert await page.locator("#main img").count() == 0 and await page.locator("#main script").count() == 0
    await page.goto(f"{url}/console/#/run/demo/hostile")
    await expect(page.locator("#transcript pre.call")).to_contain_text(orjson.dumps(HOSTILE_PATH).decode())
    await expect(page.locator("#timeline")).to_contain_text("approval needed: delete_file")
    assert await page.locator("#main img").count() == 0 and await page.locator("#main script").count() == 0
    assert await page.evaluate("window.__xss") is None and dialogs == []
    csp = (await session.get(f"{url}/console/")).headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp

    # A page of another site posts to the console while the approver is signed in (the
    # session cookie is in the browser): every state-changing route refuses it.
    async def attacker(request: web.Request) -> web.Response:
        form = (f'<form id="f" method="post" action="{url}/console/api/runs/hostile/approvals?team=demo" '
                'enctype="text/plain"><input name=\'{"call_id":"h1","decision":"approve","x":"\' value=\'"}\'>'
                '</form><script>document.getElementById("f").submit()</script>')
        return web.Response(text=form, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", attacker)
    runner = web.AppRunner(app)
    await runner.setup()
    evil_port = free_port()
    await web.TCPSite(runner, "localhost", evil_port).start()  # another site: localhost, not 127.0.0.1
    try:
        async with page.expect_response(lambda r: "/approvals" in r.url) as posted:
            await page.goto(f"http://localhost:{evil_port}/")
        answer = await posted.value
        assert answer.status in (401, 403), await answer.text()
    finally:
        await runner.cleanup()
    run = await get_run(session, url, "hostile")
    assert run["status"] == "interrupted" and run["decisions"] == {}

    # and with the session cookie but no CSRF token, even from a same-site script
    cookies = await page.context.cookies(f"{url}/console/")
    cookie = next(c for c in cookies if c["name"] == "gateway_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["expires"] == -1  # browser session
    headers = {"Cookie": f"gateway_console={cookie['value']}", "Content-Type": "application/json"}
    decision = orjson.dumps({"call_id": "h1", "decision": "approve"})
    async with session.post(f"{url}/console/api/runs/hostile/approvals?team=demo", data=decision,
                            headers=headers) as resp:
        assert resp.status == 403 and (await resp.json())["error"]["code"] == "csrf_token_invalid"
    async with session.post(f"{url}/console/api/runs/hostile/approvals?team=demo", data=decision,
                            headers={**headers, "X-CSRF-Token": "0" * 64}) as resp:
        assert resp.status == 403
    assert (await get_run(session, url, "hostile"))["decisions"] == {}
