"""The central approval policy: ordered rules over tool names and argument globs.

A call is matched against the rules in order; the first match decides (allow, deny with
a reason, or ask a person). When no rule matches, the tool's own `needs_approval` flag
decides. Who may decide is a list of teams; a pending decision may expire, and an
expired one ends as a rejection written into the transcript in words.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.harness.approvals import EXPIRY
from gateway.harness.options import Verdict, default_approval
from gateway.harness.state import Decision
from gateway.harness.tools import ToolSpec
from gateway.policy.decl import ApprovalConfig, Rule, arg_text


def rule_matches(rule: Rule, spec: ToolSpec, args: Mapping[str, Any]) -> bool:
    """Tool glob, read-only and destructive filters, then every argument glob (a missing argument never matches)."""
    if not fnmatch.fnmatchcase(spec.name, rule.tool):
        return False
    if rule.read_only is not None and rule.read_only != spec.read_only:
        return False
    if rule.destructive is not None and rule.destructive != spec.destructive:
        return False
    return all(key in args and fnmatch.fnmatchcase(arg_text(args[key]), glob) for key, glob in rule.args.items())


@dataclass(frozen=True)
class RuleApproval:
    """An `ApprovalPolicy` (the harness's protocol) compiled from a policy's rules."""

    rules: tuple[Rule, ...]

    def __call__(self, spec: ToolSpec, args: Mapping[str, Any]) -> Verdict:
        return self.explain(spec, args)[0]

    def explain(self, spec: ToolSpec, args: Mapping[str, Any]) -> tuple[Verdict, int | None]:
        """The verdict and the index of the rule that gave it (None: the tool's own flag)."""
        for i, rule in enumerate(self.rules):
            if rule_matches(rule, spec, args):
                reason = rule.reason
                if rule.action == "deny" and not reason:
                    reason = f"approval rule {i + 1} of the policy denies it"
                return Verdict(rule.action, reason), i
        return default_approval(spec, args), None


def compile_approval(config: ApprovalConfig, tools: Iterable[ToolSpec] = ()) -> RuleApproval:
    """The approval policy of a policy file. `tools` is accepted for symmetry with the loader,
    which already checked that every rule can match one of them."""
    del tools
    return RuleApproval(config.rules)


def can_decide(config: ApprovalConfig, team: str, run_team: str | None = None) -> bool:
    """Whether a key of `team` may approve or reject calls of runs under this policy.

    With `approvers` listed, only those teams may; with none listed, the team that owns the
    run decides its own calls (`run_team`; when unknown, any team the caller could see it as).
    """
    if config.approvers:
        return team in config.approvers
    return run_team is None or team == run_team


def expired(asked_at: float, now: float, config: ApprovalConfig) -> bool:
    """Whether an approval asked for at `asked_at` (epoch seconds) has expired at `now`."""
    return config.expires_after_s is not None and now - asked_at >= config.expires_after_s


def duration_text(seconds: float) -> str:
    """`86400` -> `1 day`, `90` -> `90 seconds`."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:g} seconds"


def expiry_sentence(config: ApprovalConfig) -> str:
    """The reason recorded (and read by the model) when nobody decided in time."""
    after = duration_text(config.expires_after_s) if config.expires_after_s is not None else "its deadline"
    return (f"Nobody decided on this call within {after}, so the approval request expired and "
            f"the call was rejected.")


def expiry_decision(config: ApprovalConfig) -> Decision:
    """The rejection to record (`gateway.harness.approvals.decide`) for an expired approval."""
    return Decision("reject", expiry_sentence(config), EXPIRY)
