"""Token usage and its price: the arithmetic that turns tokens into dollars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Usage:
    """Tokens of one turn (or a sum of turns)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens)

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    @classmethod
    def from_json(cls, data: Any) -> Usage:
        if not isinstance(data, dict):
            return cls()
        return cls(int(data.get("prompt_tokens") or 0), int(data.get("completion_tokens") or 0))


@dataclass(frozen=True)
class Price:
    """USD per million tokens, in and out (the defaults: $2 in, $12 out, the demo's figures)."""

    input_per_million: float = 2.00
    output_per_million: float = 12.00

    def cost(self, usage: Usage) -> float:
        return (
            usage.prompt_tokens * self.input_per_million + usage.completion_tokens * self.output_per_million
        ) / 1_000_000

    def max_output_tokens(self, budget_usd: float, prompt_tokens: int) -> int:
        """How many completion tokens `budget_usd` still pays for after the prompt."""
        left = budget_usd - prompt_tokens * self.input_per_million / 1_000_000
        if self.output_per_million <= 0:
            return 1 << 30 if left >= 0 else 0
        return max(0, int(left * 1_000_000 / self.output_per_million))


DEFAULT_PRICE = Price()


def clamped_kinds(reported: Usage, booked: Usage) -> list[str]:
    """Which counts (`prompt`, `completion`) were booked other than the upstream reported them."""
    return [kind for kind, a, b in (("prompt", reported.prompt_tokens, booked.prompt_tokens),
                                    ("completion", reported.completion_tokens, booked.completion_tokens)) if a != b]
