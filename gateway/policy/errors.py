"""What goes wrong when a policy is read: always a file, a line, a field and a sentence."""

from __future__ import annotations

from collections.abc import Sequence

FieldPath = tuple[str | int, ...]


def format_path(path: FieldPath) -> str:
    """`("tools", 2, "executor")` -> `tools[2].executor`; the empty path is the document."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(document)"


class PolicyError(ValueError):
    """One thing wrong with one policy file.

    `str()` reads `policies/files.yaml:12: tools[1].timeout_s: must be a positive number, got -3`.
    """

    def __init__(self, file: str, line: int | None, path: FieldPath, problem: str) -> None:
        self.file = file
        self.line = line
        self.path = path
        self.problem = problem
        super().__init__(self.describe())

    @property
    def field(self) -> str:
        return format_path(self.path)

    def describe(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{where}: {self.field}: {self.problem}"

    def each(self) -> tuple[PolicyError, ...]:
        """The errors this one stands for (itself; every error of its file for `PolicyErrors`)."""
        return (self,)


class PolicyErrors(PolicyError):
    """Every error found in one policy file (the first one's fields are this error's).
    `str()` is one line per error."""

    def __init__(self, errors: Sequence[PolicyError]) -> None:
        self.errors: tuple[PolicyError, ...] = tuple(e for error in errors for e in error.each())
        first = self.errors[0]
        super().__init__(first.file, first.line, first.path, first.problem)

    def describe(self) -> str:
        return "\n".join(e.describe() for e in self.errors)

    def each(self) -> tuple[PolicyError, ...]:
        return self.errors


class PolicySetError(ValueError):
    """A set of policy files that cannot be loaded together; nothing of it was applied."""

    def __init__(self, errors: Sequence[PolicyError]) -> None:
        self.errors: tuple[PolicyError, ...] = tuple(errors)
        lines = "\n".join(f"  {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} policy error(s), no policy was changed:\n{lines}")
