"""The set of policies a gateway serves, reloadable without a restart.

A (re)load reads every `*.yaml`/`*.yml` file of the directory and swaps the whole set
only if all of them are valid and consistent (unique names, agent executors naming
policies that exist); otherwise the previous set stays and the errors name the files.
Every version ever loaded stays reachable by `(name, version)`, so a run keeps the
policy it started with even after the file is edited. A reload discovers the tools of
MCP servers again; a version covers the tools discovered, so a run keeps its tool list.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

from gateway.config.yamlfile import parse
from gateway.mcp.hub import McpHub
from gateway.policy.decl import AgentExecutor, Policy
from gateway.policy.errors import PolicyError, PolicySetError
from gateway.policy.mcp_source import start_servers
from gateway.policy.schema import load_policy
from gateway.policy.source import Source


@dataclass(frozen=True)
class ReloadResult:
    """What a reload did: the names now served, and why it refused (if it did)."""

    loaded: tuple[str, ...]
    errors: tuple[PolicyError, ...] = ()
    changed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "loaded": list(self.loaded),
            "changed": list(self.changed),
            "errors": [str(e) for e in self.errors],
        }


@dataclass(frozen=True)
class StagedSet:
    """A policy set loaded and checked, not served yet (`PolicyRegistry.commit` serves it)."""

    policies: Mapping[str, Policy]
    errors: tuple[PolicyError, ...] = ()


def policy_files(directory: Path) -> list[Path]:
    """The policy files of a directory, in name order."""
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def policy_names(directory: Path) -> set[str]:
    """The names the policy files of a folder declare (`name:`, else the file's stem), read
    without validating them: for a config check that names every missing policy at once."""
    names: set[str] = set()
    for file in policy_files(directory):
        try:
            data = parse(file.read_text("utf-8"), lambda loader: loader.get_single_data())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            data = None
        name = data.get("name") if isinstance(data, dict) else None
        names.add(name if isinstance(name, str) else file.stem)
    return names


def load_set(files: list[Path], known: Mapping[str, Policy] | None = None,
             mcp: McpHub | None = None) -> tuple[dict[str, Policy], list[PolicyError]]:
    """Load files as one set: every file's errors, then the checks across files.

    `known` are other policies agent executors may name (e.g. the siblings of a file
    checked alone); they are not part of the result. `mcp` discovers the tools of the
    policies' MCP servers.
    """
    policies: dict[str, Policy] = {}
    errors: list[PolicyError] = []
    if mcp is not None:
        start_servers(files, mcp)
    for file in files:
        try:
            policy = load_policy(file, mcp)
        except PolicyError as exc:
            errors.extend(exc.each())  # every error of the file
            continue
        if policy.name in policies:
            errors.append(PolicyError(str(file), _line(policy, ("name",)), ("name",),
                                      f"policy '{policy.name}' is already defined in {policies[policy.name].path}"))
            continue
        policies[policy.name] = policy
    for policy in policies.values():
        for i, tool in enumerate(policy.tools):
            ex = tool.executor
            if isinstance(ex, AgentExecutor) and ex.policy not in policies and ex.policy not in (known or {}):
                path: tuple[str | int, ...] = ("tools", i, "executor", "agent", "policy")
                errors.append(PolicyError(str(policy.path), _line(policy, path), path,
                                          f"no policy named '{ex.policy}' (known: {', '.join(sorted(policies))})"))
    return policies, errors


def _line(policy: Policy, path: tuple[str | int, ...]) -> int | None:
    try:
        return Source(str(policy.path), policy.path.read_text("utf-8")).line(path)
    except (OSError, ValueError):
        return None


class PolicyRegistry:
    """Policies by name (current) and by (name, version) (every version ever loaded)."""

    def __init__(self, directory: str | Path, mcp: McpHub | None = None) -> None:
        """`mcp`: the process's MCP sessions; each (re)load discovers the servers' tools through it."""
        self.directory = Path(directory)
        self.mcp = mcp
        self._reloading = threading.Lock()  # a reload may run in a worker thread (it can start MCP servers)
        self._current: Mapping[str, Policy] = MappingProxyType({})
        self._versions: dict[tuple[str, str], Policy] = {}

    def load(self) -> ReloadResult:
        """Load the directory; raises `PolicySetError` (and changes nothing) on any error."""
        result = self.reload()
        if result.errors:
            raise PolicySetError(result.errors)
        return result

    def reload(self, check: Callable[[Mapping[str, Policy]], Sequence[PolicyError]] | None = None) -> ReloadResult:
        """Load the directory again; on any error keep the current set and report why.

        `check` sees the new set before it is swapped in and may refuse it with errors of
        its own (e.g. a policy the config needs is gone), reported like a file's. Reloads
        run one at a time, from any thread.
        """
        with self._reloading:
            return self.commit(self.stage(check))

    def stage(self, check: Callable[[Mapping[str, Policy]], Sequence[PolicyError]] | None = None) -> StagedSet:
        """Load and check the directory without serving it yet (`commit` does), so a caller can
        swap it in together with something else (a config reload: `gateway.server.reload`)."""
        try:
            files = policy_files(self.directory)
        except OSError as exc:
            error = PolicyError(str(self.directory), None, (), f"cannot list the policy directory: {exc.strerror or exc}")
            return StagedSet({}, (error,))
        policies, errors = load_set(files, mcp=self.mcp)
        if not errors and check is not None:
            errors = list(check(policies))
        return StagedSet(policies, tuple(errors))

    def commit(self, staged: StagedSet) -> ReloadResult:
        """Serve a staged set (or, when it has errors, keep the current one and say why)."""
        if staged.errors:
            return ReloadResult(loaded=self.names(), errors=staged.errors)
        policies = staged.policies
        changed = tuple(
            name for name, p in sorted(policies.items())
            if name not in self._current or self._current[name].version != p.version
        ) + tuple(name for name in sorted(self._current) if name not in policies)
        for p in policies.values():
            self._versions.setdefault((p.name, p.version), p)
        self._current = MappingProxyType(dict(sorted(policies.items())))
        return ReloadResult(loaded=self.names(), changed=changed)

    def get(self, name: str) -> Policy | None:
        """The current version of a policy."""
        return self._current.get(name)

    def get_version(self, name: str, version: str) -> Policy | None:
        """A policy as it was when loaded with that version (for runs started under it)."""
        return self._versions.get((name, version))

    def for_run(self, name: str, version: str) -> Policy | None:
        """The policy that governs a run: the version it started under while this gateway has
        it loaded; else (restarted after the file changed) the current version of the same
        policy; None when no policy of that name is loaded any more. The one rule, for every
        caller (a chat call on the run, the runs API, the driver, recovery)."""
        return self._versions.get((name, version)) or self._current.get(name)

    def names_where(self, test: Callable[[Policy], bool]) -> frozenset[str]:
        """The names of the policies of which some version this gateway has loaded (current or
        kept for its runs, see `for_run`) passes `test`: the runs a scan must look at."""
        return frozenset(p.name for p in (*self._versions.values(), *self._current.values()) if test(p))

    def version_of(self, name: str) -> str | None:
        policy = self._current.get(name)
        return policy.version if policy else None

    def names(self) -> tuple[str, ...]:
        return tuple(self._current)

    def __contains__(self, name: object) -> bool:
        return name in self._current

    def all(self) -> tuple[Policy, ...]:
        """The current policies, in name order."""
        return tuple(self._current.values())
