"""Evaluate a build against the fp32 baseline: PIQA paired, top-1 agreement, the gate verdict.

Each format is one kernel path for every matrix (`auto` is not a format: it serves whichever
gated formats measure fastest, so it has no report of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.model.llama import LlamaModel
from engine.quality.agreement import Agreement, top1_agreement, top1_predictions
from engine.quality.gate import GateResult, judge_comparison
from engine.quality.paired import PairedComparison, compare_paired
from engine.quality.piqa import PiqaItem, PiqaScores, score_piqa
from engine.quality.text_encoder import TextEncoder

# (stage label, items done, items total)
StageProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class EvalPath:
    name: str
    max_linear_rows: int | None  # None: whole batches per matmul


def eval_paths(weights: str) -> tuple[EvalPath, ...]:
    return (EvalPath(weights, None),)


@dataclass(frozen=True)
class EvalSet:
    items: Sequence[PiqaItem]
    texts: Sequence[str]
    items_total: int  # the full set's size, to tell a complete run from a sample
    texts_total: int

    @property
    def complete(self) -> bool:
        return len(self.items) == self.items_total and len(self.texts) == self.texts_total


@dataclass(frozen=True)
class BuildRun:
    """One path's raw outputs: per-item scores and per-text argmax tokens."""

    piqa: PiqaScores
    top1: list[torch.Tensor]
    seconds: float


def run_build(
    model: LlamaModel,
    encoder: TextEncoder,
    evalset: EvalSet,
    path: EvalPath,
    progress: StageProgress | None = None,
) -> BuildRun:
    start = time.perf_counter()

    def on_piqa(done: int, total: int) -> None:
        if progress is not None:
            progress(f"{path.name} PIQA", done, total)

    piqa = score_piqa(model, encoder, evalset.items, path.max_linear_rows, on_piqa)
    top1 = top1_predictions(model, encoder, evalset.texts, path.max_linear_rows)
    if progress is not None:
        progress(f"{path.name} agreement", len(evalset.texts), len(evalset.texts))
    return BuildRun(piqa, top1, time.perf_counter() - start)


@dataclass(frozen=True)
class PathResult:
    path: EvalPath
    comparison: PairedComparison
    agreement: Agreement
    gate: GateResult
    seconds: float
    flipped_items: tuple[int, ...]  # indices (in evaluated order) where the choices differ


@dataclass(frozen=True)
class BuildEvaluation:
    weights: str
    paths: tuple[PathResult, ...]
    complete: bool

    @property
    def gate(self) -> GateResult:
        return GateResult.combine([p.gate for p in self.paths])

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.paths)

    @property
    def worst_piqa(self) -> PathResult:
        return max(self.paths, key=lambda p: abs(p.comparison.delta_points))

    @property
    def worst_agreement(self) -> PathResult:
        return min(self.paths, key=lambda p: p.agreement.rate)


def compare_runs(path: EvalPath, candidate: BuildRun, baseline: BuildRun) -> PathResult:
    comparison = compare_paired(candidate.piqa.correct, baseline.piqa.correct)
    agreement = top1_agreement(candidate.top1, baseline.top1)
    gate = judge_comparison(path.name, comparison, agreement.rate)
    flipped = (candidate.piqa.choices != baseline.piqa.choices).nonzero().flatten().tolist()
    return PathResult(path, comparison, agreement, gate, candidate.seconds, tuple(flipped))


def evaluate_build(
    model: LlamaModel,
    weights: str,
    encoder: TextEncoder,
    evalset: EvalSet,
    baseline: BuildRun,
    progress: StageProgress | None = None,
) -> BuildEvaluation:
    """`model` is the candidate build; `weights` names it (normally `model.weights`)."""
    results = []
    for path in eval_paths(weights):
        run = run_build(model, encoder, evalset, path, progress)
        results.append(compare_runs(path, run, baseline))
    return BuildEvaluation(weights, tuple(results), evalset.complete)
