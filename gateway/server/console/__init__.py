"""The web console at `/console/`: an inbox for approvers, runs and spend for operators.

Plain files in `static/` (no build step, nothing from another site): one page whose script
builds every element with `textContent` (data is never parsed as HTML), served with a
strict Content-Security-Policy (scripts and styles only from the gateway, no inline code).
It calls these routes, all under `/console` (the session cookie's path):

| route                                      | is                                              |
| GET  /console/                             | the page (`static/index.html`)                  |
| GET  /console/static/{name}                | its script and style sheet                      |
| GET  /console/runs/{team}/{id}, /spend     | redirects to those pages (links in webhooks)    |
| POST, GET, DELETE /console/session         | sign in, who is signed in, sign out (`session`) |
| GET  /console/api/inbox                    | pending calls the team may decide (`inbox`)     |
| GET  /console/api/inbox/events             | the inbox as it changes (SSE)                   |
| GET  /console/api/spend                    | spend against budget (`views`)                  |
| GET  /console/api/runs[/{id}[/events]]     | the runs API's own handlers (`session.as_api`)  |
| POST /console/api/runs/{id}/approvals, /resume, /cancel | the same, CSRF-checked             |
| GET  /console/api/runs/{id}/trace          | the `gateway trace` timeline and turn costs     |
| GET  /console/api/spend/report             | `GET /v1/spend` (`session.as_api`)              |
| GET, POST /console/api/keys[/{id}], PATCH, DELETE /console/api/keys/{id}, POST .../rotate | the admin keys API's, CSRF-checked |

What a team may see and do is the runs API's (`run_access`), since these are its
handlers. The console's routes are left out of `/openapi.json` on purpose: they are the
page's, authenticated by its cookie, not an API for clients (docs/console.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final
from urllib.parse import quote

from aiohttp import web

from gateway.server.api import keys as keys_api
from gateway.server.api import runs as runs_api
from gateway.server.api import spend as spend_api
from gateway.server.console import inbox, session, views
from gateway.server.http.errors import NotFound

PREFIX: Final = session.PATH
STATIC_DIR: Final = Path(__file__).parent / "static"
STATIC_TYPES: Final = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".png": "image/png"}
CSP: Final = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
}
FILES: Final = web.AppKey("console_files", dict[str, tuple[bytes, str]])


def setup(app: web.Application) -> None:
    """Serve the console in `app` (called by `build_app`, after the runs API)."""
    app[FILES] = {p.name: (p.read_bytes(), STATIC_TYPES[p.suffix]) for p in sorted(STATIC_DIR.iterdir())
                  if p.suffix in STATIC_TYPES}
    app.on_response_prepare.append(_secure)
    r = app.router
    r.add_get(PREFIX, _to_page)
    r.add_get(PREFIX + "/", page)
    r.add_get(PREFIX + "/static/{name}", static)
    r.add_get(PREFIX + "/runs/{team}/{id}", to_run_page)  # the links webhook notices carry (notify.message)
    r.add_get(PREFIX + "/spend", to_spend_page)
    r.add_post(PREFIX + "/session", session.sign_in)
    r.add_get(PREFIX + "/session", session.whoami)
    r.add_delete(PREFIX + "/session", session.sign_out)
    r.add_get(PREFIX + "/api/inbox", inbox.get_inbox)
    r.add_get(PREFIX + "/api/inbox/events", inbox.inbox_events)
    r.add_get(PREFIX + "/api/spend", views.spend)
    r.add_get(PREFIX + "/api/runs", session.as_api(runs_api.list_runs))
    r.add_get(PREFIX + "/api/runs/{id}", session.as_api(runs_api.get_run))
    r.add_get(PREFIX + "/api/runs/{id}/events", session.as_api(runs_api.run_events))
    r.add_get(PREFIX + "/api/runs/{id}/trace", session.as_api(views.run_trace))
    r.add_post(PREFIX + "/api/runs/{id}/approvals", session.as_api(runs_api.post_approval))
    r.add_post(PREFIX + "/api/runs/{id}/resume", session.as_api(runs_api.post_resume))
    r.add_post(PREFIX + "/api/runs/{id}/cancel", session.as_api(runs_api.post_cancel))
    r.add_get(PREFIX + "/api/spend/report", session.as_api(spend_api.get_spend))
    r.add_get(PREFIX + "/api/keys", session.as_api(keys_api.list_keys))
    r.add_post(PREFIX + "/api/keys", session.as_api(keys_api.create_key))
    r.add_get(PREFIX + "/api/keys/{id}", session.as_api(keys_api.get_key))
    r.add_patch(PREFIX + "/api/keys/{id}", session.as_api(keys_api.update_key))
    r.add_delete(PREFIX + "/api/keys/{id}", session.as_api(keys_api.revoke_key))
    r.add_post(PREFIX + "/api/keys/{id}/rotate", session.as_api(keys_api.rotate_key))


def is_console(path: str) -> bool:
    """Whether `path` is one of the console's (its pages, files and routes)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


async def _secure(request: web.Request, response: web.StreamResponse) -> None:
    if is_console(request.path):
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)


async def _to_page(request: web.Request) -> web.Response:
    raise web.HTTPPermanentRedirect(PREFIX + "/")


async def to_run_page(request: web.Request) -> web.Response:
    """GET /console/runs/{team}/{id}: a run's page (the page routes by the URL's fragment)."""
    team, run_id = (quote(request.match_info[k], safe="") for k in ("team", "id"))
    raise web.HTTPFound(f"{PREFIX}/#/run/{team}/{run_id}")


async def to_spend_page(request: web.Request) -> web.Response:
    """GET /console/spend: the spend page."""
    raise web.HTTPFound(f"{PREFIX}/#/spend")


async def page(request: web.Request) -> web.Response:
    """GET /console/: the page (no data in it: the script fetches everything)."""
    body, kind = request.app[FILES]["index.html"]
    return web.Response(body=body, content_type=kind, charset="utf-8")


async def static(request: web.Request) -> web.Response:
    """GET /console/static/{name}: the page's script, style sheet and images."""
    name = request.match_info["name"]
    found = request.app[FILES].get(name)
    if found is None or name == "index.html":
        raise NotFound(f"the console has no file {name!r}", code="not_found")
    body, kind = found
    return web.Response(body=body, content_type=kind, charset="utf-8" if kind.startswith("text/") else None)
