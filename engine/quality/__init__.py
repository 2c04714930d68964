"""The quality gate for cheaper builds: PIQA paired against fp32, plus top-1 agreement.

`splitserve eval` (cli.py) measures a build and saves a gate report; `require_gate`
(require.py) is what a server calls before it serves any weight format other than fp32.
"""

from engine.quality.gate import (
    BASELINE_WEIGHTS,
    MAX_PIQA_DELTA_POINTS,
    MIN_TOP1_AGREEMENT,
    GateResult,
    judge,
)
from engine.quality.report import GateReport, default_report_path, model_fingerprint
from engine.quality.require import QualityGateError, require_gate

__all__ = [
    "BASELINE_WEIGHTS",
    "MAX_PIQA_DELTA_POINTS",
    "MIN_TOP1_AGREEMENT",
    "GateReport",
    "GateResult",
    "QualityGateError",
    "default_report_path",
    "judge",
    "model_fingerprint",
    "require_gate",
]
