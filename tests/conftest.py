"""The whole suite: under pytest-xdist, the longest test files first.

`--dist loadfile` hands out whole files in the order they were collected (with
`--no-loadscope-reorder`; by default it would put the files with the most tests first, so
a long file of one test, such as a stress test, came last and one worker ran it alone while
the other had finished). Here the files are ordered by their seconds in tests/durations.json
(the longest first; a file it does not know comes after those it does, in its usual place),
which spreads the work evenly over the workers. `scripts/test-durations` refreshes the
figures; they only decide the order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # one process: the usual order
    try:
        seconds: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    root = Path(str(config.rootpath))

    def weight(item: pytest.Item) -> float:
        try:
            path = Path(str(item.path)).relative_to(root).as_posix()
        except ValueError:
            return 0.0
        return -float(seconds.get(path, 0.0))

    items.sort(key=weight)  # stable: a file's tests keep their order


def pytest_configure(config: pytest.Config) -> None:
    """On pytest-xdist's controller: one zygote (tests/support/zygote.py) for all workers, and
    the folder of the session's PostgreSQL cluster (tests/support/postgres.py).

    Workers inherit the environment variable naming its socket, so the gateway imports are
    paid once per run instead of once per worker (about 1.2 CPU-seconds each)."""
    import os
    import tempfile

    from tests.support import zygote

    from tests.support import postgres

    if not hasattr(config, "workerinput") and not os.environ.get(postgres.ENV):
        # The session's PostgreSQL folder (its cluster starts when a test first needs it),
        # inherited by the workers; this process stops the cluster at the end.
        config.add_cleanup(lambda folder=postgres.prepare(): postgres.stop(folder))
    workers = getattr(config.option, "numprocesses", None)
    if not workers or hasattr(config, "workerinput") or not zygote.enabled() or os.environ.get(zygote.SHARED):
        return
    shared = zygote.Zygote.start(Path(tempfile.mkdtemp(prefix="gwz")))
    os.environ[zygote.SHARED] = shared.path
    config.add_cleanup(shared.close)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (the test modules, the clients' SDKs: pydantic models by
    the thousand) lives until the end: frozen out of the cyclic collector, which would
    otherwise walk it again on every full collection the tests trigger."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """The session's throwaway PostgreSQL cluster (tests/support/postgres.py), shared by the
    workers; each test module (or test) takes a schema of its own."""
    from tests.support import postgres

    return postgres.dsn()


CPU_REPORT = "GATEWAY_TEST_CPU_REPORT"
"""A file path: each test file's CPU seconds (the test process, the processes it started
and waited for, and the gateway processes forked for it) are appended there as JSON lines.
It measures where the suite's CPU goes; it decides nothing."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    import os
    import resource

    from tests.support import zygote

    report = os.environ.get(CPU_REPORT)
    if not report:
        yield
        return

    def spent() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + zygote.CPU_SPENT[0]

    import time

    before, began = spent(), time.time()
    yield
    with open(report, "a") as out:
        out.write(json.dumps({"file": str(item.path), "test": item.nodeid, "cpu_s": round(spent() - before, 3),
                              "start": began, "end": time.time(),
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
