"""The YAML parser of every file the gateway reads (config, policies)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import yaml

T = TypeVar("T")

FAST_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML has it (its wheels do): the same documents and marks,
parsed several times faster at every start and reload."""


def parse(text: str, use: Callable[[yaml.SafeLoader], T]) -> T:
    """`use(loader)` on a safe loader of `text`. When the text is not valid YAML, it is read
    again by the pure-Python loader, whose errors name the problem better (the character
    that cannot start a token, the undefined alias), and that error is raised."""
    loader = FAST_LOADER(text)
    try:
        return use(loader)
    except yaml.YAMLError:
        if FAST_LOADER is yaml.SafeLoader:
            raise
    finally:
        loader.dispose()
    loader = yaml.SafeLoader(text)
    try:
        return use(loader)
    finally:
        loader.dispose()
