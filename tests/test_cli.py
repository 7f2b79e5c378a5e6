"""The `gateway` command line as a user meets it: --version, and help for every option."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gateway import __version__
from gateway.cli import build_parser
from tests.support.procs import run_gateway


def test_version_is_the_packages() -> None:
    done = run_gateway(["--version"])
    assert done.returncode == 0 and done.stdout.strip() == f"gateway {__version__}", done
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(__version__)}"$', pyproject, re.MULTILINE)


def _parsers(parser: argparse.ArgumentParser, path: str = "gateway") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def test_every_option_of_every_command_says_what_it_does() -> None:
    missing = [f"{path} {'/'.join(action.option_strings) or action.dest}"
               for path, parser in _parsers(build_parser()) for action in parser._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and action.help != argparse.SUPPRESS and not action.help]
    assert not missing, missing


def test_help_says_what_the_demo_shows() -> None:
    done = run_gateway(["--help"])
    assert done.returncode == 0 and "chapter" not in done.stdout
    assert "scripted models" in done.stdout and "--version" in done.stdout
    scripted = run_gateway(["scripted", "--help"])
    assert "address to listen on" in scripted.stdout and "port to listen on" in scripted.stdout
