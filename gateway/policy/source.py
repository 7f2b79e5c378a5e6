"""A YAML document that remembers where every field came from.

The loader composes YAML's node tree once, keeps the line of every field path, and
hands out `At` views: a value plus its path, with typed readers that fail with a
`PolicyError` naming the file, the line and the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import yaml

from gateway.config.yamlfile import parse
from gateway.policy.errors import FieldPath, PolicyError, PolicyErrors, format_path

T = TypeVar("T")


class Source:
    """One parsed file: its data, and a map from field path to 1-based line."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.errors: list[PolicyError] = []
        """Errors reading went on after (`take`, `At.fields`); `raise_any` raises them."""
        self._lines: dict[FieldPath, int] = {}
        try:
            self.data: Any = parse(text, self._compose)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            context = exc.context or ""
            if exc.context and exc.context_mark is not None and exc.context_mark is not mark:
                context += f" (line {exc.context_mark.line + 1})"
            problem = ": ".join(p for p in (context, exc.problem) if p)
            raise PolicyError(file, line, (), f"not valid YAML: {problem}") from exc
        except yaml.YAMLError as exc:
            raise PolicyError(file, None, (), f"not valid YAML: {exc}") from exc

    def _compose(self, loader: yaml.SafeLoader) -> Any:
        self._lines.clear()
        node = loader.get_single_node()
        if node is None:
            raise PolicyError(self.file, 1, (), "the file is empty; a policy is a YAML mapping")
        self._index(node, ())
        return loader.construct_document(node)

    def _index(self, node: yaml.Node, path: FieldPath) -> None:
        self._lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                child = (*path, key)
                if key in seen:
                    raise PolicyError(self.file, key_node.start_mark.line + 1, child, "duplicate key")
                seen.add(key)
                self._lines[child] = key_node.start_mark.line + 1
                self._index(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._index(item, (*path, i))

    def line(self, path: FieldPath) -> int | None:
        """The line of `path`, or of its nearest ancestor present in the file."""
        for n in range(len(path), -1, -1):
            line = self._lines.get(path[:n])
            if line is not None:
                return line
        return None

    def error(self, path: FieldPath, problem: str) -> PolicyError:
        return PolicyError(self.file, self.line(path), path, problem)

    def take(self, read: Callable[[], T], default: T) -> T:
        """`read()`, or `default` when it raised: its error is noted and reading goes on, so
        a file's every error is reported at once."""
        try:
            return read()
        except PolicyError as exc:
            self.errors.extend(exc.each())
        return default

    def raise_any(self) -> None:
        """Raise the errors noted so far, in the order of their lines."""
        if self.errors:
            ordered = sorted(self.errors, key=lambda e: e.line or 0)
            raise ordered[0] if len(ordered) == 1 else PolicyErrors(ordered)

    def root(self) -> At:
        return At(self, (), self.data)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


@dataclass(frozen=True)
class At:
    """A value found at a field path of a source."""

    src: Source
    path: FieldPath
    value: Any

    def fail(self, problem: str) -> NoReturn:
        raise self.src.error(self.path, problem)

    def child(self, key: str | int, value: Any) -> At:
        return At(self.src, (*self.path, key), value)

    def fields(self, allowed: Collection[str], required: Collection[str] = ()) -> Fields:
        """Read a mapping whose keys must be among `allowed` and include `required`."""
        if not isinstance(self.value, dict):
            self.fail(f"must be a mapping, got {_kind(self.value)}")
        for key in self.value:  # each unknown field is noted, and reading goes on
            if key not in allowed:
                expected = ", ".join(sorted(allowed))
                self.src.errors.append(self.src.error((*self.path, str(key)), f"unknown field (expected one of: {expected})"))
        for key in required:
            if key not in self.value:
                self.fail(f"missing required field '{key}'")
        return Fields(self)

    def each(self, read: Callable[[At], T]) -> list[T]:
        """`read(entry)` of every entry of a list; an entry whose read raised is noted and left out."""
        out: list[T] = []
        for item in self.items():
            self.src.take(lambda: out.append(read(item)), None)
        return out

    def items(self) -> Iterator[At]:
        """The entries of a list (a missing or null list is empty)."""
        if self.value is None:
            return iter(())
        if not isinstance(self.value, list):
            self.fail(f"must be a list, got {_kind(self.value)}")
        return (self.child(i, v) for i, v in enumerate(self.value))

    def string(self, *, non_empty: bool = True) -> str:
        if not isinstance(self.value, str):
            self.fail(f"must be a string, got {_kind(self.value)}")
        if non_empty and not self.value.strip():
            self.fail("must not be empty")
        return self.value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            self.fail(f"must be true or false, got {_kind(self.value)}")
        return self.value

    def positive_int(self) -> int:
        if isinstance(self.value, bool) or not isinstance(self.value, int) or self.value < 1:
            self.fail(f"must be a whole number of at least 1, got {_kind(self.value)}")
        return self.value

    def positive_number(self) -> float:
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            self.fail(f"must be a positive number, got {_kind(value)}")
        return float(value)

    def choice(self, options: Collection[str]) -> str:
        if self.value not in options:
            self.fail(f"must be one of {', '.join(options)}, got {_kind(self.value)}")
        return str(self.value)

    @property
    def field(self) -> str:
        return format_path(self.path)


@dataclass(frozen=True)
class Fields:
    """The fields of a mapping `At`, read one by one."""

    at: At

    def has(self, key: str) -> bool:
        return key in self.at.value

    def get(self, key: str) -> At | None:
        """The field, or None when absent or null (null means "use the default")."""
        value = self.at.value.get(key)
        return None if value is None else self.at.child(key, value)

    def req(self, key: str) -> At:
        if key not in self.at.value or self.at.value[key] is None:
            self.at.fail(f"missing required field '{key}'")
        return self.at.child(key, self.at.value[key])
