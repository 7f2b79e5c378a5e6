"""Property-based fuzzing of one real gateway process: chat bodies, the runs API, header
bytes and the admin API (keys, spend, audit).

Mostly-valid chat bodies with mutated fields (wrong types, huge integers, deep nesting,
odd tool calls and tools), under the `passthrough` and `files` policies, streamed and
not; then run ids, query parameters, Last-Event-ID and POST bodies of the runs API;
then raw header bytes (not UTF-8, control bytes, odd names) on every route of
`/openapi.json` and the console, written to the socket as they are.
Whatever is sent, the gateway answers below 500, every error is in the OpenAI shape,
no body names an exception class or carries a traceback, and the gateway's log has no
traceback and no error line.

Requests are plain `http.client` calls (or raw socket writes) driven by hypothesis
(derandomized: the same examples on every run, so the test is steady), all to one
gateway process.
"""

from __future__ import annotations

import copy
import gzip
import http.client
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.served import DEMO, KEYS, OPS, OTHER, Served
from tests.support import rawhttp

CLASS_NAME = re.compile(rb"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")
# The examples are derandomized (the same ones every run); a deeper run raises the counts,
# e.g. GATEWAY_FUZZ_SCALE=4 ./scripts/test tests/server/test_fuzz.py.
SCALE = float(os.environ.get("GATEWAY_FUZZ_SCALE", "1"))
CHAT_EXAMPLES = int(500 * SCALE)
RUNS_EXAMPLES = int(250 * SCALE)
HEADER_EXAMPLES = int(2000 * SCALE)
ADMIN_EXAMPLES = int(250 * SCALE)
# Lists, not sets: a set of strings iterates in an order that changes with PYTHONHASHSEED,
# and values drawn in that order would make the derandomized examples differ between runs.
distinct = partial(st.lists, unique=True)
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


class Client:
    """Sync HTTP/1.1 to the gateway; every answer is checked before it is returned."""

    def __init__(self, url: str, log: Path) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.log = log
        self.sent = 0
        self.statuses: dict[int, int] = {}

    def send(self, method: str, path: str, body: bytes | None = None, key: str | None = DEMO,
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        h = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            conn.putheader("Content-Length", str(len(body or b"")))
            for name, value in h.items():
                conn.putheader(name, value.encode())  # UTF-8, as clients send ("³")
            conn.endheaders(body)
            resp = conn.getresponse()
            data = resp.read()
            content_type = resp.getheader("Content-Type") or ""
        finally:
            conn.close()
        where = f"{method} {path} {body[:300] if body else b''!r}"
        return self.check(resp.status, content_type, data, where)

    def send_raw(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> int:
        """One request written to the socket byte for byte (header names and values as given)."""
        return self.send_raw_answer(method, path, headers, body)[0]

    def send_raw_answer(self, method: str, path: str, headers: list[tuple[bytes, bytes]],
                        body: bytes = b"") -> tuple[int, bytes]:
        answer = rawhttp.send(f"http://{self.host}:{self.port}", method, path, headers, body)
        return self.check(answer.status, answer.content_type, answer.body, f"{method} {path} {headers!r}")

    def check(self, status: int, content_type: str, data: bytes, where: str) -> tuple[int, bytes]:
        self.sent += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        where = f"{where} -> {status} {data[:500]!r}"
        assert status < 500, where
        if not content_type.startswith(("text/javascript", "text/css", "text/html")):  # the console's own files
            assert not CLASS_NAME.search(data), where
        if status >= 400:
            assert content_type.startswith("application/json"), where
            error = orjson.loads(data)["error"]
            assert set(error) == {"message", "type", "code", "param"} and error["message"], where
        return status, data


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    gateway = Served.start(tmp_path_factory.mktemp("fuzz") / "gw")
    try:
        yield Client(gateway.url, gateway.proc.log)
    finally:
        gateway.proc.stop()


# --- values -------------------------------------------------------------------------------

def nested(depth: int, inner: Any = 1) -> Any:
    value = inner
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


LEAVES = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
JSON = st.recursive(LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
EDGES = st.sampled_from([
    0, -1, 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 1e308, -1e308,
    0.5, 2.5, "", "²", "³", "abc", "function", "user", "assistant", "tool", [], {}, [1], [[]], True, False, None,
    {"type": "function"}, {"type": "function", "function": {"name": "x", "arguments": 1}},
    [{"type": "text", "text": 1}], [{"type": "image_url"}], {"name": "list_files", "arguments": "{}"},
])
ODD = st.one_of(EDGES, JSON, st.integers(1, 120).map(nested))

# --- chat bodies ----------------------------------------------------------------------------

USER = {"role": "user", "content": "Which file mentions a timeout?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "d",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
BASES: list[dict[str, Any]] = [
    {"model": "scripted-plan", "messages": [USER]},
    {"model": "scripted-plan", "messages": [{"role": "system", "content": "be brief"}, USER], "max_tokens": 200,
     "temperature": 0.2, "n": 1, "stop": ["x"]},
    {"model": "scripted-plan", "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                            {"role": "tool", "tool_call_id": "call_1", "content": "errors.log"}]},
    {"model": "scripted-plan", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     "tools": [TOOL], "tool_choice": "auto", "seed": 7, "logit_bias": {"1": 2}},
    {"model": "scripted-plan", "messages": [USER], "stream": True, "stream_options": {"include_usage": True}},
]
FIELDS = ["model", "messages", "stream", "stream_options", "tools", "tool_choice", "max_tokens",
          "max_completion_tokens", "n", "temperature", "top_p", "seed", "stop", "logit_bias", "presence_penalty",
          "frequency_penalty", "functions", "function_call", "user", "metadata", "response_format", "new_field"]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON value (keys and indexes), the value's own included."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


def mutate(body: dict[str, Any], path: tuple[Any, ...], value: Any, delete: bool) -> None:
    if not path:
        return
    parent: Any = body
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if delete:
        del parent[last]
    elif isinstance(parent, list) and last >= len(parent):
        parent.append(value)
    else:
        parent[last] = value


@st.composite
def chat_cases(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    body = copy.deepcopy(draw(st.sampled_from(BASES)))
    stream = draw(st.sampled_from([None, True, False]))
    if stream is not None:
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
    for _ in range(draw(st.integers(0, 3))):
        targets = [p for p in paths(body) if p] + [(f,) for f in FIELDS]
        path = draw(st.sampled_from(targets))
        delete = draw(st.integers(0, 5)) == 0
        try:
            mutate(body, path, copy.deepcopy(draw(ODD)), delete)  # (EDGES holds shared objects)
        except (KeyError, IndexError, TypeError):  # the path went away with an earlier mutation
            continue
    headers: dict[str, str] = {}
    policy = draw(st.sampled_from([None, "passthrough", "files", "files", "nope"]))
    if policy is not None:
        headers["X-Policy"] = policy
    if draw(st.integers(0, 9)) == 0:
        headers["X-Run-Id"] = draw(st.sampled_from(["fuzz-a", "fuzz-b", "-bad", "x" * 200, "ok.1:2"]))
    # the json module writes what orjson refuses (integers past 64 bits); deep values as they are
    raw = json.dumps(body).encode()
    encoding = draw(st.sampled_from([None] * 12 + ["gzip", "gzip-junk", "deflate-junk"]))
    if encoding is not None:
        headers["Content-Encoding"] = encoding.removesuffix("-junk")
        raw = gzip.compress(raw) if encoding == "gzip" else raw
    return raw, headers


def test_fuzz_chat_bodies(client: Client) -> None:
    before = client.sent

    @settings(FUZZ, max_examples=CHAT_EXAMPLES)
    @given(chat_cases())
    def check(case: tuple[bytes, dict[str, str]]) -> None:
        raw, headers = case
        client.send("POST", "/v1/chat/completions", raw, headers=headers)

    check()
    assert client.sent - before >= CHAT_EXAMPLES
    assert client.statuses.get(200, 0) > 50 and client.statuses.get(400, 0) > 200, client.statuses


# --- runs API --------------------------------------------------------------------------------

TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, blacklist_characters="\x7f"), max_size=12)
NUMBERISH = st.one_of(st.sampled_from(["0", "1", "-1", "²", "³", "9" * 31, "1e3", " 7", "0x10", "", "true"]),
                      st.integers(-(2**70), 2**70).map(str), TEXT)
BODY_KEYS = ["call_id", "decision", "reason", "max_turns", "max_budget_usd", "stream", "stream_options"]
GOOD_VALUES: dict[str, Any] = {"call_id": "call_1", "decision": "approve", "reason": "ok", "max_turns": 5,
                               "max_budget_usd": 1.0, "stream": False, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def runs(client: Client) -> dict[str, str]:
    """A passthrough run still going (its last answer asked for tools) and a finished files run."""
    made: dict[str, str] = {}
    for name, policy in (("fuzz-pass", "passthrough"), ("fuzz-files", "files")):
        status, _ = client.send("POST", "/v1/chat/completions", orjson.dumps({"model": "scripted-plan",
                                                                               "messages": [USER]}),
                                headers={"X-Run-Id": name, "X-Policy": policy})
        assert status == 200
        made[policy] = name
    return made


@st.composite
def runs_cases(draw: st.DrawFn, ids: list[str]) -> tuple[str, str, bytes | None, str | None, dict[str, str]]:
    run_id = draw(st.one_of(st.sampled_from(ids), TEXT))
    key = draw(st.sampled_from([DEMO, DEMO, OPS, OTHER, "sk-nope", None]))
    route = draw(st.sampled_from(["list", "get", "events", "approvals", "resume", "cancel"]))
    headers: dict[str, str] = {}
    if route == "list":
        query = {k: draw(NUMBERISH if k == "limit" else TEXT) for k in draw(distinct(st.sampled_from(
            ["status", "team", "limit"])))}
        return "GET", "/v1/runs?" + urlencode(query), None, key, headers
    path = f"/v1/runs/{quote(run_id, safe='')}"
    if route == "get":
        return "GET", path, None, key, headers
    if route == "events":
        query = {}
        if draw(st.booleans()):
            query["after"] = draw(NUMBERISH)
        follow = draw(st.sampled_from(["", "0", "false", "2", "yes", "1", "TRUE", "²"]))
        if follow:
            query["follow"] = follow
        if follow.lower() in ("1", "true"):  # following a run that has stopped ends at once
            path = f"/v1/runs/{ids[-1]}"
        if draw(st.booleans()):
            headers["Last-Event-ID"] = draw(NUMBERISH).strip() or "0"
        return "GET", f"{path}/events?{urlencode(query)}", None, key, headers
    body: dict[str, Any] = {}
    for name in draw(distinct(st.sampled_from(BODY_KEYS), max_size=4)):
        body[name] = copy.deepcopy(draw(st.one_of(st.just(GOOD_VALUES[name]), ODD)))
    raw = json.dumps(body).encode() if draw(st.integers(0, 9)) else draw(st.sampled_from(
        [b"", b"[]", b"{", b"null", b"\"x\"", b"{\"reason\": " + b"[" * 300 + b"]" * 300 + b"}"]))
    return "POST", f"{path}/{route}", raw, key, headers


def test_fuzz_runs_api(client: Client, runs: dict[str, str]) -> None:
    before = client.sent
    ids = [runs["passthrough"], runs["files"]]

    @settings(FUZZ, max_examples=RUNS_EXAMPLES)
    @given(runs_cases(ids))
    def check(case: tuple[str, str, bytes | None, str | None, dict[str, str]]) -> None:
        method, path, body, key, headers = case
        client.send(method, path, body, key=key, headers=headers)

    check()
    assert client.sent - before >= RUNS_EXAMPLES


# --- header bytes ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Route:
    method: str
    path: str
    body: bytes = b""
    console: bool = False  # signed in by the console cookie, not a Bearer key


CHAT = orjson.dumps({"model": "scripted-plan", "messages": [USER]})
BODIES = {
    "/v1/chat/completions": CHAT,
    "/scripted/v1/chat/completions": CHAT,
    "/v1/responses": orjson.dumps({"model": "scripted-plan", "input": "Which file mentions a timeout?"}),
    "/v1/embeddings": orjson.dumps({"model": "scripted-plan", "input": "hello"}),
    "/scripted/v1/embeddings": orjson.dumps({"model": "scripted-plan", "input": "hello"}),
    "/approvals": orjson.dumps({"call_id": "call_1", "decision": "approve"}),
    "/resume": b"{}",
    "/cancel": b"{}",
    "/console/session": orjson.dumps({"key": DEMO}),
}
CONSOLE = [("GET", "/console/"), ("GET", "/console/static/console.js"), ("GET", "/console/session"),
           ("POST", "/console/session"), ("DELETE", "/console/session"), ("GET", "/console/api/inbox"),
           ("GET", "/console/api/spend"), ("GET", "/console/api/runs"), ("GET", "/console/api/runs/{id}"),
           ("GET", "/console/api/runs/{id}/events"), ("GET", "/console/api/runs/{id}/trace"),
           ("POST", "/console/api/runs/{id}/approvals"), ("POST", "/console/api/runs/{id}/cancel")]
"""The console's routes (not in /openapi.json), less its live inbox stream, which would not end."""


def every_route(client: Client, run_id: str) -> list[Route]:
    """Every operation of the gateway's own /openapi.json, and the console's routes, with
    their path parameters filled in and a valid body."""
    status, raw = client.send("GET", "/openapi.json")
    assert status == 200
    found = [(method.upper(), path, False) for path, ops in orjson.loads(raw)["paths"].items() for method in ops]
    found += [(method, path, True) for method, path in CONSOLE]
    routes = []
    for method, path, console in found:
        filled = path.replace("{id}", run_id).replace("{model}", "scripted-plan")
        body = next((b for suffix, b in BODIES.items() if path.endswith(suffix)), b"") if method == "POST" else b""
        routes.append(Route(method, filled, body, console))
    assert len(routes) >= 30, routes
    return routes


HEADER_NAMES = [b"Authorization", b"X-Run-Id", b"X-Policy", b"Cookie", b"X-CSRF-Token", b"Origin",
                b"Sec-Fetch-Site", b"Last-Event-ID", b"Content-Type", b"Accept", b"Accept-Encoding",
                b"X-Scripted-Fail", b"User-Agent", b"X-Anything", b"Host"]
GOOD: dict[bytes, bytes] = {b"Authorization": f"Bearer {DEMO}".encode(), b"X-Run-Id": b"fuzz-bytes",
                            b"X-Policy": b"passthrough", b"Cookie": f"gateway_console={DEMO}".encode(),
                            b"X-CSRF-Token": b"0" * 64, b"Origin": b"http://127.0.0.1", b"Sec-Fetch-Site": b"same-origin",
                            b"Last-Event-ID": b"1", b"Content-Type": b"application/json", b"Accept": b"*/*",
                            b"Accept-Encoding": b"gzip", b"X-Scripted-Fail": b"500", b"User-Agent": b"fuzz/1",
                            b"X-Anything": b"x", b"Host": b"127.0.0.1"}
ODD_BYTES = st.sampled_from([b"\xff", b"\x80", b"\xc3", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xfe\xff",
                             b"\x00", b"\x01", b"\x7f", b"\t", b"\r", "é".encode(), "é".encode("latin-1"), b"\xe2\x82",
                             "\u2028".encode(), b";", b"=", b","])
NO_NEWLINE = st.binary(max_size=24).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
SOME_BYTES = st.binary(min_size=1, max_size=4).map(lambda b: b.replace(b"\n", b""))
UTF8 = st.text(max_size=6).map(lambda t: t.encode().replace(b"\n", b"").replace(b"\r", b""))
"""Valid UTF-8 of any character: passes the edge, so the handlers behind it read it."""


@st.composite
def header_value(draw: st.DrawFn, name: bytes) -> bytes:
    """A value for `name`: the good one with odd bytes or text put in, or bytes of any kind
    (no line break)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(NO_NEWLINE)
    value = GOOD[name]
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(value)))
        value = value[:at] + draw(st.one_of(ODD_BYTES, UTF8, SOME_BYTES)) + value[at:]
    return value


@st.composite
def header_cases(draw: st.DrawFn, routes: list[Route]) -> tuple[Route, list[tuple[bytes, bytes]]]:
    route = draw(st.sampled_from(routes))
    headers = dict[bytes, bytes]({b"Content-Type": b"application/json"})
    if route.console:
        headers[b"Cookie"] = GOOD[b"Cookie"]
    else:
        headers[b"Authorization"] = GOOD[b"Authorization"]
    for name in draw(st.lists(st.sampled_from(HEADER_NAMES), min_size=1, max_size=3, unique=True)):
        headers[name] = draw(header_value(name))
    pairs = list(headers.items())
    if draw(st.integers(0, 19)) == 0:  # a header whose name is not a token
        name = draw(st.binary(min_size=1, max_size=8)).replace(b"\n", b"").replace(b":", b"")
        pairs.append((name or b"\x80", b"x"))
    return route, pairs


@pytest.mark.timeout(400)  # 2,000 requests: ~30 s alone, several times that beside the whole suite on 2 cores
def test_fuzz_header_bytes(client: Client, runs: dict[str, str]) -> None:
    """Header values (and a few names) of every byte, on every route: no 5xx, every error in
    the OpenAI shape, and nothing but ordinary lines in the gateway's log."""
    routes = every_route(client, runs["files"])
    log_from = client.log.stat().st_size
    before = dict(client.statuses)
    sent = client.sent

    @settings(FUZZ, max_examples=HEADER_EXAMPLES)
    @given(header_cases(routes))
    def check(case: tuple[Route, list[tuple[bytes, bytes]]]) -> None:
        route, headers = case
        client.send_raw(route.method, route.path, headers, route.body)

    check()
    assert client.sent - sent >= HEADER_EXAMPLES
    got = {status: n - before.get(status, 0) for status, n in client.statuses.items()}
    assert got.get(400, 0) > 200 and got.get(401, 0) > 40 and got.get(200, 0) > 50, got  # edge and past it
    with client.log.open("rb") as log:
        log.seek(log_from)
        written = log.read().decode(errors="replace")
    assert "Traceback" not in written, written[-4000:]
    assert not [line for line in written.splitlines() if " ERROR " in line], written[-4000:]


@pytest.mark.parametrize(("method", "path", "name", "value", "status", "param"), [
    ("POST", "/v1/chat/completions", b"Authorization", b"Bearer sk-d\xffemo", 401, None),
    ("POST", "/v1/embeddings", b"Authorization", b"Bearer \xc3\x28", 401, None),
    ("GET", "/v1/runs", b"Authorization", b"Bearer sk-demo\x80", 401, None),
    ("POST", "/v1/chat/completions", b"X-Run-Id", b"run-\xff", 400, "X-Run-Id"),
    ("POST", "/v1/chat/completions", b"X-Policy", b"fi\xffles", 400, "X-Policy"),
    ("GET", "/console/session", b"Cookie", b"gateway_console=sk-\xffdemo", 400, "Cookie"),
    ("DELETE", "/console/session", b"X-CSRF-Token", b"\xfe\xff", 400, "X-CSRF-Token"),
    ("GET", "/healthz", b"User-Agent", b"curl/\xff", 400, "User-Agent"),
])
def test_a_header_that_is_not_utf8_is_refused_at_the_edge(client: Client, method: str, path: str, name: bytes,
                                                          value: bytes, status: int, param: str | None) -> None:
    """One byte that is not UTF-8, in any header of any route: 401 for Authorization, else
    400 `invalid_header` naming the header; never a 500, never a traceback in the log."""
    log_from = client.log.stat().st_size
    headers = [(b"Content-Type", b"application/json"), (b"Authorization", GOOD[b"Authorization"]),
               (b"Cookie", GOOD[b"Cookie"])]
    headers = [(n, v) for n, v in headers if n != name] + [(name, value)]
    body = BODIES.get(path, b"")
    conn_status, data = client.send_raw_answer(method, path, headers, body)
    error = orjson.loads(data)["error"]
    assert conn_status == status, data
    assert (error["code"], error["param"]) == (("invalid_api_key", None) if status == 401
                                               else ("invalid_header", param)), error
    assert "UTF-8" in error["message"]
    with client.log.open("rb") as log:
        log.seek(log_from)
        assert b"Traceback" not in log.read()


# --- admin API: keys ---------------------------------------------------------------------------

KEY_FIELDS = ["team", "name", "user", "models", "policies", "budget_usd", "budget_period", "rate_limits",
              "expires_at", "expires_in_s", "metadata", "manage_keys", "grace_s", "colour"]
GOOD_KEY: dict[str, Any] = {"team": "demo", "name": "fuzz", "user": "ana", "models": ["scripted-*"],
                            "policies": ["passthrough"], "budget_usd": 1.0, "budget_period": "week",
                            "rate_limits": {"requests_per_minute": 60}, "expires_in_s": 3600,
                            "metadata": {"owner": "ana"}, "manage_keys": False, "grace_s": 1}


@pytest.fixture(scope="module")
def key_ids(client: Client) -> list[str]:
    """Two keys of team demo, issued by its key manager."""
    made = []
    for _ in range(2):
        status, data = client.send("POST", "/v1/admin/keys", orjson.dumps({"team": "demo", "name": "seed"}), key=KEYS)
        assert status == 201, data
        made.append(orjson.loads(data)["id"])
    return made


@st.composite
def admin_cases(draw: st.DrawFn, ids: list[str]) -> tuple[str, str, bytes | None, str | None]:
    key = draw(st.sampled_from([KEYS, KEYS, KEYS, DEMO, OTHER, "sk-nope", None]))
    route = draw(st.sampled_from(["create", "create", "list", "get", "patch", "patch", "rotate", "revoke"]))
    key_id = quote(draw(st.one_of(st.sampled_from(ids), TEXT, st.just("cfg_" + "0" * 24))), safe="")
    if route == "list":
        query = {k: draw(NUMBERISH if k == "limit" else TEXT) for k in draw(distinct(st.sampled_from(
            ["team", "user", "include_revoked", "after", "limit"])))}
        return "GET", "/v1/admin/keys?" + urlencode(query), None, key
    if route == "get":
        return "GET", f"/v1/admin/keys/{key_id}", None, key
    if route == "revoke":
        return "DELETE", f"/v1/admin/keys/{key_id}", None, key
    body: dict[str, Any] = {"team": "demo", "name": "fuzz"} if route == "create" else {}
    for name in draw(distinct(st.sampled_from(KEY_FIELDS), max_size=4)):
        body[name] = copy.deepcopy(draw(st.one_of(st.just(GOOD_KEY.get(name, 1)), ODD)))
    raw = json.dumps(body).encode() if draw(st.integers(0, 9)) else draw(st.sampled_from(
        [b"", b"[]", b"{", b"null", b"\"x\"", b"{\"name\": " + b"[" * 300 + b"]" * 300 + b"}"]))
    if route == "create":
        return "POST", "/v1/admin/keys", raw, key
    if route == "rotate":
        return "POST", f"/v1/admin/keys/{key_id}/rotate", raw, key
    return "PATCH", f"/v1/admin/keys/{key_id}", raw, key


def test_fuzz_admin_keys_api(client: Client, key_ids: list[str]) -> None:
    before, created = client.sent, client.statuses.get(201, 0)

    @settings(FUZZ, max_examples=ADMIN_EXAMPLES)
    @given(admin_cases(key_ids))
    def check(case: tuple[str, str, bytes | None, str | None]) -> None:
        method, path, body, key = case
        client.send(method, path, body, key=key)

    check()
    assert client.sent - before >= ADMIN_EXAMPLES
    assert client.statuses.get(201, 0) > created  # some fuzzed bodies were valid keys


# --- spend and the audit log -----------------------------------------------------------------

@st.composite
def report_cases(draw: st.DrawFn) -> tuple[str, str | None]:
    key = draw(st.sampled_from([DEMO, KEYS, OTHER, "sk-nope", None]))
    if draw(st.booleans()):
        names = ["group_by", "from", "to", "team", "format"]
        values = st.one_of(TEXT, st.sampled_from(["team,key", "day", "model,user,policy", "2026-12-01", "2026-02-30",
                                                   "1999-01-01", "csv", "json", "demo", "x" * 100]))
        query = {k: draw(values) for k in draw(distinct(st.sampled_from(names)))}
        return "/v1/spend?" + urlencode(query), key
    query = {k: draw(NUMBERISH if k in ("since", "after", "limit") else TEXT)
             for k in draw(distinct(st.sampled_from(["since", "action", "team", "after", "limit"])))}
    return "/v1/admin/audit?" + urlencode(query), key


def test_fuzz_spend_and_audit_queries(client: Client) -> None:
    before = client.sent

    @settings(FUZZ, max_examples=int(120 * SCALE))
    @given(report_cases())
    def check(case: tuple[str, str | None]) -> None:
        path, key = case
        client.send("GET", path, key=key)

    check()
    assert client.sent - before >= int(120 * SCALE)
