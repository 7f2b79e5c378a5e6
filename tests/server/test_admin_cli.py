"""`gateway keys` (and `gateway spend`, `gateway audit`) as a person runs them: a real CLI
process against a real gateway process, with a key that manages its team's keys."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from tests.server.served import DEMO, KEYS, Served, chat_body, request
from tests.support.procs import run_gateway


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gateway = Served.start(tmp_path_factory.mktemp("admin_cli") / "gw")
    yield gateway
    gateway.proc.stop()


def cli(served: Served, *args: str, key: str = KEYS) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GATEWAY_URL", "GATEWAY_KEY")}
    env["GATEWAY_KEY"], env["GATEWAY_URL"] = key, served.url
    return run_gateway(list(args), env=env)


async def test_create_prints_the_secret_once_and_the_key_works(served: Served, session: aiohttp.ClientSession) -> None:
    made = cli(served, "keys", "create", "--team", "demo", "--name", "laptop", "--user", "ana", "--model",
               "scripted-*", "--budget", "1.5", "--period", "week", "--meta", "owner=ana", "--rpm", "120")
    assert made.returncode == 0, made.stderr
    assert "shown once" in made.stderr
    secret = next(line.split()[1] for line in made.stdout.splitlines() if line.startswith("key "))
    key_id = next(line.split()[1] for line in made.stdout.splitlines() if line.startswith("id "))
    assert secret.startswith("gw-") and "budget    $1.500000 per week" in made.stdout
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions", key=secret,
                                    body=chat_body("scripted-plan"))
    assert status == 200, body

    listed = cli(served, "keys", "list")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:4] == ["ID", "TEAM", "NAME", "PREFIX"]
    row = next(r for r in rows if r.startswith(key_id))
    assert secret[:9] in row and "ana" in row and "active" in row and secret not in listed.stdout
    as_json = orjson.loads(cli(served, "keys", "list", "--json").stdout)
    assert any(k["id"] == key_id for k in as_json["data"]) and secret not in str(as_json)

    shown = cli(served, "keys", "show", key_id)
    assert shown.returncode == 0 and "models    scripted-*" in shown.stdout and secret not in shown.stdout
    changed = cli(served, "keys", "update", key_id, "--budget", "1.0")
    assert changed.returncode == 0 and "$1.000000 per week" in changed.stdout

    rotated = cli(served, "keys", "rotate", key_id, "--grace", "0")
    assert rotated.returncode == 0 and "shown once" in rotated.stderr
    new = next(line.split()[1] for line in rotated.stdout.splitlines() if line.startswith("key "))
    assert new != secret and new.startswith("gw-")
    revoked = cli(served, "keys", "revoke", key_id)
    assert revoked.returncode == 0 and f"revoked {key_id}" in revoked.stdout
    everything = cli(served, "keys", "list", "--all")
    assert "revoked" in next(r for r in everything.stdout.splitlines() if r.startswith(key_id))


def test_refusals_are_the_gateways_words(served: Served) -> None:
    done = cli(served, "keys", "create", "--team", "demo", "--name", "x", key=DEMO)
    assert done.returncode == 1 and "HTTP 403" in done.stderr and "may not manage keys" in done.stderr
    done = cli(served, "keys", "create", "--team", "nope", "--name", "x")
    assert done.returncode == 1 and "HTTP 400" in done.stderr and "no team named" in done.stderr
    done = cli(served, "keys", "update", "key_x")
    assert done.returncode == 2 and "nothing to change" in done.stderr
    done = cli(served, "keys", "create", "--team", "demo", "--name", "x", "--meta", "novalue")
    assert done.returncode == 2 and "KEY=VALUE" in done.stderr


async def test_spend_prints_the_table_of_the_teams_own_spend(served: Served, session: aiohttp.ClientSession) -> None:
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions",
                                    body=chat_body("scripted-plan", user="ana"))
    assert status == 200, body
    done = cli(served, "spend", "--group-by", "user,model", key=DEMO)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["USER", "MODEL", "CALLS", "COST_USD"]
    assert any(line.split()[:2] == ["ana", "scripted-plan"] for line in lines) and lines[-1].startswith("TOTAL")
    as_json = orjson.loads(cli(served, "spend", "--json", key=DEMO).stdout)
    assert as_json["team"] == "demo" and as_json["total_micros"] > 0
    refused = cli(served, "audit", key=DEMO)
    assert refused.returncode == 1 and "HTTP 403" in refused.stderr


async def test_a_server_side_runs_turns_are_held_to_and_spent_by_the_key_that_started_it(
        served: Served, session: aiohttp.ClientSession) -> None:
    status, _, tight = await request(session, "POST", f"{served.url}/v1/admin/keys", key=KEYS,
                                     body={"team": "demo", "name": "tight", "budget_usd": 0.000001})
    assert status == 201, tight
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions", key=tight["key"],
                                    body=chat_body("scripted-plan"), headers={"X-Policy": "files"})
    assert status == 200 and body["run"]["status"] == "budget_exceeded", body  # a server-side run, stopped
    assert body["run"]["reason"] == "key_budget"
    status, _, roomy = await request(session, "POST", f"{served.url}/v1/admin/keys", key=KEYS,
                                     body={"team": "demo", "name": "roomy", "budget_usd": 1.0, "user": "sam"})
    status, _, body = await request(session, "POST", f"{served.url}/v1/chat/completions", key=roomy["key"],
                                    body=chat_body("scripted-plan"), headers={"X-Policy": "files"})
    assert status == 200 and body["run"]["status"] == "completed" and body["run"]["turns"] == 3, body
    status, _, spent = await request(session, "GET", f"{served.url}/v1/spend?group_by=key,user,policy", key=DEMO)
    row = next(r for r in spent["data"] if r["key"] == roomy["id"])
    assert row["user"] == "sam" and row["policy"] == "files" and row["calls"] == 3
    assert abs(row["cost_usd"] - body["run"]["cost_usd"]) < 1e-6
    status, _, shown = await request(session, "GET", f"{served.url}/v1/admin/keys/{roomy['id']}", key=KEYS)
    assert abs(shown["budget"]["spent_usd"] - body["run"]["cost_usd"]) < 1e-6
