"""Fixtures for the policy tests: a policy directory to write files into."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

WriteFile = Callable[[str, str], Path]


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    d = tmp_path / "policies"
    d.mkdir()
    return d


@pytest.fixture
def write(policy_dir: Path) -> WriteFile:
    """write("name.yaml", yaml_text) -> path (the text is dedented)."""

    def _write(name: str, text: str) -> Path:
        path = policy_dir / name
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return path

    return _write
