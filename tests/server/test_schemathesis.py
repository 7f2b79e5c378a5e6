"""Schemathesis against a real gateway, from its own `/openapi.json`: every operation, with a
team key and without one, finds no 5xx and no answer the document does not allow (status
codes, content types, response schemas and headers, `Allow` on 405s).

The checks are named: the document describes bodies more loosely than the edge validates
them (docs/http-api.md has the exact rules), so "a schema-valid request was rejected" is
expected and not checked, and unknown fields of a chat body are forwarded, not refused.
The CLI is the tool's own way to run every phase (examples, coverage, fuzzing, stateful; without a key,
where every answer is a 401, a few fuzzed requests per operation);
a fixed seed keeps the run the same every time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.served import DEMO, KEYS, Served

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance,allow_header_conformance")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served.start(tmp_path_factory.mktemp("schemathesis") / "gw")
    yield served
    served.proc.stop()


def st() -> str:
    exe = shutil.which("st", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("schemathesis is not installed (it is in the [test] extra)")
    return exe


@pytest.mark.timeout(300)  # the run's own deadline (below): ~30 operations take 20 s alone, minutes on a loaded machine
@pytest.mark.parametrize("key", [DEMO, None, KEYS], ids=["team-key", "no-key", "key-manager"])
def test_every_operation_answers_within_the_document(gateway: Served, key: str | None, tmp_path: Path) -> None:
    args = [st(), "run", f"{gateway.proc.url}/openapi.json", "--checks", CHECKS, "--seed", "20261201", "--no-color"]
    if key == KEYS:  # a key that may manage keys: the admin routes past their permission check
        args += ["-H", f"Authorization: Bearer {key}", "--max-examples", "8", "--include-path-regex", "^/v1/admin/keys"]
    elif key:
        args += ["-H", f"Authorization: Bearer {key}", "--max-examples", "8"]
    else:
        # Every answer is a 401 before any body is read: a few requests per operation show
        # it (the coverage phase's ~650 boundary cases would all read the same 401).
        args += ["--phases", "fuzzing", "--max-examples", "3"]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    selected = re.search(r"Selected: (\d+)/(\d+)", done.stdout)
    tested = re.search(r"Tested: (\d+)", done.stdout)
    assert selected and tested, done.stdout[-2000:]
    if key == KEYS:
        assert int(tested.group(1)) == int(selected.group(1)) >= 6  # every keys operation ran
        return
    assert int(tested.group(1)) == int(selected.group(2)) >= 20  # every operation of the document ran
