"""Names in a policy file that point at Python objects: executors and exception classes.

How `module:function` (and `module:Class`) is found, the rule of docs/policies.md: Python
imports the module as usual, from the gateway's own module path (its packages, the
installed libraries, `PYTHONPATH`), then from the policy's folders (`search`): the policy
file's own folder, then each `python_path` entry of the policy. A policy's folders come
last, so a module of theirs never replaces a library the gateway itself uses; a policy
module whose name another module already has is an error naming both. Module names are
shared by the whole process: give a policy's modules names of their own.
"""

from __future__ import annotations

import builtins
import importlib
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_PATH_LOCK = threading.Lock()  # policies may load on a reload thread while another resolves


class ResolveError(ValueError):
    """A name that does not lead to the object it should."""


def _search_from(search: Sequence[Path]) -> None:
    """Append the policy's folders to the module path (once each, after what is there)."""
    with _PATH_LOCK:
        added = False
        for folder in search:
            text = str(folder)
            if text not in sys.path:
                sys.path.append(text)
                added = True
        if added:
            importlib.invalidate_caches()


def _candidate(top: str, search: Sequence[Path]) -> Path | None:
    """The module or package `top` in one of the policy's folders, if there is one."""
    for folder in search:
        for path in (folder / f"{top}.py", folder / top / "__init__.py"):
            if path.is_file():
                return path
    return None


def _where(search: Sequence[Path]) -> str:
    folders = ", ".join(str(f) for f in search)
    return f"looked in the gateway's module path, then {folders}" if folders else "looked in the gateway's module path"


def _import_attr(target: str, search: Sequence[Path] = ()) -> Any:
    if not _TARGET.match(target):
        raise ResolveError(f"'{target}' is not of the form 'package.module:name'")
    module_name, _, attr = target.partition(":")
    _search_from(search)
    top = module_name.split(".")[0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):  # the module itself, not one it imports
            raise ResolveError(f"cannot import module '{module_name}': no module named '{exc.name}' "
                               f"({_where(search)})") from None
        raise ResolveError(f"cannot import module '{module_name}': {exc}") from exc
    except Exception as exc:  # the module's own code failed: its author needs the reason
        raise ResolveError(f"cannot import module '{module_name}': {type(exc).__name__}: {exc}") from exc
    mine = _candidate(top, search)
    loaded = getattr(sys.modules.get(top), "__file__", None)
    if mine is not None and loaded is not None and os.path.realpath(loaded) != os.path.realpath(mine):
        raise ResolveError(f"module '{top}' is {loaded}, not this policy's {mine}: another module has the name "
                           f"(module names are shared by the whole gateway); rename the policy's module")
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ResolveError(f"module '{module_name}' has no attribute '{attr}'") from None
    return obj


def resolve_callable(target: str, search: Sequence[Path] = ()) -> Callable[..., Any]:
    """`"package.module:function"` -> the function (sync or async); `search`: the policy's folders."""
    obj = _import_attr(target, search)
    if not callable(obj):
        raise ResolveError(f"'{target}' is not callable")
    func: Callable[..., Any] = obj
    return func


def resolve_exception(name: str, search: Sequence[Path] = ()) -> type[BaseException]:
    """`PermissionError` (a builtin) or `"package.module:Class"` -> the exception class."""
    obj: Any = getattr(builtins, name, None) if ":" not in name else _import_attr(name, search)
    if obj is None:
        raise ResolveError(f"'{name}' is not a builtin exception; name others as 'package.module:Class'")
    if not (isinstance(obj, type) and issubclass(obj, BaseException)):
        raise ResolveError(f"'{name}' is not an exception class")
    return obj
