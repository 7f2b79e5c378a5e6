"""The run's figures as response headers, on every answer of a governed call (429s too)."""

from __future__ import annotations

from gateway.harness.state import RunState


def usd(value: float) -> str:
    """A dollar figure for a header: fixed-point (never 1e-05), nine decimals."""
    return f"{value:.9f}"


def run_headers(run: RunState, team_remaining_usd: float | None = None) -> dict[str, str]:
    """X-Run-Id, X-Run-Status, X-Run-Turns, X-Run-Cost-Usd and, where set, the budgets left."""
    headers = {
        "X-Run-Id": run.public_id,
        "X-Run-Status": run.status,
        "X-Run-Turns": str(run.turns),
        "X-Run-Cost-Usd": usd(run.cost_usd),
    }
    if run.limits.max_budget_usd is not None:
        headers["X-Run-Budget-Remaining-Usd"] = usd(run.limits.max_budget_usd - run.cost_usd)
    if team_remaining_usd is not None:
        headers["X-Team-Budget-Remaining-Usd"] = usd(team_remaining_usd)
    return headers
