"""A cursor over a parsed YAML document that knows its own field path.

Validation reads `at.get("teams").list_of()[0].get("budget_usd").optional_number_or_none()`
and any failure is a `ConfigError("config.yaml", "teams[0].budget_usd", "must be ...")`.

A document read with a `sink` (`Field.root`) reports every error of the file at once: a
reader with a default (`optional_*`, `choice`, `keys_only`) and `invalid()` note the error
in the sink and go on with the default; what cannot go on (`fail`, a required field, a
value of the wrong shape) raises, and the caller (`Errors.take`) notes it and skips that
part. `Errors.raise_any` then raises them all as one `ConfigErrors`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

_MISSING = object()
S = TypeVar("S", bound=str)
T = TypeVar("T")


class ConfigError(ValueError):
    """A config file that cannot be used: names the file, the field and what is wrong."""

    def __init__(self, file: str, path: str, problem: str) -> None:
        where = f"{file}: {path}" if path else file
        super().__init__(f"{where}: {problem}")
        self.file = file
        self.path = path
        self.problem = problem


class ConfigErrors(ConfigError):
    """Every error found in one file (the first one's fields are this error's). `str()` is
    one line per error."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        flat = [e for error in errors for e in (error.errors if isinstance(error, ConfigErrors) else (error,))]
        first = flat[0]
        super().__init__(first.file, first.path, first.problem)
        self.errors: tuple[ConfigError, ...] = tuple(flat)

    def __str__(self) -> str:
        return "\n".join(ValueError.__str__(e) for e in self.errors)


class Errors:
    """The errors found so far in one file (a `Field`'s sink)."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def take(self, read: Callable[[], T], default: T) -> T:
        """`read()`, or `default` when it raised: its error is noted and reading goes on."""
        try:
            return read()
        except ConfigErrors as exc:
            self.found.extend(exc.errors)
        except ConfigError as exc:
            self.found.append(exc)
        return default

    def raise_any(self) -> None:
        if self.found:
            raise self.found[0] if len(self.found) == 1 else ConfigErrors(self.found)


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

    __slots__ = ("file", "path", "value", "sink")

    def __init__(self, file: str, path: str, value: Any = _MISSING, sink: Errors | None = None) -> None:
        self.file = file
        self.path = path
        self.value = value
        self.sink = sink
        """Where errors that reading can go on after are noted (None: every error raises)."""

    @property
    def missing(self) -> bool:
        return self.value is _MISSING

    def fail(self, problem: str) -> NoReturn:
        raise ConfigError(self.file, self.path, problem)

    def invalid(self, problem: str) -> None:
        """An error reading can go on after: noted in the sink (raised without one)."""
        if self.sink is None:
            self.fail(problem)
        self.sink.found.append(ConfigError(self.file, self.path, problem))

    def get(self, key: str) -> Field:
        value = self.mapping().get(key, _MISSING)
        return Field(self.file, f"{self.path}.{key}" if self.path else key, value, self.sink)

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
                Field(self.file, where, None, self.sink).invalid(
                    f"unknown field; expected one of {', '.join(sorted(allowed))}")

    def required(self) -> Field:
        if self.missing:
            self.fail("is required")
        return self

    def list_of(self) -> list[Field]:
        if self.missing:
            return []
        if not isinstance(self.value, list):
            self.fail(f"must be a list, got {_kind(self.value)}")
        return [Field(self.file, f"{self.path}[{i}]", v, self.sink) for i, v in enumerate(self.value)]

    def each(self, read: Callable[[Field], object]) -> None:
        """`read(entry)` for every entry of a list; with a sink, an entry whose read raised is
        noted and the next one read."""
        for item in self.list_of():
            if self.sink is None:
                read(item)
            else:
                self.sink.take(lambda: read(item), None)

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
            self.invalid(f"must be true or false, got {_kind(self.value)}")
            return default
        return self.value

    def choice(self, options: Sequence[S], default: S) -> S:
        if self.missing or self.value is None:
            return default
        for option in options:
            if self.value == option:
                return option
        self.invalid(f"must be one of {', '.join(options)}, got {_kind(self.value)}")
        return default

    def optional_int(self, default: int, *, low: int | None = None, high: int | None = None) -> int:
        if self.missing or self.value is None:
            return default
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int):
            self.invalid(f"must be an integer, got {_kind(value)}")
        elif low is not None and value < low:
            self.invalid(f"must be >= {low}, got {value}")
        elif high is not None and value > high:
            self.invalid(f"must be <= {high}, got {value}")
        else:
            return value
        return default

    def optional_number(self, default: float, *, positive: bool = False, nonnegative: bool = False) -> float:
        value = self.optional_number_or_none(positive=positive, nonnegative=nonnegative)
        return default if value is None else value

    def optional_number_or_none(self, *, positive: bool = False, nonnegative: bool = False) -> float | None:
        """The number, or None when absent, null, or (with a sink) invalid: then the default."""
        if self.missing or self.value is None:
            return None
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.invalid(f"must be a number, got {_kind(value)}")
        elif positive and value <= 0:
            self.invalid(f"must be > 0, got {value}")
        elif nonnegative and value < 0:
            self.invalid(f"must be >= 0, got {value}")
        else:
            return float(value)
        return None
