"""Where a policy's file tools work: a fresh copy of a packaged sample, or a named folder.

A policy says `sandbox: {sample: chapter}` (each run gets its own copy of the packaged
sample folder, so no run sees another's deletions) or `sandbox: {path: ./dir}` (every run
works in that folder). Sub-runs share their parent's folder, so a run needs a sandbox
when its policy, or any policy reachable through its agent tools, declares one.
"""

from __future__ import annotations

from pathlib import Path

from gateway.policy.decl import AgentExecutor, Policy, SandboxConfig
from gateway.policy.registry import PolicyRegistry
from gateway.policy.schema import sample_names


def sandbox_config(policy: Policy, registry: PolicyRegistry | None = None) -> SandboxConfig | None:
    """The policy's sandbox, or the first one declared by a policy its agent tools run."""
    seen: set[str] = set()
    todo = [policy]
    while todo:
        current = todo.pop(0)
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.sandbox is not None:
            return current.sandbox
        for tool in current.tools:
            if isinstance(tool.executor, AgentExecutor) and registry is not None:
                child = registry.get(tool.executor.policy)
                if child is not None:
                    todo.append(child)
    return None


def prepare_sandbox(config: SandboxConfig, runs_dir: Path, *, base_dir: Path | None = None) -> Path:
    """The folder a new run works in: a fresh copy of the sample under `runs_dir`, or the
    configured path (relative paths are taken from `base_dir`, default the current folder)."""
    if config.path is not None:
        folder = Path(config.path)
        if not folder.is_absolute() and base_dir is not None:
            folder = base_dir / folder
        if not folder.is_dir():
            raise FileNotFoundError(f"sandbox folder {folder} does not exist")
        return folder.resolve()
    from gateway.tools.files import (
        fresh_sandbox,  # the file tools own how a sample is copied
    )

    samples = sample_names()
    if config.sample not in samples:
        raise FileNotFoundError(f"no packaged sample named {config.sample!r} (known: {', '.join(samples)})")
    return fresh_sandbox(runs_dir, samples[config.sample])
