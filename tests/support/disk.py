"""A small file system of a test's own, to fill: a tmpfs mounted for it (Linux, as root).

`small_disk(folder, size)` mounts a tmpfs of `size` (e.g. "8m") at `folder` and unmounts it
at the end; where mounting is not permitted (not root, no CAP_SYS_ADMIN, not Linux) the
test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `folder` (made if missing) for the block's duration."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def fill(path: Path) -> int:
    """Write zeros to `path` until the file system is full; returns how many bytes fit."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        block = b"\0" * 65536
        while True:
            try:
                written += os.write(fd, block)
            except OSError:
                if len(block) == 1:
                    return written
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
