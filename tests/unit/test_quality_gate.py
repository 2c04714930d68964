"""The quality gate: scoring matches the dense reference, the paired statistics are right, good
builds pass and a broken one is refused on a slice with the real model, and `require_gate`
refuses to serve what was never (fully, successfully) evaluated."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch

from engine.model.gguf_file import Checkpoint
from engine.model.llama import LlamaModel
from engine.quality import (
    MAX_PIQA_DELTA_POINTS,
    MIN_TOP1_AGREEMENT,
    GateReport,
    QualityGateError,
    default_report_path,
    judge,
    model_fingerprint,
    require_gate,
)
from engine.quality.agreement import load_agreement_texts
from engine.quality.cli import add_eval_command, parse_weights, run_eval
from engine.quality.evaluate import EvalPath, EvalSet, compare_runs, evaluate_build, run_build
from engine.quality.forward import BranchedSequence, forward_hidden
from engine.quality.paired import compare_paired
from engine.quality.piqa import encode_item, load_piqa, score_piqa
from engine.quality.require import eligible_formats
from tests.reference import dense_logits

SLICE_ITEMS = 20
SLICE_TEXTS = 3

pytestmark = pytest.mark.real_model


# -- bundled data ---------------------------------------------------------------------------


def test_bundled_piqa_is_the_full_labeled_validation_set():
    items = load_piqa()
    assert len(items) == 1838
    assert {i.label for i in items} == {0, 1}
    assert items[0].goal.startswith("How do I ready a guinea pig cage")
    assert items[0].label == 0
    assert items[0].context == f"Question: {items[0].goal}\nAnswer:"


def test_agreement_texts_are_varied_and_split_cleanly():
    texts = load_agreement_texts()
    assert 35 <= len(texts) <= 60
    assert all(t.strip() and "%%" not in t for t in texts)
    assert sum("<|im_start|>assistant" in t for t in texts) >= 8  # chat turns in the template


# -- scoring against the dense reference ----------------------------------------------------


def test_branched_forward_equals_running_each_branch_alone(real_model, real_tokenizer):
    items = load_piqa(3)
    seqs = [encode_item(real_tokenizer, item) for item in items]
    hidden = forward_hidden(real_model, seqs)
    for seq, h in zip(seqs, hidden, strict=True):
        assert h.shape == (seq.num_rows, real_model.config.hidden_size)
        for k, branch in enumerate(seq.branches):
            rows = list(range(len(seq.trunk))) + list(seq.branch_rows(k))
            got = real_model.logits(h[rows])
            want = dense_logits(real_model, [*seq.trunk, *branch])
            torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


def test_piqa_loglikelihood_is_the_continuations_token_logprob_sum(real_model, real_tokenizer):
    items = load_piqa(2)
    scores = score_piqa(real_model, real_tokenizer, items)
    for n, item in enumerate(items):
        context = real_tokenizer.encode(item.context)
        for k, continuation in enumerate(item.continuations):
            cont = real_tokenizer.encode(item.context + continuation)[len(context) :]
            logprobs = dense_logits(real_model, context + cont).log_softmax(-1).double()
            rows = range(len(context) - 1, len(context) + len(cont) - 1)
            want = sum(float(logprobs[r, t]) for r, t in zip(rows, cont, strict=True))
            assert scores.loglikelihoods[n, k].item() == pytest.approx(want, abs=2e-3)
    assert scores.choices.tolist() == [
        int(scores.loglikelihoods[i, 1] > scores.loglikelihoods[i, 0]) for i in range(2)
    ]


def test_padding_a_short_sequence_beside_a_long_one_changes_nothing(real_model):
    short = BranchedSequence((10, 20, 30), ((40, 50), (60,)))
    long = BranchedSequence(tuple(range(100, 140)), ((7, 8, 9),))
    alone = forward_hidden(real_model, [short])[0]
    batched = forward_hidden(real_model, [long, short])[1]
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)


# -- paired statistics and the verdict ------------------------------------------------------


def test_paired_comparison_counts_and_standard_error():
    gen = torch.Generator().manual_seed(3)
    baseline = torch.rand(500, generator=gen) < 0.64
    flip = torch.rand(500, generator=gen) < 0.05
    candidate = baseline ^ flip
    cmp = compare_paired(candidate, baseline)
    d = candidate.double() - baseline.double()
    assert cmp.items == 500
    assert cmp.disagreements == int(flip.sum())
    assert cmp.delta_points == pytest.approx(100 * float(d.mean()))
    assert cmp.delta_stderr_points == pytest.approx(100 * float(d.std() / math.sqrt(500)))
    assert cmp.candidate_accuracy - cmp.baseline_accuracy == pytest.approx(cmp.delta_points / 100)


def test_verdict_limits_are_inclusive_and_symmetric():
    assert judge("x", 0.658, 0.643, MAX_PIQA_DELTA_POINTS, MIN_TOP1_AGREEMENT).passed
    assert judge("x", 0.628, 0.643, -MAX_PIQA_DELTA_POINTS, 0.99).passed
    # Much *better* than fp32 is refused too: the build computes something else.
    assert not judge("x", 0.70, 0.643, +5.7, 0.99).passed
    refused = judge("int4", 0.612, 0.643, -3.1, 0.90)
    assert refused.reasons == [
        "int4 refused: PIQA 0.612 vs fp32 0.643 (-3.1 points, limit 1.5)",
        "int4 refused: top-1 agreement with fp32 0.900 (minimum 0.95)",
    ]


# -- the gate on a slice, with the real model ------------------------------------------------


@pytest.fixture(scope="module")
def evalset() -> EvalSet:
    texts = load_agreement_texts()
    return EvalSet(
        items=load_piqa(SLICE_ITEMS),
        texts=texts[:SLICE_TEXTS],
        items_total=len(load_piqa()),
        texts_total=len(texts),
    )


@pytest.fixture(scope="module")
def fp32_run(real_model, real_tokenizer, evalset):
    return run_build(real_model, real_tokenizer, evalset, EvalPath("fp32", None))


def test_fp32_against_a_fresh_fp32_build_is_identical(
    real_checkpoint, real_tokenizer, evalset, fp32_run
):
    again = run_build(
        LlamaModel(real_checkpoint, "fp32"), real_tokenizer, evalset, EvalPath("fp32", None)
    )
    result = compare_runs(EvalPath("fp32", None), again, fp32_run)
    assert result.comparison.delta_points == 0.0
    assert result.comparison.disagreements == 0
    assert result.agreement.rate == 1.0
    assert result.agreement.positions == sum(t.numel() for t in fp32_run.top1)
    assert result.gate.passed and result.gate.reasons == []


@pytest.fixture(scope="module")
def bf16_evaluation(real_checkpoint, real_tokenizer, evalset, fp32_run):
    model = LlamaModel(real_checkpoint, "bf16")
    return evaluate_build(model, "bf16", real_tokenizer, evalset, fp32_run)


def test_bf16_passes_the_gate_on_the_slice(bf16_evaluation):
    assert bf16_evaluation.gate.passed, bf16_evaluation.gate.reasons
    assert bf16_evaluation.paths[0].comparison.disagreements == 0
    assert not bf16_evaluation.complete  # a slice is never a gate report that may serve


def test_int8_agrees_with_fp32_and_flips_only_near_ties(
    real_checkpoint, real_tokenizer, evalset, fp32_run
):
    # int8 re-quantizes the file's 4-bit weights per row (~1% error per matmul), and flips
    # ~4% of PIQA choices — items fp32 itself barely decides. On 20 items one flip is 5
    # points, below what 20 items resolve, so the slice checks agreement and *which* items
    # flip; the PIQA verdict is the full run's.
    run = run_build(
        LlamaModel(real_checkpoint, "int8"), real_tokenizer, evalset, EvalPath("int8", None)
    )
    result = compare_runs(EvalPath("int8", None), run, fp32_run)
    assert result.agreement.rate >= MIN_TOP1_AGREEMENT
    assert result.comparison.disagreements <= 2
    flipped = (run.piqa.choices != fp32_run.piqa.choices).nonzero().flatten()
    margins = (fp32_run.piqa.loglikelihoods[:, 1] - fp32_run.piqa.loglikelihoods[:, 0]).abs()
    assert bool((margins[flipped] < 0.5).all()), margins[flipped]
    assert abs(result.comparison.delta_points) <= 2 * result.comparison.delta_stderr_points


def test_int4_passes_the_gate_on_the_slice(real_checkpoint, real_tokenizer, evalset, fp32_run):
    # The gate first refused int4 (top-1 agreement 0.855 on the full texts) when the output
    # head, stored as Q8_0, was re-quantized to 4 bits; int4 builds now keep the head in bf16.
    model = LlamaModel(real_checkpoint, "int4")
    evaluation = evaluate_build(model, "int4", real_tokenizer, evalset, fp32_run)
    assert evaluation.gate.passed, evaluation.gate.reasons


def _noisy_checkpoint(checkpoint: Checkpoint, relative_noise: float) -> Checkpoint:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: t + relative_noise * t.std() * torch.randn(t.shape, generator=gen)
        if t.ndim == 2
        else t
        for name, t in checkpoint.tensors.items()
    }
    return dataclasses.replace(checkpoint, tensors=tensors, q4_1_blocks={})


def test_a_broken_build_is_refused_with_a_clear_reason(
    real_checkpoint, real_tokenizer, evalset, fp32_run
):
    broken = LlamaModel(_noisy_checkpoint(real_checkpoint, 0.5), "fp32")
    evaluation = evaluate_build(broken, "broken", real_tokenizer, evalset, fp32_run)
    gate = evaluation.gate
    assert not gate.passed
    agreement = evaluation.paths[0].agreement.rate
    assert agreement < MIN_TOP1_AGREEMENT
    assert f"broken refused: top-1 agreement with fp32 {agreement:.3f} (minimum 0.95)" in (
        gate.reasons
    )


# -- require_gate: what the server calls ----------------------------------------------------


@pytest.fixture(scope="module")
def bf16_report(bf16_evaluation, gguf_path) -> GateReport:
    return GateReport.from_evaluation(
        bf16_evaluation, gguf_path, model_fingerprint(gguf_path), items_total=1838
    )


def test_fp32_needs_no_report(tmp_path):
    assert require_gate("fp32", str(tmp_path / "nothing-here.json")) is None


def test_a_build_never_evaluated_is_refused(tmp_path, gguf_path):
    with pytest.raises(QualityGateError, match="int4 was never evaluated.*splitserve eval"):
        require_gate("int4", None, model=gguf_path, cache_dir=tmp_path)


def test_a_complete_passing_report_lets_the_build_serve(tmp_path, gguf_path, bf16_report):
    # The figures are the slice's; marking it complete stands in for a full run's report.
    full = dataclasses.replace(bf16_report, complete=True, items=1838)
    full.save(default_report_path(full.model_fingerprint, "bf16", tmp_path))
    accepted = require_gate("bf16", None, model=gguf_path, cache_dir=tmp_path)
    assert accepted == full
    assert accepted.top1_agreement >= MIN_TOP1_AGREEMENT


def test_auto_may_choose_only_formats_whose_reports_pass(tmp_path, gguf_path, bf16_report):
    full = dataclasses.replace(bf16_report, complete=True, items=1838)
    full.save(default_report_path(full.model_fingerprint, "bf16", tmp_path))
    eligible, refused = eligible_formats(gguf_path, cache_dir=tmp_path)
    assert eligible == ["fp32", "native", "bf16"]
    assert "int4 was never evaluated" in refused["int4"]
    int4 = dataclasses.replace(full, weights="int4")
    int4.save(default_report_path(full.model_fingerprint, "int4", tmp_path))
    assert "int4" in eligible_formats(gguf_path, cache_dir=tmp_path)[0]


def test_a_slice_report_is_not_a_gate(tmp_path, gguf_path, bf16_report):
    path = tmp_path / "bf16.json"
    bf16_report.save(path)
    partial = f"partial run \\({SLICE_ITEMS} of 1838 PIQA items"
    with pytest.raises(QualityGateError, match=partial):
        require_gate("bf16", path, model=gguf_path)


def test_a_failed_report_is_refused_with_its_reasons(tmp_path, gguf_path, bf16_report):
    reason = "bf16 refused: PIQA 0.600 vs fp32 0.643 (-4.3 points, limit 1.5)"
    failed = dataclasses.replace(bf16_report, complete=True, passed=False, reasons=[reason])
    failed.save(tmp_path / "r.json")
    with pytest.raises(QualityGateError, match=r"bf16 refused: PIQA 0\.600 vs fp32 0\.643"):
        require_gate("bf16", tmp_path / "r.json", model=gguf_path)


def test_a_report_is_rejudged_with_todays_limits(tmp_path, gguf_path, bf16_report):
    stale = dataclasses.replace(bf16_report, complete=True, passed=True, delta_points=-2.0)
    stale.save(tmp_path / "r.json")
    with pytest.raises(QualityGateError, match="no longer meets the limits"):
        require_gate("bf16", tmp_path / "r.json", model=gguf_path)


def test_a_report_for_other_weights_or_another_model_is_refused(tmp_path, gguf_path, bf16_report):
    full = dataclasses.replace(bf16_report, complete=True)
    full.save(tmp_path / "r.json")
    with pytest.raises(QualityGateError, match="for weights 'bf16', not 'int4'"):
        require_gate("int4", tmp_path / "r.json", model=gguf_path)
    dataclasses.replace(full, model_fingerprint="0" * 64).save(tmp_path / "r.json")
    with pytest.raises(QualityGateError, match="written for another model"):
        require_gate("bf16", tmp_path / "r.json", model=gguf_path)
    (tmp_path / "r.json").write_text("{not json")
    with pytest.raises(QualityGateError, match="unreadable gate report"):
        require_gate("bf16", tmp_path / "r.json", model=gguf_path)


# -- the command ----------------------------------------------------------------------------


def test_weights_are_parsed_and_validated():
    assert parse_weights("int8, int4,int8") == ["int8", "int4"]
    with pytest.raises(ValueError, match="unknown weight format.*int3"):
        parse_weights("int8,int3")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_eval_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_eval_command_rejects_bad_arguments_before_loading_anything(capsys):
    assert run_eval(_parse(["eval", "--weights", "int5"])) == 2
    assert "unknown weight format(s) int5" in capsys.readouterr().err
    assert run_eval(_parse(["eval", "--weights", "int8", "--limit", "0"])) == 2
    assert "--limit must be at least 1" in capsys.readouterr().err


def test_eval_command_end_to_end_on_two_items(tmp_path, gguf_path, capsys):
    out = tmp_path / "gate.json"
    argv = ["eval", "--weights", "fp32", "--model", gguf_path, "--limit", "2", "--texts", "2"]
    argv += ["--json", str(out), "--report-dir", str(tmp_path / "reports")]
    assert run_eval(_parse(argv)) == 0
    captured = capsys.readouterr()
    assert "fp32 PIQA: 2/2" in captured.err
    assert "no gate report saved" in captured.err
    assert not (tmp_path / "reports").exists()
    figures = json.loads(out.read_text())["builds"]["fp32"]
    for key in ("piqa_accuracy", "piqa_fp32_accuracy", "delta_points", "delta_stderr"):
        assert key in figures
    assert figures["top1_agreement"] == 1.0 and figures["passed"] and figures["items"] == 2
    assert figures["reasons"] == [] and figures["seconds"] > 0
    assert figures["paths"][0]["flipped_items"] == []
