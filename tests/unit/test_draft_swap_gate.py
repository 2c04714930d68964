"""A draft ships only if it pays: the gate refuses a slower draft and one that changes greedy
output; an accepted one is hot-swapped into a serving engine between steps, changing no
stream's text, and its version shows in stats and /metrics."""

from __future__ import annotations

import argparse
import json
import time

from prometheus_client import CollectorRegistry

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model.tiny import TINY_CONFIG, tiny_checkpoint, write_hf_folder
from engine.speculative.head_file import read_head, save_head
from engine.speculative.head_model import DraftHead, init_head_from_checkpoint
from services.worker.engine_metrics import EngineMetrics
from shared.training_log import LoggedTurn, TrainingLogWriter
from tests.unit.test_spec_head import FINGERPRINT, GREEDY, head_file, plain  # noqa: F401
from tools.bench.draft_gate import GateRun, decide, gate, install
from tools.commands import draft_cmd

SALT = FINGERPRINT.encode()


def _factory(model, wrap=None):
    """Engines as the gate builds them; `wrap(engine)` alters the candidate's (tests)."""

    def make(draft):
        config = EngineConfig(
            num_blocks=200,
            speculative_method="draft" if draft else "none",
            num_speculative_tokens=4,
            draft_path=draft,
        )
        engine = Engine(config, model=model, kv_salt=SALT)
        if draft is not None and wrap is not None and "candidate" in draft:
            wrap(engine)
        return engine

    return make


class _Slow:
    """The same draft, 20 ms slower per proposal: it can only lose."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name

    def propose(self, requests, sampling):
        time.sleep(0.02)
        return self.inner.propose(requests, sampling)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _candidate(tmp_path, head_file):  # noqa: F811
    path = tmp_path / "candidate.head.pt"
    path.write_bytes(head_file.path.read_bytes())
    return str(path)


def test_gate_refuses_a_slower_draft(tiny_model, plain, head_file, tmp_path):  # noqa: F811
    prompts, _ = plain

    def slow(engine):
        engine.speculator.draft = _Slow(engine.speculator.draft)

    make = _factory(tiny_model, slow)
    verdict = gate(make, prompts[:4], _candidate(tmp_path, head_file), None, (1, 4), 16)
    assert not verdict.accepted
    assert any("does not beat none" in r for r in verdict.reasons)
    report = verdict.as_json()
    assert report["runs"]["candidate"]["identical_greedy"] is True  # slower, still exact
    assert json.dumps(report)  # what --json writes


def test_gate_refuses_a_draft_that_changes_greedy_output(tiny_model, plain, head_file, tmp_path):  # noqa: F811
    prompts, _ = plain

    def corrupt(engine):
        step = engine.step

        def tampered(**kwargs):
            outs = step(**kwargs)
            for out in outs:
                out.new_token_ids = [(t + 1) % TINY_CONFIG.vocab_size for t in out.new_token_ids]
            return outs

        engine.step = tampered

    make = _factory(tiny_model, corrupt)
    verdict = gate(make, prompts[:4], _candidate(tmp_path, head_file), None, (1, 4), 16)
    assert not verdict.accepted
    assert "greedy output differs from plain decoding at batch 1" in verdict.reasons


def test_gate_accepts_only_what_beats_every_rival():
    same = {1: [[1, 2]], 8: [[1, 2]]}
    runs = {
        "none": GateRun("none", same, 100, 10.0, 1.0),
        "current": GateRun("current", same, 100, 5.0, 2.0),
        "candidate": GateRun("candidate", same, 100, 4.0, 2.5),
    }
    assert decide(runs).accepted
    runs["candidate"] = GateRun("candidate", same, 100, 6.0, 2.5)  # beats none, not current
    verdict = decide(runs)
    assert not verdict.accepted
    assert verdict.reasons == ["16.7 tok/s does not beat current's 20.0 by 3%"]


def test_a_gain_within_the_replays_noise_does_not_ship():
    """20.4 against 20.0 tok/s (2%) is below the default 3% margin; 21 (5%) clears it; with
    the margin set to 0 any strict gain does."""
    same = {1: [[1, 2]]}
    runs = {
        "none": GateRun("none", same, 100, 10.0, 1.0),
        "current": GateRun("current", same, 100, 5.0, 2.0),
        "candidate": GateRun("candidate", same, 102, 5.0, 2.1),
    }
    verdict = decide(runs)
    assert not verdict.accepted
    assert verdict.reasons == ["20.4 tok/s does not beat current's 20.0 by 3%"]
    assert decide(runs, min_gain=0.0).reasons == ["faster than every rival, output identical"]
    runs["candidate"] = GateRun("candidate", same, 105, 5.0, 2.1)
    verdict = decide(runs)
    assert verdict.accepted
    assert verdict.reasons == ["faster than every rival by more than 3%, output identical"]


def test_the_gate_cli_refuses_a_margin_outside_0_to_1(capsys):
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    argv = ["draft", "gate", "--candidate", "c.pt", "--from-log", "x.jsonl", "--min-gain", "1.5"]
    args = parser.parse_args(argv)
    assert args.handler(args) == 2
    assert "--min-gain must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_hot_swap_under_load_changes_no_stream(tiny_model, plain, head_file, tmp_path):  # noqa: F811
    """Eight greedy streams; mid-run the served head file is replaced (as `gate --install`
    does), the watcher loads it and the engine installs it between two steps."""
    prompts, expected = plain
    served = tmp_path / "served.head.pt"
    install(head_file.path, served)
    engine = Engine(
        EngineConfig(
            num_blocks=200,
            speculative_method="draft",
            num_speculative_tokens=4,
            draft_path=str(served),
        ),
        model=tiny_model,
        kv_salt=SALT,
    )
    registry = CollectorRegistry()
    engine.step_observers.append(EngineMetrics(registry, engine, "tiny", "decode"))
    watcher = engine.watch_draft_file(str(served), interval_s=3600)  # polled by hand below
    old_version = engine.spec_stats()["draft_version"]
    # The replacement: another head (untrained weights) with the same vocabulary.
    old = read_head(head_file.path, FINGERPRINT, TINY_CONFIG.vocab_size)
    other = DraftHead(old.config)
    init_head_from_checkpoint(other, tiny_checkpoint(seed=0).tensors)
    replacement = save_head(tmp_path / "new.head.pt", other, old.vocab_ids, FINGERPRINT, 512, {})
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    results: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_work:
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        steps += 1
        if steps == 4:
            install(replacement, served)
            assert watcher.poll()  # loaded off the engine thread; installed next step
        engine.blocks.check_integrity()
    watcher.stop()
    assert [results[i] for i in ids] == expected
    stats = engine.spec_stats()
    new_version = read_head(replacement, FINGERPRINT, 512).version
    assert stats["draft_version"] == new_version != old_version and stats["draft_swaps"] == 1
    info = "splitserve_spec_decode_draft_info"
    labels = {"model": "tiny", "role": "decode"}
    assert registry.get_sample_value(info, labels | {"version": new_version}) == 1
    assert registry.get_sample_value(info, labels | {"version": old_version}) is None
    assert stats["by_method"]["draft"]["steps"] > 4  # the new head drafted after the swap


def test_gate_cli_replays_the_held_out_slice_and_reports(plain, head_file, tmp_path, capsys):  # noqa: F811
    """The CLI end to end on a tiny folder: a head trained for another tokenizer cannot load,
    so it is refused (exit 1) with the reason, and the verdict is written as JSON."""
    prompts, expected = plain
    folder = write_hf_folder(tiny_checkpoint(0), tmp_path / "tiny")
    log = TrainingLogWriter(tmp_path / "traffic.jsonl", 1.0)
    log.write([LoggedTurn("tiny", "default", p, e) for p, e in zip(prompts, expected, strict=True)])
    out = tmp_path / "verdict.json"
    argv = ["draft", "gate", "--model", str(folder), "--from-log", str(log.path)]
    argv += ["--candidate", str(head_file.path), "--heldout-fraction", "1.0", "--threads", "1"]
    argv += ["--batches", "1,4", "--max-tokens", "8", "--max-prompts", "4", "--json", str(out)]
    argv += ["--install", str(tmp_path / "served.head.pt")]
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.handler(args) == 1
    assert capsys.readouterr().out.startswith("REFUSED: the candidate did not load")
    report = json.loads(out.read_text())
    assert not report["accepted"] and set(report["runs"]) == {"none", "candidate"}
    assert report["runs"]["candidate"]["identical_greedy"] is True
    assert not (tmp_path / "served.head.pt").exists()  # nothing installed
