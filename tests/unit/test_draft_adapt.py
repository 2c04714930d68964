"""Online adaptation: a round runs only once enough new traffic was logged, goes on training
the served head (rounds add up), and replaces the served file only when the gate accepts."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.model.tiny import TINY_CONFIG, tiny_checkpoint, write_hf_folder
from engine.speculative.head_file import read_head
from engine.speculative.head_train import HeadTrainConfig, train_head
from shared.training_log import LoggedTurn, TrainingLogWriter
from tests.spec_helpers import motif_prompts
from tests.unit.test_spec_head import FINGERPRINT, GREEDY, head_file, plain  # noqa: F401
from tools.bench.draft_adapt import AdaptPolicy, due, history_path, read_history, run_round
from tools.bench.draft_gate import GateRun, decide
from tools.commands import draft_cmd


def test_a_round_is_due_only_after_enough_new_turns():
    policy = AdaptPolicy(min_new_turns=50)
    assert due(49, [], policy)[0] is False
    assert due(50, [], policy) == (True, "50 turns logged since the last round")
    history = [{"log_turns": 120}]
    go, why = due(160, history, policy)
    assert not go and why == "40 turns logged since the last round, 50 needed"
    assert due(60, history, policy)[0] is True  # a rotated log: everything in it is new
    with pytest.raises(ValueError, match="min_new_turns"):
        AdaptPolicy(min_new_turns=0)
    with pytest.raises(ValueError, match="window_turns"):
        AdaptPolicy(window_turns=1)


def _runs(candidate_tok_s: float) -> dict[str, GateRun]:
    """The gate's figures for a replay where plain decoding made 10 tok/s and the served head
    12 (what the replay measured is the input here; `decide` judges it)."""
    outputs = {1: [[1, 2, 3]]}
    return {
        "none": GateRun("none", outputs, 100, 10.0, 1.0),
        "current": GateRun("current", outputs, 120, 10.0, 1.8),
        "candidate": GateRun("candidate", outputs, int(candidate_tok_s * 10), 10.0, 2.1),
    }


def test_only_an_accepted_round_replaces_the_served_head(plain, head_file, tmp_path):  # noqa: F811
    prompts, expected = plain
    conversations = [(p + r, len(p)) for p, r in zip(prompts, expected, strict=True)]
    served = tmp_path / "served.head.pt"
    served.write_bytes(head_file.path.read_bytes())
    before = read_head(served, FINGERPRINT, TINY_CONFIG.vocab_size)
    config = HeadTrainConfig(max_minutes=2, max_steps=6, vocab_size=256, window=64, lr=1e-3)
    trained_from = []

    def train(turns, init, out):
        trained_from.append((len(turns), init.version if init else None))
        checkpoint = tiny_checkpoint(seed=0)
        return train_head(checkpoint, turns, out, FINGERPRINT, config=config, init=init)

    def read_served(path):
        return read_head(path, FINGERPRINT, TINY_CONFIG.vocab_size), ""

    policy = AdaptPolicy(min_new_turns=1, window_turns=6)
    slower = run_round(
        conversations, served, train, lambda c, cur: decide(_runs(11.0)), read_served, policy
    )
    assert not slower["accepted"] and slower["installed"] is None
    assert any("does not beat current" in r for r in slower["reasons"])
    assert served.read_bytes() == head_file.path.read_bytes()  # untouched
    faster = run_round(
        conversations, served, train, lambda c, cur: decide(_runs(15.0)), read_served, policy
    )
    assert faster["accepted"] and faster["installed"] == str(served)
    after = read_head(served, FINGERPRINT, TINY_CONFIG.vocab_size)
    assert after.version != before.version
    assert after.stats["continued_from"] == before.version
    assert after.stats["total_steps"] == before.stats["steps"] + 6
    assert trained_from == [(6, before.version)] * 2  # the window: the latest 6 turns
    assert not served.with_name(served.name + ".candidate").exists()
    history = read_history(history_path(served))
    assert [r["accepted"] for r in history] == [False, True]
    assert history[1]["log_turns"] == len(conversations) and history[1]["window_turns"] == 6
    assert history[1]["runs"]["candidate"]["speedup"] == 1.5


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["draft", "adapt", *argv])
    return args.handler(args)


def test_adapt_cli_rounds_train_gate_and_go_on_from_the_served_head(tmp_path, capsys):
    """End to end on a tiny folder: the first round starts from the target (nothing served
    yet) and the real gate replays the held-out chats; without new turns no round runs; after
    more traffic the next round goes on from whatever is served."""
    folder = write_hf_folder(tiny_checkpoint(0), tmp_path / "tiny")
    from engine.core.config import EngineConfig
    from engine.core.engine import Engine
    from engine.model.llama import LlamaModel

    engine = Engine(
        EngineConfig(num_blocks=200), model=LlamaModel(tiny_checkpoint(0), weights="fp32")
    )
    prompts = motif_prompts(12, seed=7)
    replies = engine.generate(prompts, GREEDY)
    # Two coordinators' files in one folder, as the chart mounts it: the folder is the log.
    logs = tmp_path / "training-log"
    log = TrainingLogWriter(logs / "coordinator-a.jsonl", 1.0)
    log.write(
        [LoggedTurn("tiny", "default", p, r) for p, r in zip(prompts[:8], replies[:8], strict=True)]
    )
    served = tmp_path / "pool" / "tiny.head.pt"
    argv = ["--model", str(folder), "--from-log", str(logs), "--served", str(served)]
    argv += ["--once", "--min-new-turns", "4", "--max-steps", "8", "--vocab-size", "256"]
    argv += ["--heldout-fraction", "0.3", "--threads", "1", "--batches", "1,2"]
    argv += ["--max-tokens", "8", "--precision", "fp32"]
    assert _cli(argv) == 0
    out = capsys.readouterr().out
    (first,) = read_history(history_path(served))
    assert out.startswith("ACCEPTED" if first["accepted"] else "REFUSED")
    assert first["continued_from"] is None and first["steps"] == 8
    assert first["runs"]["candidate"]["identical_greedy"] is True
    assert set(first["runs"]) == {"none", "candidate"}  # nothing was served yet
    assert served.is_file() == first["accepted"]

    assert _cli(argv) == 0  # no new traffic: no round
    assert len(read_history(history_path(served))) == 1

    TrainingLogWriter(logs / "coordinator-b.jsonl", 1.0).write(
        [LoggedTurn("tiny", "default", p, r) for p, r in zip(prompts[8:], replies[8:], strict=True)]
    )
    assert _cli(argv) == 0
    first, second = read_history(history_path(served))
    assert second["log_turns"] == 12
    if first["accepted"]:  # the second round went on from the served head, and was gated on it
        assert second["continued_from"] is not None and "current" in second["runs"]
    else:
        assert second["continued_from"] is None and "current" not in second["runs"]
    assert json.dumps(second)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--min-new-turns", "0"], "--min-new-turns must be >= 1"),
        (["--window-turns", "1"], "--window-turns must be >= 2"),
        (["--every", "0"], "--every must be > 0"),
        (["--heldout-fraction", "1.0"], "--heldout-fraction must be < 1"),
        (["--batches", "1,x"], "--batches must be comma-separated"),
        (["--max-steps", "0"], "--max-steps must be >= 1"),
        (["--tree-width", "5"], "--tree-width must be in 1..4, got 5"),
        (["--min-confidence", "1.5"], "--min-confidence must be in [0, 1], got 1.5"),
        (["--tree-min-confidence", "2"], "--tree-min-confidence must be in [0, 1], got 2.0"),
        (["--tree-max-batch", "0"], "--tree-max-batch must be >= 1, got 0"),
        (["-k", "0"], "--num-speculative-tokens must be in 1..16, got 0"),
    ],
)
def test_adapt_cli_refuses_bad_options(tmp_path, capsys, extra, message):
    argv = ["--from-log", str(tmp_path / "log.jsonl"), "--served", str(tmp_path / "h.pt")]
    assert _cli([*argv, *extra]) == 2
    assert message in capsys.readouterr().err
    assert not history_path(tmp_path / "h.pt").exists()
