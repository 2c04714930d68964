"""`splitserve eval`: run the quality gate for one or more weight formats.

Scores fp32 once, then each requested build against it on the same items; prints a table,
optionally writes every figure as JSON, and — after a complete run — saves one gate report per
build where `require_gate` looks for it. Exits 1 if any requested build fails the gate.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import torch

from engine.model.gguf_file import Checkpoint
from engine.model.linear import WEIGHT_FORMATS as TORCH_FORMATS
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.quality.agreement import load_agreement_texts
from engine.quality.evaluate import (
    BuildEvaluation,
    BuildRun,
    EvalPath,
    EvalSet,
    compare_runs,
    evaluate_build,
    run_build,
)
from engine.quality.gate import BASELINE_WEIGHTS, MAX_PIQA_DELTA_POINTS, MIN_TOP1_AGREEMENT
from engine.quality.piqa import load_piqa
from engine.quality.report import GateReport, default_report_path, model_fingerprint
from engine.quality.text_encoder import TextEncoder, load_text_encoder
from shared.modelfile.config import ModelFileError
from shared.modelfile.default import default_model_path

# What `eval` can gate: each torch format, and the native step (checked like any other).
WEIGHT_FORMATS = (*TORCH_FORMATS, "native", "native-a8")
EXIT_PASSED = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2


def add_eval_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval",
        help="check cheaper weight formats against fp32 (PIQA + top-1 agreement)",
        description=(
            f"Quality gate: a build passes iff its PIQA accuracy is within "
            f"{MAX_PIQA_DELTA_POINTS} points of fp32 on the same items and its top-1 "
            f"agreement with fp32 is at least {MIN_TOP1_AGREEMENT}. A complete run saves a "
            "gate report that the server requires before serving a non-fp32 build."
        ),
    )
    parser.add_argument(
        "--weights",
        required=True,
        help=f"format(s) to check, comma-separated ({', '.join(WEIGHT_FORMATS)})",
    )
    parser.add_argument("--model", help="GGUF file or HF folder (default: bundled SmolLM2)")
    parser.add_argument(
        "--limit", type=int, help="score only the first N PIQA items (a smoke test; not saved)"
    )
    parser.add_argument(
        "--texts", type=int, help="use only the first N agreement texts (a smoke test; not saved)"
    )
    parser.add_argument("--json", dest="json_out", help="write all figures to this JSON file")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--report-dir", help="where gate reports are saved (default: ~/.cache/splitserve)"
    )
    parser.set_defaults(handler=run_eval)
    return parser


def parse_weights(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names:
        raise ValueError("--weights needs at least one format")
    unknown = [w for w in names if w not in WEIGHT_FORMATS]
    if unknown:
        raise ValueError(
            f"unknown weight format(s) {', '.join(unknown)} (valid: {', '.join(WEIGHT_FORMATS)})"
        )
    return list(dict.fromkeys(names))


class _Progress:
    """Items done / total on stderr: one rewritten line on a terminal, every ~10% otherwise."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.tty = stream.isatty()
        self.last: dict[str, int] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        if self.tty:
            end = "\n" if done == total else ""
            print(f"\r{label}: {done}/{total}", end=end, file=self.stream, flush=True)
            return
        step = max(total // 10, 1)
        if done == total or done - self.last.get(label, 0) >= step:
            self.last[label] = done
            print(f"{label}: {done}/{total}", file=self.stream, flush=True)


def _table(reports: list[GateReport], baseline: BuildRun) -> str:
    head = (
        f"{'weights':<8} {'PIQA':>6} {'fp32':>6} {'delta':>7} {'±se':>5} {'disagree':>8} "
        f"{'top-1':>6} {'seconds':>8}  verdict"
    )
    lines = [head, "-" * len(head)]
    lines.append(
        f"{BASELINE_WEIGHTS:<8} {baseline.piqa.accuracy:>6.3f} {'':>6} {'':>7} {'':>5} "
        f"{'':>8} {'':>6} {baseline.seconds:>8.1f}  baseline"
    )
    for r in reports:
        verdict = "PASS" if r.passed else "REFUSED"
        lines.append(
            f"{r.weights:<8} {r.piqa_accuracy:>6.3f} {r.piqa_fp32_accuracy:>6.3f} "
            f"{r.delta_points:>+7.2f} {r.delta_stderr:>5.2f} {r.disagreements:>8} "
            f"{r.top1_agreement:>6.3f} {r.seconds:>8.1f}  {verdict}"
        )
    lines += [f"  {reason}" for r in reports for reason in r.reasons]
    return "\n".join(lines)


def _evaluate(
    checkpoint: Checkpoint,
    weights: str,
    evalset: EvalSet,
    baseline: BuildRun,
    encoder: TextEncoder,
    progress: _Progress,
) -> BuildEvaluation:
    if weights == BASELINE_WEIGHTS:
        # fp32 against itself: the same deterministic computation, so reuse the baseline run.
        path = EvalPath(BASELINE_WEIGHTS, None)
        return BuildEvaluation(weights, (compare_runs(path, baseline, baseline),), evalset.complete)
    model = LlamaModel(checkpoint, weights=weights)
    try:
        return evaluate_build(model, weights, encoder, evalset, baseline, progress)
    finally:
        del model
        gc.collect()


def _write_json(
    out_path: str, model_path: str, fingerprint: str, baseline: BuildRun, reports: list[GateReport]
) -> None:
    out = {
        "model": {"path": model_path, "fingerprint": fingerprint},
        "baseline": {
            "weights": BASELINE_WEIGHTS,
            "piqa_accuracy": baseline.piqa.accuracy,
            "items": baseline.piqa.items,
            "seconds": baseline.seconds,
        },
        "limits": {
            "max_piqa_delta_points": MAX_PIQA_DELTA_POINTS,
            "min_top1_agreement": MIN_TOP1_AGREEMENT,
        },
        "builds": {r.weights: r.to_dict() for r in reports},
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    Path(out_path).write_text(json.dumps(out, indent=2) + "\n")


def run_eval(args: argparse.Namespace) -> int:
    try:
        weights_list = parse_weights(args.weights)
        for flag, value in (("--limit", args.limit), ("--texts", args.texts)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1")
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError("--threads must be at least 1")
            torch.set_num_threads(args.threads)
        model_path = args.model or default_model_path()
        checkpoint = read_checkpoint(model_path)
        encoder = load_text_encoder(model_path)
    except (ValueError, ModelFileError, FileNotFoundError) as exc:
        print(f"splitserve eval: {exc}", file=sys.stderr)
        return EXIT_USAGE

    fingerprint = model_fingerprint(model_path)
    all_items = load_piqa()
    all_texts = load_agreement_texts()
    items = all_items[: args.limit] if args.limit is not None else all_items
    texts = all_texts[: args.texts] if args.texts is not None else all_texts
    evalset = EvalSet(items, texts, items_total=len(all_items), texts_total=len(all_texts))
    progress = _Progress(sys.stderr)

    baseline_model = LlamaModel(checkpoint, weights=BASELINE_WEIGHTS)
    baseline = run_build(
        baseline_model, encoder, evalset, EvalPath(BASELINE_WEIGHTS, None), progress
    )
    del baseline_model

    reports: list[GateReport] = []
    for weights in weights_list:
        evaluation = _evaluate(checkpoint, weights, evalset, baseline, encoder, progress)
        report = GateReport.from_evaluation(evaluation, model_path, fingerprint, len(all_items))
        reports.append(report)
        if report.complete and weights != BASELINE_WEIGHTS:
            saved = default_report_path(fingerprint, weights, args.report_dir)
            report.save(saved)
            print(f"gate report for {weights}: {saved}", file=sys.stderr)
        if args.json_out:
            # Rewritten after every build: a run stopped midway keeps what it finished.
            _write_json(args.json_out, model_path, fingerprint, baseline, reports)

    print(_table(reports, baseline))
    if not evalset.complete:
        print(
            f"(partial run: {len(items)} of {len(all_items)} items, {len(texts)} of "
            f"{len(all_texts)} texts; no gate report saved)",
            file=sys.stderr,
        )
    return EXIT_PASSED if all(r.passed for r in reports) else EXIT_REFUSED
