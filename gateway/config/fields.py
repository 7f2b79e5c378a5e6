"""A cursor over a parsed YAML document that knows its own field path.

Validation reads `at.get("teams").list_of()[0].get("budget_usd").optional_number_or_none()`
and any failure is a `ConfigError("config.yaml", "teams[0].budget_usd", "must be ...")`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

_MISSING = object()
S = TypeVar("S", bound=str)


class ConfigError(ValueError):
    """A config file that cannot be used: names the file, the field and what is wrong."""

    def __init__(self, file: str, path: str, problem: str) -> None:
        where = f"{file}: {path}" if path else file
        super().__init__(f"{where}: {problem}")
        self.file = file
        self.path = path
        self.problem = problem


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


class Field:
    """One value of the document and where it sits."""

    __slots__ = ("file", "path", "value")

    def __init__(self, file: str, path: str, value: Any = _MISSING) -> None:
        self.file = file
        self.path = path
        self.value = value

    @property
    def missing(self) -> bool:
        return self.value is _MISSING

    def fail(self, problem: str) -> NoReturn:
        raise ConfigError(self.file, self.path, problem)

    def get(self, key: str) -> Field:
        value = self.mapping().get(key, _MISSING)
        return Field(self.file, f"{self.path}.{key}" if self.path else key, value)

    def mapping(self) -> dict[str, Any]:
        if self.missing:
            return {}
        if not isinstance(self.value, dict):
            self.fail(f"must be a mapping, got {_kind(self.value)}")
        return self.value

    def keys_only(self, allowed: set[str]) -> None:
        """Unknown keys are refused: a typo must not silently mean 'use the default'."""
        for key in self.mapping():
            if key not in allowed:
                where = f"{self.path}.{key}" if self.path else str(key)
                raise ConfigError(self.file, where, f"unknown field; expected one of {', '.join(sorted(allowed))}")

    def required(self) -> Field:
        if self.missing:
            self.fail("is required")
        return self

    def list_of(self) -> list[Field]:
        if self.missing:
            return []
        if not isinstance(self.value, list):
            self.fail(f"must be a list, got {_kind(self.value)}")
        return [Field(self.file, f"{self.path}[{i}]", v) for i, v in enumerate(self.value)]

    def nonempty_str(self) -> str:
        if not isinstance(self.value, str) or not self.value.strip():
            self.fail(f"must be a non-empty string, got {_kind(self.value) if not self.missing else 'nothing'}")
        return self.value

    def optional_str(self, default: str) -> str:
        if self.missing or self.value is None:
            return default
        return self.nonempty_str()

    def optional_str_or_none(self) -> str | None:
        if self.missing or self.value is None:
            return None
        return self.nonempty_str()

    def optional_bool(self, default: bool) -> bool:
        if self.missing or self.value is None:
            return default
        if not isinstance(self.value, bool):
            self.fail(f"must be true or false, got {_kind(self.value)}")
        return self.value

    def choice(self, options: Sequence[S], default: S) -> S:
        if self.missing or self.value is None:
            return default
        for option in options:
            if self.value == option:
                return option
        self.fail(f"must be one of {', '.join(options)}, got {_kind(self.value)}")

    def optional_int(self, default: int, *, low: int | None = None, high: int | None = None) -> int:
        if self.missing or self.value is None:
            return default
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"must be an integer, got {_kind(value)}")
        if low is not None and value < low:
            self.fail(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            self.fail(f"must be <= {high}, got {value}")
        return value

    def optional_number(self, default: float, *, positive: bool = False, nonnegative: bool = False) -> float:
        value = self.optional_number_or_none(positive=positive, nonnegative=nonnegative)
        return default if value is None else value

    def optional_number_or_none(self, *, positive: bool = False, nonnegative: bool = False) -> float | None:
        if self.missing or self.value is None:
            return None
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"must be a number, got {_kind(value)}")
        if positive and value <= 0:
            self.fail(f"must be > 0, got {value}")
        if nonnegative and value < 0:
            self.fail(f"must be >= 0, got {value}")
        return float(value)
