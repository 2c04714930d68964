"""The serving-side check: refuse to serve a non-fp32 build without a passing gate report."""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.model.formats import SERVING_FORMATS
from engine.model.linear import WEIGHT_FORMATS
from engine.quality.gate import (
    BASELINE_WEIGHTS,
    MAX_PIQA_DELTA_POINTS,
    MIN_TOP1_AGREEMENT,
    agreement_within_limit,
    piqa_within_limit,
)
from engine.quality.report import GateReport, default_report_path, model_fingerprint
from shared.modelfile.default import default_model_path

# Reports for the bundled model, measured by `splitserve eval` and shipped with the project so
# that a fresh install can serve the cheaper builds it was gated for.
SHIPPED_REPORTS = Path(__file__).resolve().parent / "reports"
# The native step computes with the very weights the fp32 build holds: each fp32 weight is the
# exact dequantization of the file's block it reads (tests/unit/test_native_step.py checks the
# logits agree with fp32's to 1e-3), so it is the baseline's arithmetic in another order, not a
# lossy build, and needs no PIQA report of its own.
BASELINE_EQUIVALENT = ("native",)
# Lossy builds a report must cover: the torch formats, and the native step with int8
# activations (its products are not the fp32 build's).
GATED_FORMATS: tuple[str, ...] = (
    *(w for w in WEIGHT_FORMATS if w != BASELINE_WEIGHTS),
    "native-a8",
)


def _find(fingerprint: str, weights: str, cache_dir) -> Path | None:
    """An explicit cache dir is the only place looked at; by default the user's own report
    (~/.cache/splitserve) comes first, then the one shipped with the project."""
    bases = [cache_dir] if cache_dir is not None else [None, SHIPPED_REPORTS]
    for base in bases:
        path = default_report_path(fingerprint, weights, base)
        if path.is_file():
            return path
    return None


class QualityGateError(RuntimeError):
    """A build may not serve: it failed the quality gate, or was never (fully) evaluated."""


def require_gate(
    weights: str,
    report_path: str | os.PathLike | None = None,
    model: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> GateReport | None:
    """Raise QualityGateError unless `weights` may serve `model` (default: the bundled one);
    return the accepted report (None for fp32), whose figures a server may log.

    fp32 is the baseline and always may. Any other format needs a report written by a complete
    `splitserve eval` run for this very model file (matched by content hash) whose figures
    still meet today's limits — they are re-judged here, so tightening a limit takes effect
    on reports written before.
    """
    if weights == BASELINE_WEIGHTS or weights in BASELINE_EQUIVALENT:
        return None
    if weights == "auto":
        # `auto` serves only formats that pass here (see eligible_formats), fp32 at least.
        return None
    if weights not in GATED_FORMATS:
        raise QualityGateError(
            f"unknown weight format '{weights}' (valid: {', '.join(SERVING_FORMATS)})"
        )
    model_path = str(model) if model is not None else default_model_path()
    fingerprint = model_fingerprint(model_path)
    path = (
        Path(report_path)
        if report_path is not None
        else _find(fingerprint, weights, cache_dir)
        or default_report_path(fingerprint, weights, cache_dir)
    )
    model_flag = f" --model {model_path}" if model is not None else ""
    fix = f"run `splitserve eval --weights {weights}{model_flag}`, or serve {BASELINE_WEIGHTS}"
    if not path.is_file():
        raise QualityGateError(
            f"{weights} was never evaluated for {model_path}: no gate report at {path}; {fix}"
        )
    try:
        report = GateReport.load(path)
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise QualityGateError(f"unreadable gate report {path}: {exc}; {fix}") from exc
    if report.weights != weights:
        raise QualityGateError(
            f"gate report {path} is for weights '{report.weights}', not '{weights}'; {fix}"
        )
    if report.model_fingerprint != fingerprint:
        raise QualityGateError(
            f"gate report {path} was written for another model ({report.model_path}, "
            f"sha256 {report.model_fingerprint[:16]}), not {model_path} "
            f"(sha256 {fingerprint[:16]}); {fix}"
        )
    if not report.complete:
        raise QualityGateError(
            f"gate report {path} is from a partial run ({report.items} of {report.items_total} "
            f"PIQA items; --limit/--texts runs are smoke tests, not a gate); {fix}"
        )
    if not report.passed:
        raise QualityGateError("; ".join(report.reasons) or f"{weights} failed the quality gate")
    if not (
        piqa_within_limit(report.delta_points) and agreement_within_limit(report.top1_agreement)
    ):
        raise QualityGateError(
            f"{weights} refused: its report (PIQA {report.delta_points:+.1f} points, top-1 "
            f"agreement {report.top1_agreement:.3f}) no longer meets the limits "
            f"({MAX_PIQA_DELTA_POINTS} points, {MIN_TOP1_AGREEMENT}); {fix}"
        )
    return report


def eligible_formats(
    model: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> tuple[list[str], dict[str, str]]:
    """Formats `auto` may choose for `model`, and why each other one may not."""
    eligible = [BASELINE_WEIGHTS, *BASELINE_EQUIVALENT]
    refused: dict[str, str] = {}
    for weights in GATED_FORMATS:
        try:
            require_gate(weights, None, model, cache_dir)
        except QualityGateError as exc:
            refused[weights] = str(exc)
        else:
            eligible.append(weights)
    return eligible, refused
