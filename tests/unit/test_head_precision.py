"""The head trainer's arithmetic: `auto` times a real step in fp32 and under bf16 autocast on
this machine and keeps the faster one; a pinned precision is used as given and still trains
(the loss falls), and the choice is recorded in the head file's stats."""

from __future__ import annotations

import argparse
import random

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model.tiny import TINY_CONFIG, tiny_checkpoint
from engine.speculative.draft_data import build_vocab, target_to_draft_map
from engine.speculative.draft_train import TrainConfig
from engine.speculative.head_file import read_head
from engine.speculative.head_model import DraftHead, head_config, init_head_from_checkpoint
from engine.speculative.head_train import (
    HeadTrainConfig,
    choose_precision,
    target_states,
    train_head,
)
from shared.sampling.params import SamplingParams
from tests.spec_helpers import motif_prompts
from tools.commands import draft_cmd

FINGERPRINT = "tiny-test-tokenizer"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def conversations(tiny_model):
    prompts = motif_prompts(6, seed=5)
    engine = Engine(EngineConfig(num_blocks=200), model=tiny_model)
    replies = engine.generate(prompts, GREEDY)
    return [(p + r, len(p)) for p, r in zip(prompts, replies, strict=True)]


def _config(**overrides) -> HeadTrainConfig:
    base = dict(max_minutes=2, max_steps=60, vocab_size=256, window=64, lr=1e-2)
    return HeadTrainConfig(**(base | overrides))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_pinned_precision_trains_and_is_recorded(conversations, tmp_path, precision):
    report = train_head(
        tiny_checkpoint(seed=0),
        conversations,
        tmp_path / "h.pt",
        FINGERPRINT,
        config=_config(precision=precision),
        log=lambda _: None,
    )
    assert report.extra["precision"] == precision and report.extra["step_seconds"] == {}
    assert report.extra["final_train_loss"] < 0.75 * report.extra["initial_train_loss"]
    assert read_head(report.path, FINGERPRINT, TINY_CONFIG.vocab_size).stats["precision"] == (
        precision
    )


def _untrained(conversations, config: HeadTrainConfig):
    """A fresh head over the tiny target, its training samples and vocabulary map."""
    checkpoint = tiny_checkpoint(seed=0)
    samples = target_states(checkpoint, conversations, config.top_k, lambda: False, lambda _: None)
    vocab = build_vocab([s.teacher for s in samples], 256, [])
    head = DraftHead(head_config(TINY_CONFIG, len(vocab)))
    init_head_from_checkpoint(head, checkpoint.tensors)
    t = checkpoint.tensors
    head.attach_target(t["embed_tokens"], t["embed_tokens"][vocab])
    return head, samples, target_to_draft_map(vocab, TINY_CONFIG.vocab_size)


def test_auto_times_both_and_keeps_the_faster(conversations):
    config = _config()
    head, samples, to_head = _untrained(conversations, config)
    chosen, timings = choose_precision(head, samples, to_head, config, random.Random(0))
    assert set(timings) == {"fp32", "bf16"} and min(timings.values()) > 0
    # bf16 only when it is clearly (the margin) faster: a near tie keeps fp32's accuracy.
    assert chosen == ("bf16" if timings["bf16"] * 1.15 < timings["fp32"] else "fp32")
    # The timing steps leave no gradient behind to leak into the first optimizer step.
    assert all(p.grad is None for p in head.parameters())


def test_a_hopeless_bf16_is_timed_once(conversations, monkeypatch):
    """Where the warm-up bf16 step alone is many fp32 steps long (a CPU without bf16
    arithmetic), the two timed bf16 steps are skipped: they would only eat the budget."""
    import time

    import torch

    from engine.speculative import head_train

    config = _config()
    head, samples, to_head = _untrained(conversations, config)
    calls = {"fp32": 0, "bf16": 0}
    loss = head_train._loss
    # A step's time read off a clock the steps advance: 0.1 s in fp32, 10 s in bf16, so the
    # verdict does not depend on how loaded this machine is.
    clock = [0.0]

    def slow_bf16(*args):
        kind = "bf16" if torch.is_autocast_enabled("cpu") else "fp32"
        calls[kind] += 1
        clock[0] += 10.0 if kind == "bf16" else 0.1
        return loss(*args)

    monkeypatch.setattr(head_train, "_loss", slow_bf16)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    chosen, timings = choose_precision(head, samples, to_head, config, random.Random(0))
    assert chosen == "fp32" and timings == {"fp32": 0.1, "bf16": 10.0}
    assert calls == {"fp32": 3, "bf16": 1}


def test_an_unknown_precision_is_refused(conversations, tmp_path):
    with pytest.raises(ValueError, match="precision must be one of"):
        train_head(
            tiny_checkpoint(seed=0),
            conversations,
            tmp_path / "h.pt",
            FINGERPRINT,
            config=_config(precision="fp8"),
            log=lambda _: None,
        )


def test_the_cli_refuses_an_unknown_precision(capsys):
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["draft", "train", "--from-log", "x.jsonl", "--precision", "fp8"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_the_cli_leaves_the_learning_rate_to_each_trainer_and_refuses_a_non_positive_one(
    capsys,
):
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["draft", "train", "--from-log", "x.jsonl"])
    assert args.lr is None  # a head trains at HeadTrainConfig's rate, a draft at TrainConfig's
    assert HeadTrainConfig().lr == 3e-3 and TrainConfig().lr == 1e-3
    args = parser.parse_args(["draft", "train", "--from-log", "x.jsonl", "--lr", "0"])
    assert args.handler(args) != 0
    assert "--lr must be > 0, got 0.0" in capsys.readouterr().err


def test_the_cli_refuses_max_steps_below_one_or_without_a_log(capsys):
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["draft", "train", "--from-log", "x.jsonl", "--max-steps", "0"])
    assert args.handler(args) != 0
    assert "--max-steps must be >= 1, got 0" in capsys.readouterr().err
    args = parser.parse_args(["draft", "train", "--max-steps", "5"])
    assert args.handler(args) != 0
    assert "--max-steps applies to a head trained --from-log" in capsys.readouterr().err
