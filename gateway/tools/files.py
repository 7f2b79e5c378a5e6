"""The four file tools (list, read, delete, scan), bound to a sandbox folder that paths cannot escape.

`fresh_sandbox()` copies the packaged sample (errors.log, access.log, notes.txt) to a new
folder, so runs never touch the repository. `Sandbox` holds the tools as methods;
`file_tools()` binds them to the specs of gateway.tools.catalog. Policies that name an
executor such as `gateway.tools.files:read_file` get the module-level functions, which find
their folder with `sandbox_for(ctx)`.

Rules the demo's experiments rely on:
- a path outside the folder (`../..`, absolute, a symlink pointing out) raises
  PermissionError, a *permanent* error: no retry can fix it;
- a missing file raises FileNotFoundError whose text tells the model what to do next;
- every executed delete is appended to `.deleted.jsonl` (hidden from list_files) with the
  call's idempotency key; the same key again is a no-op returning the first answer;
- scan_archive waits on `ctx.cancelled` between steps, so a Stop ends it within ms.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from gateway.harness.tools import Tool, ToolContext, ToolError, ToolFunction, ToolSpec
from gateway.tools.catalog import DELETE_FILE, LIST_FILES, READ_FILE, SCAN_ARCHIVE

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "data"
SAMPLE = SAMPLES_DIR / "sandbox"
JOURNAL = ".deleted.jsonl"
SANDBOX_ENV = "GATEWAY_SANDBOX"
MAX_READ_BYTES = 64_000


def fresh_sandbox(dest_parent: Path, sample: Path = SAMPLE) -> Path:
    """Copy the sample folder into a new folder under `dest_parent` and return it."""
    if not sample.is_dir():
        raise FileNotFoundError(f"sample sandbox {sample} does not exist")
    dest_parent.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix="sandbox-", dir=dest_parent))
    for item in sorted(sample.iterdir()):
        if item.is_file() and not item.name.startswith("."):
            shutil.copyfile(item, dest / item.name)
    return dest


def _outside(path: str) -> PermissionError:
    return PermissionError(f"permission denied: {path} is outside the working folder")


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(f"no such file: {path}. Call list_files to see what exists.")


def _path_arg(tool: str, args: Mapping[str, Any]) -> str:
    path = args.get("path") if isinstance(args, Mapping) else None
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f'{tool} needs a "path" argument: the name of a file in the working folder')
    return path


async def _cancelled_within(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `event`; True as soon as it is set."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout))
    except TimeoutError:
        return False
    return True


class Sandbox:
    """A folder the file tools work in. Every path is resolved inside `root` or refused.

    `scan_*` shape the simulated archive scan (by default: 1,200 files in 3 s,
    progress every 200); tests shrink `scan_seconds`.
    """

    def __init__(self, root: Path, *, scan_files: int = 1200, scan_every: int = 200,
                 scan_seconds: float = 3.0) -> None:
        if scan_files <= 0 or scan_every <= 0 or scan_seconds < 0:
            raise ValueError("scan_files and scan_every must be positive, scan_seconds not negative")
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"sandbox folder {self.root} does not exist")
        self.scan_files = scan_files
        self.scan_every = scan_every
        self.scan_seconds = scan_seconds

    @property
    def journal(self) -> Path:
        return self.root / JOURNAL

    def resolve(self, path: str) -> Path:
        """The absolute file `path` names inside the folder, symlinks followed; else PermissionError."""
        if "\x00" in path:
            raise ValueError(f"invalid file name: {path!r}")
        if Path(path).is_absolute() or path.startswith("~"):
            raise _outside(path)
        target = (self.root / path).resolve()
        if target != self.root and not target.is_relative_to(self.root):
            raise _outside(path)
        return target

    def _visible(self, target: Path) -> bool:
        return target.is_file() and not any(p.startswith(".") for p in target.relative_to(self.root).parts)

    def files(self) -> list[tuple[str, int]]:
        """(name relative to the folder, size in bytes) of every visible file, sorted by name."""
        out = []
        for item in self.root.rglob("*"):
            try:
                target = item.resolve()
                if target.is_relative_to(self.root) and self._visible(target):
                    out.append((item.relative_to(self.root).as_posix(), target.stat().st_size))
            except OSError:
                continue  # vanished meanwhile: not listed
        return sorted(out)

    async def list_files(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        """One `name  size bytes` line per file, sorted, then a total line."""
        files = self.files()
        if not files:
            return "The working folder is empty."
        lines = [f"{name}  {size} bytes" for name, size in files]
        count = len(files)
        lines.append(f"{count} file{'' if count == 1 else 's'}, {sum(s for _, s in files)} bytes in total")
        return "\n".join(lines)

    async def read_file(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        """The text of one file (the first MAX_READ_BYTES of it)."""
        path = _path_arg("read_file", args)
        target = self.resolve(path)
        if target.is_dir():
            raise IsADirectoryError(f"{path} is a folder, not a file. Call list_files to see what exists.")
        if not self._visible(target):
            raise _missing(path)
        with target.open("rb") as fh:
            data = fh.read(MAX_READ_BYTES + 1)
        text = data[:MAX_READ_BYTES].decode("utf-8", errors="replace")
        if len(data) > MAX_READ_BYTES:
            text += f"\n[truncated: only the first {MAX_READ_BYTES} bytes are shown]"
        return text

    async def delete_file(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        """Delete a file once per idempotency key, journaling every executed delete."""
        path = _path_arg("delete_file", args)
        target = self.resolve(path)
        rel = target.relative_to(self.root).as_posix()
        key = ctx.idempotency_key
        # The lock spans check-and-write so two processes sharing a folder cannot both
        # act on the same key.
        with self.journal.open("a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.seek(0)
            entries = [orjson.loads(line) for line in fh.read().splitlines() if line.strip()]
            for entry in entries:
                if entry.get("key") == key:
                    return str(entry["answer"])
            if self._visible(target):
                target.unlink()
                answer = f"Deleted {rel}."
            elif any(entry.get("path") == rel for entry in entries):
                answer = f"{rel} was already deleted."
            else:
                raise _missing(path)
            record = {"path": rel, "key": key, "run_id": ctx.run_id, "call_id": ctx.call_id,
                      "answer": answer, "at": time.time()}
            fh.write(orjson.dumps(record) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        return answer

    async def scan_archive(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        """Scan the (simulated) archive step by step; a Stop ends it between two steps."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        step_s = self.scan_seconds * self.scan_every / self.scan_files
        scanned = 0
        while scanned < self.scan_files:
            step = min(self.scan_every, self.scan_files - scanned)
            deadline = started + step_s * (scanned + step) / self.scan_every
            if await _cancelled_within(ctx.cancelled, deadline - loop.time()):
                raise ToolError(f"scan_archive was cancelled after {scanned} of {self.scan_files} files")
            scanned += step
            ctx.progress(f"scanned {scanned} of {self.scan_files} files")
        return (f"Scanned {self.scan_files} archived files: 3 contain errors, "
                "the latest says worker 7 timed out after 30000 ms.")


def deleted(sandbox: Sandbox) -> list[str]:
    """The journal's paths in order: one entry per executed delete, repeats included."""
    if not sandbox.journal.exists():
        return []
    lines = sandbox.journal.read_bytes().splitlines()
    return [str(orjson.loads(line)["path"]) for line in lines if line.strip()]


def file_tools(sandbox: Sandbox) -> dict[str, Tool]:
    """The file tools bound to `sandbox`, keyed by tool name."""
    bound: list[tuple[ToolSpec, ToolFunction]] = [
        (LIST_FILES, sandbox.list_files),
        (READ_FILE, sandbox.read_file),
        (DELETE_FILE, sandbox.delete_file),
        (SCAN_ARCHIVE, sandbox.scan_archive),
    ]
    return {spec.name: Tool(spec, run) for spec, run in bound}


def sandbox_for(ctx: ToolContext) -> Sandbox:
    """The sandbox a module-level tool call works in.

    First `ctx.sandbox` if the caller put one on the context (a `Sandbox`, or a folder path),
    else the folder named by the GATEWAY_SANDBOX environment variable. There is no default:
    a tool must never fall back to the packaged sample (or the repository).
    """
    given = getattr(ctx, "sandbox", None)
    if isinstance(given, Sandbox):
        return given
    if isinstance(given, (str, Path)) and str(given):
        return Sandbox(Path(given))
    env = os.environ.get(SANDBOX_ENV)
    if env:
        return Sandbox(Path(env))
    raise RuntimeError(f"no sandbox folder for {ctx.tool_name}: set ctx.sandbox or the {SANDBOX_ENV} variable")


async def list_files(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Executor entry point: `Sandbox.list_files` in `sandbox_for(ctx)`."""
    return await sandbox_for(ctx).list_files(args, ctx)


async def read_file(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Executor entry point: `Sandbox.read_file` in `sandbox_for(ctx)`."""
    return await sandbox_for(ctx).read_file(args, ctx)


async def delete_file(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Executor entry point: `Sandbox.delete_file` in `sandbox_for(ctx)`."""
    return await sandbox_for(ctx).delete_file(args, ctx)


async def scan_archive(args: Mapping[str, Any], ctx: ToolContext) -> str:
    """Executor entry point: `Sandbox.scan_archive` in `sandbox_for(ctx)`."""
    return await sandbox_for(ctx).scan_archive(args, ctx)
