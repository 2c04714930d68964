"""The quality gate's dense forward runs every family's own decoder: branched scoring equals
`transformers` on prompts past the sliding window (soft-capped logits included), and
`splitserve eval` gates a tiny model of a hybrid-window family and of a MoE family."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.model.tiny_families import FAMILIES, VOCAB, reference_logits, save_family
from engine.quality.cli import add_eval_command, run_eval
from engine.quality.forward import BranchedSequence, forward_hidden, head_logits

pytest.importorskip("transformers")


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, VOCAB) for _ in range(n))


@pytest.mark.parametrize("name", FAMILIES)
def test_branched_scoring_equals_transformers(tmp_path, name):
    """A 20-token trunk (past the 12-token window) with two branches, batched beside a short
    sequence that pads: each branch's logits are the reference's on trunk + branch."""
    reference = save_family(name, tmp_path)
    model = LlamaModel(read_checkpoint(tmp_path), weights="fp32")
    rng = random.Random(3)
    long = BranchedSequence(_tokens(rng, 20), (_tokens(rng, 9), _tokens(rng, 4)))
    short = BranchedSequence(_tokens(rng, 5))
    hidden = forward_hidden(model, [short, long], max_linear_rows=7)
    for k, branch in enumerate(long.branches):
        rows = list(long.branch_rows(k))
        got = head_logits(model, hidden[1][rows], max_rows=None)
        want = reference_logits(reference, [*long.trunk, *branch])[len(long.trunk) :]
        assert (got - want).abs().max().item() <= 1e-3
    got = head_logits(model, hidden[1][: len(long.trunk)], max_rows=None)
    assert (got - reference_logits(reference, list(long.trunk))).abs().max().item() <= 1e-3
    want = reference_logits(reference, list(short.trunk))
    assert (head_logits(model, hidden[0], None) - want).abs().max().item() <= 1e-3


def _byte_tokenizer(folder) -> None:
    """A byte-level tokenizer.json of 256 tokens (the tiny models' vocabulary): any text
    encodes, one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_eval_command_gates_a_tiny_family_model(tmp_path, name, capsys):
    folder = tmp_path / name
    save_family(name, folder)
    _byte_tokenizer(folder)
    out = tmp_path / "gate.json"
    parser = argparse.ArgumentParser()
    add_eval_command(parser.add_subparsers(dest="command"))
    argv = ["eval", "--weights", "fp32,bf16", "--model", str(folder), "--limit", "3"]
    argv += ["--texts", "2", "--json", str(out), "--report-dir", str(tmp_path / "reports")]
    code = run_eval(parser.parse_args(argv))
    err = capsys.readouterr().err
    assert "fp32 PIQA: 3/3" in err and "no gate report saved" in err
    builds = json.loads(out.read_text())["builds"]
    # fp32 against itself is identical; bf16 gets a verdict from real figures.
    assert builds["fp32"]["top1_agreement"] == 1.0 and builds["fp32"]["passed"]
    assert builds["bf16"]["items"] == 3 and 0.0 <= builds["bf16"]["top1_agreement"] <= 1.0
    assert code == (0 if builds["bf16"]["passed"] else 1)
