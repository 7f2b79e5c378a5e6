"""Names in a policy file that point at Python objects: executors and exception classes."""

from __future__ import annotations

import builtins
import importlib
import re
from collections.abc import Callable
from typing import Any

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ResolveError(ValueError):
    """A name that does not lead to the object it should."""


def _import_attr(target: str) -> Any:
    if not _TARGET.match(target):
        raise ResolveError(f"'{target}' is not of the form 'package.module:name'")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ResolveError(f"cannot import module '{module_name}': {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ResolveError(f"module '{module_name}' has no attribute '{attr}'") from None
    return obj


def resolve_callable(target: str) -> Callable[..., Any]:
    """`"package.module:function"` -> the function (sync or async)."""
    obj = _import_attr(target)
    if not callable(obj):
        raise ResolveError(f"'{target}' is not callable")
    func: Callable[..., Any] = obj
    return func


def resolve_exception(name: str) -> type[BaseException]:
    """`PermissionError` (a builtin) or `"package.module:Class"` -> the exception class."""
    obj: Any = getattr(builtins, name, None) if ":" not in name else _import_attr(name)
    if obj is None:
        raise ResolveError(f"'{name}' is not a builtin exception; name others as 'package.module:Class'")
    if not (isinstance(obj, type) and issubclass(obj, BaseException)):
        raise ResolveError(f"'{name}' is not an exception class")
    return obj
