"""The draft trainer end to end on the tiny model, its data pieces, and `splitserve draft train`."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import pytest
import torch

from engine.model.tiny import TINY_CONFIG, tiny_checkpoint, write_hf_folder
from engine.speculative.draft_data import (
    PromptFileError,
    build_vocab,
    generate_teacher_data,
    load_prompts,
)
from engine.speculative.draft_model import model_from_checkpoint
from engine.speculative.draft_proposer import load_draft_proposer
from engine.speculative.draft_train import TrainConfig, train_draft
from engine.speculative.proposer import DraftRequest
from tools.commands import draft_cmd

V = TINY_CONFIG.vocab_size


def _prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # A narrow id range: the tiny model's replies then reuse a small vocabulary.
    return [[rng.randrange(60) for _ in range(rng.randrange(3, 10))] for _ in range(n)]


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_trainer_end_to_end_learns_saves_and_loads(tmp_path):
    lines: list[str] = []
    config = TrainConfig(
        max_minutes=5,
        max_new_tokens=16,
        draft_vocab_size=128,
        source_layers=(0,),
        batch_tokens=256,
        lr=3e-3,
        max_steps=40,
    )
    data = tmp_path / "replies.pt"
    report = train_draft(
        tiny_checkpoint(0),
        _prompts(),
        tmp_path / "d.pt",
        "fp",
        frozenset(),
        config,
        lines.append,
        data,
    )
    assert report.steps == 40 and report.path.is_file()
    assert report.num_samples == 24  # one greedy and one sampled reply per prompt
    # A random tiny target does not generalise to held-out replies; fitting its data is the test.
    assert report.extra["train_loss"] < 0.8 * report.extra["initial_train_loss"]
    assert any(line.startswith("[draft] done") for line in lines)
    assert any("[draft] generate" in line for line in lines)
    proposer = load_draft_proposer(report.path, "fp", V)
    assert proposer.model.config.vocab_size <= 128
    draft = proposer.propose([DraftRequest("r", _prompts()[0], 3)], [False])[0]
    assert len(draft.token_ids) == 3
    # A second run reuses the saved replies instead of generating them again...
    lines.clear()
    again = replace(config, max_steps=2)
    train_draft(
        tiny_checkpoint(0), [], tmp_path / "e.pt", "fp", frozenset(), again, lines.append, data
    )
    assert lines[0].startswith("[draft] reusing 24 target replies")
    assert not any("generate" in line for line in lines)
    # ...but never those of a target with another tokenizer.
    with pytest.raises(PromptFileError, match="tokenizer fp"):
        train_draft(
            tiny_checkpoint(0),
            [],
            tmp_path / "f.pt",
            "other",
            frozenset(),
            again,
            lines.append,
            data,
        )


def test_teacher_data_labels_are_the_targets_distribution():
    checkpoint = tiny_checkpoint(0)
    teacher = model_from_checkpoint(checkpoint, (0, 1), None).eval()
    samples = generate_teacher_data(
        teacher, _prompts(4), (0.0,), 6, frozenset(), time.monotonic() + 60, batch_size=3
    )
    assert len(samples) == 4
    for s in samples:
        assert s.num_output == 6 and s.top_ids.shape == (6, 8)
        # Greedy: every emitted token is the target's own top-1 at that position.
        assert s.top_ids[:, 0].tolist() == s.token_ids[s.prompt_len :]
        with torch.no_grad():
            logp = torch.log_softmax(teacher.logits(teacher(torch.tensor([s.token_ids]))), -1)
        torch.testing.assert_close(
            s.top_logprobs[:, 0],
            logp[0, s.prompt_len - 1 : -1].max(-1).values,
            atol=1e-4,
            rtol=1e-4,
        )


def test_stop_token_ends_a_reply_and_vocab_keeps_stop_ids_first():
    teacher = model_from_checkpoint(tiny_checkpoint(0), (0, 1), None).eval()
    free = generate_teacher_data(teacher, _prompts(2), (0.0,), 5, frozenset(), 1e18)
    stop = free[0].token_ids[free[0].prompt_len + 1]
    stopped = generate_teacher_data(teacher, _prompts(2), (0.0,), 5, frozenset({stop}), 1e18)
    assert stopped[0].token_ids[-1] == stop and stopped[0].num_output <= 2
    vocab = build_vocab(free, 4, always=[511])
    assert vocab.tolist()[0] == 511 and len(vocab) == 4


def test_load_prompts_formats_and_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n\n")
    assert load_prompts(good) == [[1, 2, 3]]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(PromptFileError, match="need the model's tokenizer"):
        load_prompts(chat)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"token_ids": [1]}\n{oops\n')
    with pytest.raises(PromptFileError, match="bad.jsonl:2: not JSON"):
        load_prompts(bad)
    with pytest.raises(PromptFileError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl")


def test_bundled_prompt_set_renders_with_a_chat_template():
    class Echo:  # stands in for the tokenizer: the set's structure is what is checked here
        def apply_chat_template(self, messages):
            assert messages[-1]["role"] == "user"
            return " ".join(m["content"] for m in messages)

        def encode(self, text):
            return [len(text)]

    from engine.speculative.draft_data import DEFAULT_PROMPTS

    prompts = load_prompts(DEFAULT_PROMPTS, Echo())
    assert 100 <= len(prompts) <= 300


def test_cli_trains_on_a_tiny_folder(tmp_path, capsys):
    folder = write_hf_folder(tiny_checkpoint(0), tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in _prompts(6)))
    out = tmp_path / "tiny.draft.pt"
    argv = ["draft", "train", "--model", str(folder), "--prompts", str(prompts), "--out", str(out)]
    assert _cli(argv + ["--max-minutes", "0.05", "--max-new-tokens", "8", "--threads", "1"]) == 0
    assert out.is_file()
    captured = capsys.readouterr()
    assert "held-out top-1 agreement" in captured.out and "[draft] done" in captured.err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-minutes", "0"], "--max-minutes must be > 0"),
        (["--vocab-size", "3"], "--vocab-size must be in"),
        (["--layers", "0,x"], "--layers must be comma-separated"),
        (["--layers", "7"], "source layers (7,) outside"),
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
    ],
)
def test_cli_bad_arguments_exit_2_with_a_message(tmp_path, capsys, extra, message):
    folder = write_hf_folder(tiny_checkpoint(0), tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n")
    argv = ["draft", "train", "--model", str(folder), "--prompts", str(prompts)]
    assert _cli(argv + ["--out", str(tmp_path / "o.pt"), "--threads", "1"] + extra) == 2
    assert message in capsys.readouterr().err
