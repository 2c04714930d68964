"""Paired comparison of two builds answering the same items.

Both builds see identical items, so the question is only how often they *disagree* and in
whose favour. The per-item difference d_i = correct_candidate - correct_baseline is -1, 0 or
+1; the standard error of its mean is the paired (McNemar-style) error of the accuracy delta,
far smaller than the unpaired error of two accuracies when the builds mostly agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairedComparison:
    items: int
    candidate_correct: int
    baseline_correct: int
    candidate_only_correct: int  # the builds chose differently and the candidate was right
    baseline_only_correct: int

    @property
    def candidate_accuracy(self) -> float:
        return self.candidate_correct / self.items

    @property
    def baseline_accuracy(self) -> float:
        return self.baseline_correct / self.items

    @property
    def disagreements(self) -> int:
        """Items where the builds chose different answers (two choices: exactly one is right)."""
        return self.candidate_only_correct + self.baseline_only_correct

    @property
    def delta_points(self) -> float:
        """Candidate minus baseline accuracy, in percentage points."""
        return 100.0 * (self.candidate_only_correct - self.baseline_only_correct) / self.items

    @property
    def delta_stderr_points(self) -> float:
        """Standard error of `delta_points` over items (sample std of d_i / sqrt(n))."""
        n = self.items
        if n < 2:
            return math.nan
        mean = (self.candidate_only_correct - self.baseline_only_correct) / n
        sum_sq = self.disagreements  # d_i^2 is 1 exactly where the builds disagree
        variance = (sum_sq - n * mean * mean) / (n - 1)
        return 100.0 * math.sqrt(max(variance, 0.0) / n)


def compare_paired(
    candidate_correct: torch.Tensor, baseline_correct: torch.Tensor
) -> PairedComparison:
    """Both arguments are [items] bool tensors over the same items in the same order."""
    if candidate_correct.shape != baseline_correct.shape or candidate_correct.ndim != 1:
        raise ValueError(
            f"paired results need equal 1-d shapes, got {tuple(candidate_correct.shape)} "
            f"and {tuple(baseline_correct.shape)}"
        )
    if candidate_correct.numel() == 0:
        raise ValueError("cannot compare builds on zero items")
    c = candidate_correct.bool()
    b = baseline_correct.bool()
    return PairedComparison(
        items=int(c.numel()),
        candidate_correct=int(c.sum()),
        baseline_correct=int(b.sum()),
        candidate_only_correct=int((c & ~b).sum()),
        baseline_only_correct=int((b & ~c).sum()),
    )
