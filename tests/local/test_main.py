"""`gateway local` failing early and clearly, without a model (no [local] extra needed)."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

from gateway.cli import main
from tests.support.procs import ROOT


def test_without_the_runtime_it_names_the_extra(tmp_path: Path) -> None:
    # A real interpreter with nothing installed: the situation of a user who skipped the extra.
    venv.EnvBuilder(with_pip=False).create(tmp_path / "bare")
    python = tmp_path / "bare" / "bin" / "python"
    cache = tmp_path / "cache"

    done = subprocess.run([str(python), "-m", "gateway", "local", "--cache-dir", str(cache)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)

    assert done.returncode == 2, done.stderr
    assert "xllamacpp is not installed" in done.stderr
    assert "pip install '.[local]'" in done.stderr
    assert not cache.exists(), "no assembly is attempted without a runtime to serve it"


@pytest.mark.parametrize("argv, problem", [
    (["--threads", "0"], "--threads must be at least 1, not 0"),
    (["--port", "70000"], "--port must be between 0 and 65535, not 70000"),
])
def test_bad_flags_are_named(argv: list[str], problem: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--cache-dir", str(tmp_path), *argv]) == 2
    assert problem in capsys.readouterr().err


def test_unknown_model_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["local", "--model", "7b"])
    assert exit_.value.code == 2
    assert "invalid choice: '7b'" in capsys.readouterr().err


def test_the_prompt_cache_is_on_unless_turned_off() -> None:
    from gateway.cli import build_parser
    from gateway.local.server import ServerSettings

    assert build_parser().parse_args(["local"]).no_prompt_cache is False
    assert build_parser().parse_args(["local", "--no-prompt-cache"]).no_prompt_cache is True
    assert ServerSettings(model_path=Path("m.gguf"), alias="m", chat_template="").prompt_cache is True
