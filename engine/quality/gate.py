"""The rule a cheaper build must meet before it may serve: the quality gate.

fp32 is the baseline and needs no gate. Every other weight format must keep PIQA accuracy
within MAX_PIQA_DELTA_POINTS of fp32 on the same items *and* predict the same next token as
fp32 at MIN_TOP1_AGREEMENT of the positions of the agreement texts. The PIQA limit is on the
absolute delta: a build that scores much *better* computes something other than the model we
validated, which is no safer than one that scores worse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.quality.paired import PairedComparison

BASELINE_WEIGHTS = "fp32"
MAX_PIQA_DELTA_POINTS = 1.5
MIN_TOP1_AGREEMENT = 0.95


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reasons: list[str] = field(default_factory=list)  # one line per failed criterion

    @staticmethod
    def combine(results: list[GateResult]) -> GateResult:
        return GateResult(
            passed=all(r.passed for r in results), reasons=[m for r in results for m in r.reasons]
        )


def piqa_within_limit(delta_points: float) -> bool:
    return abs(delta_points) <= MAX_PIQA_DELTA_POINTS


def agreement_within_limit(agreement: float) -> bool:
    return agreement >= MIN_TOP1_AGREEMENT


def judge(
    name: str,
    candidate_accuracy: float,
    baseline_accuracy: float,
    delta_points: float,
    agreement: float,
) -> GateResult:
    """The verdict for one build (or one kernel path of a build) against the fp32 figures."""
    reasons = []
    if not piqa_within_limit(delta_points):
        reasons.append(
            f"{name} refused: PIQA {candidate_accuracy:.3f} vs {BASELINE_WEIGHTS} "
            f"{baseline_accuracy:.3f} ({delta_points:+.1f} points, limit "
            f"{MAX_PIQA_DELTA_POINTS})"
        )
    if not agreement_within_limit(agreement):
        reasons.append(
            f"{name} refused: top-1 agreement with {BASELINE_WEIGHTS} {agreement:.3f} "
            f"(minimum {MIN_TOP1_AGREEMENT})"
        )
    return GateResult(passed=not reasons, reasons=reasons)


def judge_comparison(name: str, comparison: PairedComparison, agreement: float) -> GateResult:
    return judge(
        name,
        comparison.candidate_accuracy,
        comparison.baseline_accuracy,
        comparison.delta_points,
        agreement,
    )
