"""Acceptance statistics of speculative decoding, per draft method (what operators read)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.config.speculative import MAX_SPECULATIVE_TOKENS


@dataclass
class MethodStats:
    steps: int = 0  # verification steps that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # accepted_histogram[a]: steps where exactly a drafts were accepted.
    accepted_histogram: list[int] = field(
        default_factory=lambda: [0] * (MAX_SPECULATIVE_TOKENS + 1)
    )

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per verified step: accepted drafts plus the target's token."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.accepted_histogram[accepted] += 1

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accepted_histogram": list(self.accepted_histogram),
        }


@dataclass
class SpecStats:
    method: str = "none"
    by_method: dict[str, MethodStats] = field(default_factory=dict)
    plain_steps: int = 0  # decode rows the controller chose not to speculate on
    draft_unavailable: str | None = None
    draft_version: str | None = None  # of the draft in use (changes with a hot swap)
    draft_swaps: int = 0  # drafts installed while serving
    # (draft tokens, accepted) per verified row since the last drain: fed to Prometheus. Bounded:
    # an engine without a metrics sink never drains it.
    pending: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=4096))

    def record(self, method: str, proposed: int, accepted: int) -> None:
        self.by_method.setdefault(method, MethodStats()).record(proposed, accepted)
        self.pending.append((proposed, accepted))

    def drain(self) -> list[tuple[int, int]]:
        out = list(self.pending)
        self.pending.clear()
        return out

    @property
    def total(self) -> MethodStats:
        total = MethodStats()
        for stats in self.by_method.values():
            total.steps += stats.steps
            total.draft_tokens += stats.draft_tokens
            total.accepted_tokens += stats.accepted_tokens
            for a, n in enumerate(stats.accepted_histogram):
                total.accepted_histogram[a] += n
        return total

    def as_dict(self) -> dict:
        total = self.total.as_dict()
        out = {
            "method": self.method,
            "mean_accepted": total["mean_accepted"],
            "acceptance_rate": total["acceptance_rate"],
            "draft_tokens": total["draft_tokens"],
            "accepted_tokens": total["accepted_tokens"],
            "verify_steps": total["steps"],
            "plain_steps": self.plain_steps,
            "accepted_histogram": total["accepted_histogram"],
            "by_method": {name: s.as_dict() for name, s in self.by_method.items()},
        }
        if self.draft_unavailable is not None:
            out["draft_unavailable"] = self.draft_unavailable
        if self.draft_version is not None:
            out["draft_version"] = self.draft_version
            out["draft_swaps"] = self.draft_swaps
        return out
