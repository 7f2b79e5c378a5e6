"""The chapter's file tools over a real temporary folder."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.harness.tools import ToolContext, ToolError
from gateway.tools import files
from gateway.tools.catalog import FILE_TOOLS
from gateway.tools.files import SAMPLE, Sandbox, deleted, file_tools, fresh_sandbox

Ctx = Callable[..., ToolContext]


def test_fresh_sandbox_is_a_new_copy_of_the_sample(tmp_path: Path) -> None:
    a, b = fresh_sandbox(tmp_path), fresh_sandbox(tmp_path)
    assert a != b and a.parent == b.parent == tmp_path
    names = sorted(p.name for p in a.iterdir())
    assert names == ["access.log", "errors.log", "notes.txt"]
    for name in names:
        assert (a / name).read_bytes() == (SAMPLE / name).read_bytes()
    (a / "access.log").unlink()
    assert (SAMPLE / "access.log").exists() and (b / "access.log").exists()


async def test_sample_facts_the_chapter_relies_on(sandbox: Sandbox, make_ctx: Ctx) -> None:
    sizes = dict(sandbox.files())
    assert max(sizes, key=lambda name: sizes[name]) == "errors.log"
    errors = await sandbox.read_file({"path": "errors.log"}, make_ctx())
    assert "worker 7 timed out after 30000 ms" in errors
    assert "rotate the logs" in await sandbox.read_file({"path": "notes.txt"}, make_ctx())
    assert "GET " in await sandbox.read_file({"path": "access.log"}, make_ctx())


async def test_list_files_names_and_sizes_sorted(sandbox: Sandbox, make_ctx: Ctx) -> None:
    listing = await sandbox.list_files({}, make_ctx())
    sizes = {p.name: p.stat().st_size for p in sandbox.root.iterdir()}
    lines = listing.splitlines()
    assert lines[:3] == [f"{name}  {sizes[name]} bytes" for name in sorted(sizes)]
    assert lines[3] == f"3 files, {sum(sizes.values())} bytes in total"
    (sandbox.root / "a.txt").write_text("x")
    assert (await sandbox.list_files({}, make_ctx())).splitlines()[0] == "a.txt  1 bytes"


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "escape.log", "outdir/secret.txt"])
async def test_paths_outside_the_folder_are_refused(sandbox: Sandbox, make_ctx: Ctx, tmp_path: Path,
                                                   path: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (sandbox.root / "escape.log").symlink_to(outside / "secret.txt")
    (sandbox.root / "outdir").symlink_to(outside)
    message = f"permission denied: {path} is outside the working folder"
    for tool in (sandbox.read_file, sandbox.delete_file):
        with pytest.raises(PermissionError) as caught:
            await tool({"path": path}, make_ctx())
        assert str(caught.value) == message
    assert (outside / "secret.txt").read_text() == "secret"
    assert deleted(sandbox) == []
    listing = await sandbox.list_files({}, make_ctx())
    assert "escape.log" not in listing and "secret" not in listing


async def test_missing_file_error_says_what_to_do(sandbox: Sandbox, make_ctx: Ctx) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        await sandbox.read_file({"path": "timeout.log"}, make_ctx())
    assert str(caught.value) == "no such file: timeout.log. Call list_files to see what exists."
    with pytest.raises(FileNotFoundError, match="no such file: .deleted.jsonl"):
        await sandbox.read_file({"path": ".deleted.jsonl"}, make_ctx())
    with pytest.raises(ValueError, match='"path"'):
        await sandbox.read_file({}, make_ctx())


async def test_delete_is_journaled_and_idempotent_per_key(sandbox: Sandbox, make_ctx: Ctx) -> None:
    first = await sandbox.delete_file({"path": "access.log"}, make_ctx("c1"))
    assert first == "Deleted access.log."
    assert not (sandbox.root / "access.log").exists()
    assert deleted(sandbox) == ["access.log"]
    # Same idempotency key (a retried call): no-op, same answer, nothing journaled.
    assert await sandbox.delete_file({"path": "access.log"}, make_ctx("c1")) == first
    assert deleted(sandbox) == ["access.log"]
    # A second call (new key) runs and is journaled, though there is nothing left to delete.
    again = await sandbox.delete_file({"path": "./access.log"}, make_ctx("c2"))
    assert again == "access.log was already deleted."
    assert deleted(sandbox) == ["access.log", "access.log"]
    # A file that never existed is an error, not a journaled delete.
    with pytest.raises(FileNotFoundError, match="no such file: nope.log"):
        await sandbox.delete_file({"path": "nope.log"}, make_ctx("c3"))
    assert deleted(sandbox) == ["access.log", "access.log"]
    listing = await sandbox.list_files({}, make_ctx())
    assert ".deleted" not in listing and "access.log" not in listing
    assert listing.splitlines()[-1].startswith("2 files, ")


async def test_scan_archive_reports_progress_and_finishes(tmp_path: Path, make_ctx: Ctx) -> None:
    box = Sandbox(fresh_sandbox(tmp_path), scan_seconds=0.12)
    labels: list[tuple[str, float]] = []
    started = time.perf_counter()
    result = await box.scan_archive({}, make_ctx(progress=lambda label: labels.append((label, time.perf_counter()))))
    elapsed = time.perf_counter() - started
    assert [label for label, _ in labels] == [f"scanned {n} of 1200 files" for n in range(200, 1201, 200)]
    assert elapsed >= 0.12  # the scan took its time (how long past that is the machine's load)
    assert labels[0][1] - started >= 0.02 * 0.9  # one step is 200/1200 of the time
    assert result.startswith("Scanned 1200 archived files")


async def test_scan_archive_stops_mid_step_on_cancel(tmp_path: Path, make_ctx: Ctx) -> None:
    box = Sandbox(fresh_sandbox(tmp_path))  # the default 3 s scan: 0.5 s per step
    first = asyncio.Event()
    labels: list[str] = []

    def progress(label: str) -> None:
        labels.append(label)
        first.set()

    ctx = make_ctx(progress=progress)
    task = asyncio.create_task(box.scan_archive({}, ctx))
    await first.wait()
    pressed: list[float] = []

    def press_stop() -> None:  # mid-step: 0.2 s into the second 0.5 s step
        pressed.append(time.perf_counter())
        ctx.cancelled.set()

    asyncio.get_running_loop().call_later(0.2, press_stop)
    with pytest.raises(ToolError, match="cancelled after 200 of 1200 files"):
        await task
    # It stopped inside the second step (no "400" progress, "after 200" in the error), not at its
    # end; how many milliseconds that takes is benchmarks/stop_latency.py's figure.
    assert pressed and labels == ["scanned 200 of 1200 files"]


async def test_file_tools_bind_the_chapter_specs(sandbox: Sandbox, make_ctx: Ctx) -> None:
    tools = file_tools(sandbox)
    assert [t.spec for t in tools.values()] == list(FILE_TOOLS)
    assert "errors.log" in str(await tools["list_files"].run({}, make_ctx()))
    assert "worker 7" in str(await tools["read_file"].run({"path": "errors.log"}, make_ctx()))


async def test_module_entry_points_find_their_sandbox(sandbox: Sandbox, make_ctx: Ctx,
                                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(files.SANDBOX_ENV, raising=False)
    with pytest.raises(RuntimeError, match="GATEWAY_SANDBOX"):
        await files.list_files({}, make_ctx())
    monkeypatch.setenv(files.SANDBOX_ENV, str(sandbox.root))
    assert "errors.log" in await files.list_files({}, make_ctx())
    assert await files.delete_file({"path": "notes.txt"}, make_ctx("c9")) == "Deleted notes.txt."
    assert deleted(sandbox) == ["notes.txt"]
    # A sandbox named on the context wins over the environment.
    other = fresh_sandbox(tmp_path / "other")
    ctx = make_ctx()
    ctx.sandbox = other  # type: ignore[attr-defined]
    assert "notes.txt" in await files.list_files({}, ctx)
    assert "worker 7" in await files.read_file({"path": "errors.log"}, ctx)
    assert os.environ[files.SANDBOX_ENV] == str(sandbox.root)
