"""The saved gate verdict: one JSON file per (model, weight format).

`splitserve eval` writes it after a complete run; a server reads it before serving a non-fp32
build (see require.py). It names the model by a hash of the model's bytes, so a report can
never vouch for a different file that happens to have the same path.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path

from engine.quality.evaluate import BuildEvaluation
from engine.quality.gate import MAX_PIQA_DELTA_POINTS, MIN_TOP1_AGREEMENT

REPORT_SCHEMA = 1
# Files of a Hugging Face folder that decide what the model computes.
_FOLDER_FILE_SUFFIXES = (".json", ".safetensors")
_HASH_CHUNK = 1 << 22


def model_fingerprint(model_path: str | os.PathLike) -> str:
    """sha256 of the model's bytes (a GGUF file, or a folder's config, tokenizer and weights)."""
    path = Path(model_path)
    digest = hashlib.sha256()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _FOLDER_FILE_SUFFIXES)
    else:
        files = [path]
    for file in files:
        if path.is_dir():
            # Names are hashed too, so moving bytes between two files changes the fingerprint.
            digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def default_report_path(
    fingerprint: str, weights: str, cache_dir: str | os.PathLike | None = None
) -> Path:
    base = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "splitserve"
    return base / f"gate-{fingerprint[:16]}-{weights}.json"


@dataclass(frozen=True)
class GateReport:
    """Per build: the figures of its worst path (largest |delta|, lowest agreement) and the
    verdict; `paths` holds every path's own figures."""

    weights: str
    model_path: str
    model_fingerprint: str
    passed: bool
    reasons: list[str]
    piqa_accuracy: float
    piqa_fp32_accuracy: float
    delta_points: float
    delta_stderr: float
    disagreements: int
    top1_agreement: float
    items: int
    items_total: int
    complete: bool  # every PIQA item and every agreement text was evaluated
    seconds: float
    limits: dict[str, float] = field(default_factory=dict)
    paths: list[dict[str, object]] = field(default_factory=list)
    created_at: str = ""
    schema: int = REPORT_SCHEMA

    @classmethod
    def from_evaluation(
        cls, evaluation: BuildEvaluation, model_path: str, fingerprint: str, items_total: int
    ) -> GateReport:
        worst = evaluation.worst_piqa.comparison
        gate = evaluation.gate
        paths = [
            {
                "name": p.path.name,
                "piqa_accuracy": p.comparison.candidate_accuracy,
                "delta_points": p.comparison.delta_points,
                "delta_stderr": p.comparison.delta_stderr_points,
                "disagreements": p.comparison.disagreements,
                "top1_agreement": p.agreement.rate,
                "agreement_positions": p.agreement.positions,
                "passed": p.gate.passed,
                "seconds": p.seconds,
                "flipped_items": list(p.flipped_items),
            }
            for p in evaluation.paths
        ]
        return cls(
            weights=evaluation.weights,
            model_path=model_path,
            model_fingerprint=fingerprint,
            passed=gate.passed,
            reasons=list(gate.reasons),
            piqa_accuracy=worst.candidate_accuracy,
            piqa_fp32_accuracy=worst.baseline_accuracy,
            delta_points=worst.delta_points,
            delta_stderr=worst.delta_stderr_points,
            disagreements=worst.disagreements,
            top1_agreement=evaluation.worst_agreement.agreement.rate,
            items=worst.items,
            items_total=items_total,
            complete=evaluation.complete,
            seconds=evaluation.seconds,
            limits={
                "max_piqa_delta_points": MAX_PIQA_DELTA_POINTS,
                "min_top1_agreement": MIN_TOP1_AGREEMENT,
            },
            paths=paths,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> GateReport:
        if not isinstance(raw, dict):
            raise ValueError("a gate report must be a JSON object")
        if raw.get("schema") != REPORT_SCHEMA:
            raise ValueError(f"gate report schema {raw.get('schema')!r}, expected {REPORT_SCHEMA}")
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names if n not in raw)
        if missing:
            raise ValueError(f"gate report lacks {', '.join(missing)}")
        return cls(**{n: raw[n] for n in names})

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename: a server starting meanwhile never reads half a report.
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> GateReport:
        with open(path) as f:
            return cls.from_dict(json.load(f))
