"""The draft head (EAGLE-style, over the target's hidden states) in the engine, tiny model:
greedy output equals plain decoding at batch 1 and 8, stops inside accepted runs land where
plain decoding puts them, the head's view of the target's states survives rollbacks, and
sampling keeps the target's distribution."""

from __future__ import annotations

import argparse
import random
from collections import Counter

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.speculator import MERGED, PRIOR_RIDE_GAIN, RIDE
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.model.tiny import TINY_CONFIG, tiny_checkpoint, write_hf_folder
from engine.speculative.draft_model import BatchKV, model_from_checkpoint
from engine.speculative.head_file import read_head
from engine.speculative.head_load import load_head_proposer
from engine.speculative.head_model import DraftHead, head_config, init_head_from_checkpoint
from engine.speculative.head_proposer import HeadDraftProposer
from engine.speculative.head_train import HeadTrainConfig, train_head
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import DraftRequest
from shared.sampling.params import SamplingParams
from shared.training_log import LoggedTurn, TrainingLogWriter
from tests.spec_helpers import (
    checked_run,
    motif_prompts,
    pin_draft_cost,
    pin_step_costs,
    verified_drafts,
)
from tests.unit.test_spec_sampling import (
    PARAMS,
    PROMPT,
    SAMPLES,
    _chi_square_p_value,
    _exact_joint,
    sampling_engine,
)
from tools.commands import draft_cmd

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
FINGERPRINT = "tiny-test-tokenizer"


def _engine(model, method="none", draft=None, **overrides) -> Engine:
    # Trees at every batch size these tests run (the default cap would turn b8 to chains).
    cfg = dict(num_blocks=200, block_size=4, speculative_method=method, draft_tree_max_batch=8)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model, draft=draft)


@pytest.fixture(scope="module")
def plain(tiny_model):
    prompts = motif_prompts(8, seed=3)
    return prompts, _engine(tiny_model).generate(prompts, GREEDY)


@pytest.fixture(scope="module")
def head_file(tiny_model, plain, tmp_path_factory):
    """A head trained on the tiny target's own greedy replies to the test prompts, so that
    long accepted runs occur; one more conversation is the held-out one."""
    prompts, expected = plain
    conversations = [(p + r, len(p)) for p, r in zip(prompts, expected, strict=True)]
    (extra,) = motif_prompts(1, seed=11)
    conversations.append((extra + _engine(tiny_model).generate([extra], GREEDY)[0], len(extra)))
    path = tmp_path_factory.mktemp("head") / "tiny.head.pt"
    config = HeadTrainConfig(
        max_minutes=2, max_steps=150, vocab_size=256, window=64, lr=1e-2, heldout_fraction=1e-4
    )
    report = train_head(
        tiny_checkpoint(seed=0), conversations, path, FINGERPRINT, config=config, log=lambda _: None
    )
    return report


def test_chained_training_sees_what_serving_sees():
    """forward_chained's step s at slot i equals s - 1 chained proposals after the true pairs
    up to slot i - s + 1, through the KV cache: training optimises the served computation."""
    checkpoint = tiny_checkpoint(seed=0)
    head = DraftHead(head_config(TINY_CONFIG, 512))
    init_head_from_checkpoint(head, checkpoint.tensors)
    head.attach_target(checkpoint.tensors["embed_tokens"], checkpoint.tensors["embed_tokens"])
    gen = torch.Generator().manual_seed(0)
    t = 12
    features = torch.randn(1, t, TINY_CONFIG.hidden_size, generator=gen)
    ids = torch.randint(0, 512, (1, t), generator=gen)
    with torch.no_grad():
        chained = head.forward_chained(features, ids, 3)
        for s in (1, 2, 3):
            for i in range(s - 1, t):
                last = i - s + 1
                kv = BatchKV.empty(head.config, 1, 32)
                f = head(features[:, : last + 1], ids[:, : last + 1], torch.tensor([0]), kv)[:, -1]
                for r in range(2, s + 1):
                    at = last + r - 1
                    f = head(f[:, None], ids[:, at : at + 1], torch.tensor([at]), kv)[:, 0]
                torch.testing.assert_close(f[0], chained[s - 1][0, i], atol=1e-4, rtol=1e-4)


def _head(tiny_model, head_file) -> HeadDraftProposer:
    return load_head_proposer(head_file.path, FINGERPRINT, TINY_CONFIG.vocab_size, tiny_model)


def test_training_runs_end_to_end_and_learns(head_file):
    assert head_file.steps == 150 and head_file.path.is_file()
    assert head_file.extra["final_train_loss"] < 0.75 * head_file.extra["initial_train_loss"]
    saved = read_head(head_file.path, FINGERPRINT, TINY_CONFIG.vocab_size)
    assert saved.stats["steps"] == 150 and len(saved.version) == 12
    assert set(saved.state_dict) == {"fc.weight", "norm"} | {
        f"layer.{n}"
        for n in (
            "input_norm",
            "post_attention_norm",
            "qkv.weight",
            "o_proj.weight",
            "gate_up.weight",
            "down.weight",
        )
    }  # the target's embedding and output rows are shared, not stored


def test_training_goes_on_from_a_head_and_keeps_its_vocabulary(plain, head_file, tmp_path):
    """Online adaptation's warm start: the new run starts where the head left off (its held-out
    agreement, not a fresh layer's), keeps its vocabulary and counts every round's steps."""
    prompts, expected = plain
    conversations = [(p + r, len(p)) for p, r in zip(prompts, expected, strict=True)]
    before = read_head(head_file.path, FINGERPRINT, TINY_CONFIG.vocab_size)
    config = HeadTrainConfig(
        max_minutes=2, max_steps=5, vocab_size=256, window=64, lr=1e-3, lr_continued=4e-4
    )
    kwargs = {"config": config, "log": lambda _: None}
    fresh = train_head(
        tiny_checkpoint(seed=0), conversations, tmp_path / "fresh.pt", FINGERPRINT, **kwargs
    )
    went_on = train_head(
        tiny_checkpoint(seed=0),
        conversations,
        tmp_path / "on.pt",
        FINGERPRINT,
        init=before,
        **kwargs,
    )
    assert went_on.initial_agreement > fresh.initial_agreement + 0.2
    after = read_head(went_on.path, FINGERPRINT, TINY_CONFIG.vocab_size)
    assert torch.equal(after.vocab_ids, before.vocab_ids)
    assert after.stats["total_steps"] == 155 and after.stats["continued_from"] == before.version
    other = read_head(fresh.path, FINGERPRINT, TINY_CONFIG.vocab_size)
    assert other.stats["continued_from"] is None and other.stats["total_steps"] == 5
    # A warm start trains at its own, lower peak rate: the head's knowledge is not undone.
    assert after.stats["lr"] == 4e-4 and went_on.extra["lr"] == 4e-4
    assert other.stats["lr"] == 1e-3 and fresh.extra["lr"] == 1e-3
    assert HeadTrainConfig().lr_continued < HeadTrainConfig().lr


def _head_drafting(tiny_model, head_file, tree_width: int) -> HeadDraftProposer:
    head = _head(tiny_model, head_file)
    head.tree_width = tree_width
    return head


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("method", ["draft", "adaptive"])
@pytest.mark.parametrize("batch", [1, 8])
def test_head_greedy_equals_plain(tiny_model, plain, head_file, method, batch, tree_width):
    prompts, expected = plain
    head = _head_drafting(tiny_model, head_file, tree_width)
    engine = _engine(tiny_model, method, head, num_speculative_tokens=5)
    verified = verified_drafts(engine)
    if method == "adaptive":
        pin_step_costs(engine)
    got = []
    for i in range(0, len(prompts), batch):
        got += checked_run(engine, prompts[i : i + batch], GREEDY)
    assert got == expected
    stats = engine.spec_stats()
    assert stats["verify_steps"] > 0  # it speculated (adaptive may prefer n-grams per row)
    if method == "draft":
        assert stats["by_method"]["draft"]["accepted_tokens"] > 0
        assert any(d.is_tree for _, d in verified) == (tree_width > 1)
    assert engine.speculator.draft.num_cached_requests == 0  # released with each request


def test_trees_give_way_to_chains_above_the_batch_cap(tiny_model, plain, head_file):
    prompts, expected = plain
    head = _head_drafting(tiny_model, head_file, tree_width=3)
    engine = _engine(tiny_model, "draft", head, num_speculative_tokens=5, draft_tree_max_batch=2)
    steps: list[tuple[int, bool]] = []  # (rows drafted, any tree) per verify step
    run = engine.runner.run

    def spy(scheduled, want):
        drafted = [i.seq.draft for i in scheduled if i.num_draft and i.seq.draft is not None]
        if drafted:
            steps.append((len(drafted), any(d.is_tree for d in drafted)))
        return run(scheduled, want)

    engine.runner.run = spy
    assert checked_run(engine, prompts[:4], GREEDY) == expected[:4]
    assert checked_run(engine, prompts[4:5], GREEDY) == expected[4:5]
    assert any(rows > 2 for rows, _ in steps)
    # Over the cap (rows drafted never exceed rows decoding), every row drafts a chain.
    assert not any(tree for rows, tree in steps if rows > 2)
    assert any(tree for rows, tree in steps if rows == 1)


def test_adaptive_drafts_head_trees_above_the_batch_cap(tiny_model, plain, head_file):
    """The cap is method draft's: adaptive prices each step's k from measured step costs, so
    it asks the head for trees however many rows decode, and output stays plain decoding's."""
    prompts, expected = plain
    head = _head_drafting(tiny_model, head_file, tree_width=3)
    engine = _engine(tiny_model, "adaptive", head, num_speculative_tokens=5, draft_tree_max_batch=1)
    pin_step_costs(engine)
    tracker = engine.speculator.acceptance
    alpha = tracker.alpha
    # The controller's choice is not under test: head drafts are priced to win.
    tracker.alpha = lambda rid, key: 0.9 if key in (MERGED, "draft") else min(0.3, alpha(rid, key))
    pin_draft_cost(engine)
    asked: list[tuple[int, bool]] = []  # (rows the head drafts for, any asked for a tree)
    propose = head.propose

    def spy(requests, sampling, trees=None):
        asked.append((len(requests), bool(trees) and any(trees)))
        return propose(requests, sampling, trees)

    head.propose = spy  # type: ignore[method-assign]
    assert checked_run(engine, prompts[:4], GREEDY) == expected[:4]
    assert any(rows > 1 and tree for rows, tree in asked)


@pytest.mark.parametrize("batch", [1, 2])
def test_adaptive_merges_the_ngram_guess_into_the_heads_tree(tiny_model, plain, head_file, batch):
    """With a draft head drafting trees, adaptive hands a row's n-gram guess to the head's
    draft as one more branch (the row keeps whichever the target agrees with): the verified
    trees carry n-gram branches, and greedy output stays plain decoding's. (Batch 8 is in
    test_head_greedy_equals_plain: on the tiny model its pinned costs pick k of 1-3, rarely
    with an n-gram guess beside the head's.)"""
    prompts, expected = plain
    head = _head_drafting(tiny_model, head_file, 2)
    engine = _engine(tiny_model, "adaptive", head, num_speculative_tokens=6)
    pin_step_costs(engine)
    # The controller's choice is not under test here: merged drafts are priced to win.
    tracker = engine.speculator.acceptance
    alpha = tracker.alpha
    tracker.alpha = lambda rid, key: 0.9 if key == MERGED else min(0.3, alpha(rid, key))
    pin_draft_cost(engine)
    seen = verified_drafts(engine)
    lookup = NgramProposer(engine.config.ngram_max, engine.config.ngram_min)
    merged = []
    run = engine.runner.run

    def spy(scheduled, want):
        for item in scheduled:
            draft = item.seq.draft
            if item.num_draft and draft is not None and draft.is_tree:
                request = DraftRequest("probe", item.seq.token_ids, 6)
                guess = lookup.propose([request], [False])[0].token_ids
                lookup.release("probe")
                # Some branch of the tree starts with the n-gram guess's first tokens.
                if guess and guess[0] in [
                    draft.token_ids[i] for i, p in enumerate(draft.parents or []) if p == -1
                ]:
                    merged.append(item.seq.request_id)
        return run(scheduled, want)

    engine.runner.run = spy
    got = []
    for i in range(0, len(prompts), batch):
        got += checked_run(engine, prompts[i : i + batch], GREEDY)
    assert got == expected
    assert seen and merged
    assert MERGED in tracker._global  # priced apart from lone head drafts


def _riding_engine(tiny_model, head_file, step_cost):
    head = _head_drafting(tiny_model, head_file, 3)
    engine = _engine(tiny_model, "adaptive", head, num_speculative_tokens=6)
    engine.speculator.set_calibration(lambda: {n: step_cost(n) for n in range(1, 257)})
    engine.speculator.observe_step = lambda num_tokens, seconds: None
    # The head-against-n-gram choice is not under test: head drafts lose it, so rows draft
    # n-gram guesses (or nothing) and only a ride-along brings the head's nodes in.
    tracker = engine.speculator.acceptance
    alpha = tracker.alpha
    tracker.alpha = lambda rid, key: 0.05 if key in (MERGED, "draft") else alpha(rid, key)
    pin_draft_cost(engine)
    return engine


@pytest.mark.parametrize("batch", [1, 4])
def test_cheap_rows_take_the_heads_nodes_along(tiny_model, plain, head_file, batch):
    """Where a verify row costs next to nothing beside a step, a row's n-gram draft (or a
    row without one) takes the head's two likeliest nodes along as a second branch; output
    stays plain decoding's, and what the nodes added is measured."""
    prompts, expected = plain
    # A step priced at a second: the head's call (measured, milliseconds) never decides.
    engine = _riding_engine(tiny_model, head_file, lambda n: 1.0)
    seen = verified_drafts(engine)
    got = []
    for i in range(0, len(prompts), batch):
        got += checked_run(engine, prompts[i : i + batch], GREEDY)
    assert got == expected
    speculator = engine.speculator
    assert RIDE in speculator.acceptance._global  # ride-alongs were verified
    assert any(draft.is_tree for _, draft in seen)
    assert speculator._ride_gain != PRIOR_RIDE_GAIN  # measured, not the prior
    # The chains that rode along kept their n-gram estimates measured.
    assert any(key.startswith("ngram:") for key in speculator.acceptance._global)


def test_dear_rows_leave_the_head_out(tiny_model, plain, head_file):
    """Where every verify row costs as much as a plain step, the head's nodes are not worth
    their rows: no row rides along."""
    prompts, expected = plain
    engine = _riding_engine(tiny_model, head_file, lambda n: 1.0 * n)
    assert checked_run(engine, prompts[:4], GREEDY) == expected[:4]
    assert RIDE not in engine.speculator.acceptance._global


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 8])
def test_stops_inside_accepted_runs(tiny_model, plain, head_file, batch, tree_width):
    prompts, expected = plain
    head = _head_drafting(tiny_model, head_file, tree_width)
    engine = _engine(tiny_model, "draft", head, num_speculative_tokens=8)
    # A stop token that plain decoding emits after several tokens, and a length limit.
    params = []
    for i, cont in enumerate(expected[:batch]):
        stop_at = next((j for j in range(4, len(cont)) if cont[j] not in cont[:j]), None)
        if stop_at is None or i % 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True))
        else:
            stop = [cont[stop_at]]
            params.append(
                SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=stop, ignore_eos=True)
            )
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:batch], params, strict=True)]
    results: dict[str, list[int]] = {i: [] for i in ids}
    for out in engine.run_until_done():
        results[out.request_id].extend(out.new_token_ids)
    for rid, sp, cont in zip(ids, params, expected[:batch], strict=True):
        want = cont[: sp.max_tokens]
        if sp.stop_token_ids:
            want = cont[: cont.index(sp.stop_token_ids[0]) + 1]
        assert results[rid] == want
    hist = engine.spec_stats()["accepted_histogram"]
    assert sum(hist[2:]) > 0  # runs of two or more accepted tokens did occur
    engine.blocks.check_integrity()


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree"])
def test_head_state_tracks_the_kept_tokens_through_rollbacks(
    tiny_model, plain, head_file, tree_width
):
    """After every step the head holds exactly the target's states of the tokens whose KV was
    kept (rejected drafts' rows dropped, a tree's accepted path moved into place), equal to
    a from-scratch dense forward."""
    prompts, expected = plain
    head = _head_drafting(tiny_model, head_file, tree_width)
    engine = _engine(tiny_model, "draft", head, num_speculative_tokens=6)
    teacher = model_from_checkpoint(tiny_checkpoint(seed=0), (0, 1), None).eval()
    rid = engine.add_request(prompts[2], GREEDY)
    checked = 0
    while engine.has_work:
        engine.step()
        seq = engine.sequences.get(rid)
        if seq is None:
            break
        origin, end = head.observed_span(rid)
        assert (origin, end) == (0, seq.num_computed_tokens)
        with torch.inference_mode():
            want = teacher(torch.tensor(seq.token_ids[:end])[None])[0]
        got = head._states[rid].features[:end]
        assert torch.allclose(got, want, atol=1e-4)
        checked += 1
    assert checked > 3
    stats = engine.spec_stats()
    # Both rejected and accepted drafts (a tree's siblings of the accepted path included).
    assert stats["draft_tokens"] > stats["accepted_tokens"] > 0


def test_cached_prefix_starts_a_window_and_output_stays_plain(tiny_model, plain, head_file):
    """A second turn over a cached prefix: the head sees states from the first uncached
    position on only, and still drafts (and output equals plain decoding)."""
    prompts, expected = plain
    head = _head(tiny_model, head_file)
    engine = _engine(tiny_model, "draft", head, num_speculative_tokens=4)
    first = prompts[0] + expected[0]
    assert checked_run(engine, [first[:-1]], GREEDY)  # fills the prefix cache
    turn = first + [7, 8, 9]
    want = _engine(tiny_model).generate([turn], GREEDY)
    rid = engine.add_request(turn, GREEDY)
    origins = set()
    out: list[int] = []
    while engine.has_work:
        for o in engine.step():
            out.extend(o.new_token_ids)
        if rid in engine.sequences and head.observed_span(rid):
            origins.add(head.observed_span(rid)[0])
    assert [out] == want
    assert origins and min(origins) > 0  # the cached blocks' states were never computed


def test_head_sampling_matches_the_target_joint_distribution(tiny_model, head_file):
    exact = _exact_joint(tiny_model)
    engine = sampling_engine(tiny_model, _head(tiny_model, head_file))
    samples = Counter(tuple(out) for out in engine.generate([PROMPT] * SAMPLES, PARAMS))
    stats = engine.spec_stats()["by_method"]["draft"]
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # both paths were exercised
    assert _chi_square_p_value(samples, exact, SAMPLES) > 1e-3
    engine.blocks.check_integrity()


def test_cli_trains_a_head_from_a_training_log_and_the_engine_serves_it(
    tiny_model, plain, tmp_path, capsys
):
    """Log -> `splitserve draft train --from-log` -> a head file the engine loads from
    `draft_path` (the tiny target's states recomputed offline from the logged ids)."""
    prompts, expected = plain
    folder = write_hf_folder(tiny_checkpoint(0), tmp_path / "tiny")
    log = TrainingLogWriter(tmp_path / "traffic.jsonl", 1.0)
    for p, e in zip(prompts, expected, strict=True):
        log.write([LoggedTurn("tiny", "default", p, e)])
    out = tmp_path / "tiny.head.pt"
    argv = ["draft", "train", "--model", str(folder), "--from-log", str(log.path)]
    argv += ["--out", str(out), "--max-minutes", "1", "--vocab-size", "256", "--threads", "1"]
    # A fixed number of steps in fp32: the same head on any machine (a CPU-time budget trains
    # as many steps as the machine's speed and load allow).
    argv += ["--max-steps", "80", "--precision", "fp32"]
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.handler(args) == 0
    captured = capsys.readouterr()
    assert "after 80 steps" in captured.out
    assert "held-out first-guess agreement" in captured.out
    assert "[head] 8 logged conversations" in captured.err and "[head] saved" in captured.err
    fingerprint = f"untokenized:{read_checkpoint(str(folder)).source}"  # the CLI's, for a folder
    engine = Engine(
        EngineConfig(
            num_blocks=200,
            speculative_method="draft",
            num_speculative_tokens=4,
            draft_path=str(out),
            # Every guess drafted: 80 steps leave the tiny head too unsure of its guesses for
            # the default cutoff, and this test is about serving the trained file at all.
            draft_min_confidence=0.0,
        ),
        model=tiny_model,
        kv_salt=fingerprint.encode(),
    )
    assert "draft_unavailable" not in engine.spec_stats()
    assert checked_run(engine, prompts[:3], GREEDY) == expected[:3]
    assert engine.spec_stats()["verify_steps"] > 0


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize(("weights", "decode_weights"), [("native", "native"), ("fp32", "native")])
def test_head_drafts_from_the_native_steps_states(
    plain, head_file, weights, decode_weights, tree_width
):
    """With the native C step on the decode path (and on both paths) the head reads the
    hidden states that step returns: no second forward, greedy still plain decoding's."""
    model = LlamaModel(tiny_checkpoint(seed=0), weights=weights, decode_weights=decode_weights)
    prompts, _ = plain
    expected = _engine(model).generate(prompts, GREEDY)
    head = load_head_proposer(head_file.path, FINGERPRINT, TINY_CONFIG.vocab_size, model)
    head.tree_width = tree_width
    engine = _engine(model, "draft", head, num_speculative_tokens=5)
    got = []
    for i in range(0, len(prompts), 4):
        got += checked_run(engine, prompts[i : i + 4], GREEDY)
    assert got == expected
    assert engine.spec_stats()["by_method"]["draft"]["accepted_tokens"] > 0


@pytest.mark.parametrize("batch", [1, 8])
def test_a_doubtful_chain_stops_early_and_the_output_stays_plain(
    tiny_model, plain, head_file, batch
):
    prompts, expected = plain
    drafted = {}
    for confidence in (0.0, 0.6):
        head = _head(tiny_model, head_file)
        head.min_chain_confidence = confidence
        engine = _engine(tiny_model, "draft", head, num_speculative_tokens=8)
        got = []
        for i in range(0, len(prompts), batch):
            got += checked_run(engine, prompts[i : i + batch], GREEDY)
        assert got == expected, f"confidence {confidence}"
        stats = engine.spec_stats()["by_method"]["draft"]
        drafted[confidence] = (stats["draft_tokens"], stats["accepted_tokens"])
    # Fewer guesses verified, most of them the doubted ones that would have been rejected.
    (full, kept_full), (short, kept_short) = drafted[0.0], drafted[0.6]
    assert short < full
    assert kept_short / short > kept_full / full


def test_the_configured_confidence_reaches_a_loaded_head(tiny_model, head_file):
    from engine.core.speculator_build import load_draft_file

    config = EngineConfig(
        num_blocks=64,
        block_size=4,
        speculative_method="draft",
        draft_min_confidence=0.45,
        draft_tree_width=3,
        draft_tree_min_confidence=0.07,
    )
    proposer, why = load_draft_file(
        config, str(head_file.path), FINGERPRINT, TINY_CONFIG.vocab_size, tiny_model
    )
    assert why is None and proposer.min_chain_confidence == 0.45 and proposer.tree_width == 3
    assert proposer.tree_min_confidence == 0.07
    with pytest.raises(ValueError, match="draft_tree_min_confidence must be in 0..1"):
        EngineConfig(num_blocks=64, block_size=4, draft_tree_min_confidence=-0.1)
    with pytest.raises(ValueError, match="draft_tree_max_batch must be at least 1"):
        EngineConfig(num_blocks=64, block_size=4, draft_tree_max_batch=0)
    with pytest.raises(ValueError, match="draft_min_confidence must be in 0..1"):
        EngineConfig(num_blocks=64, block_size=4, draft_min_confidence=1.5)
    with pytest.raises(ValueError, match="draft_tree_width must be in 1..4"):
        EngineConfig(num_blocks=64, block_size=4, draft_tree_width=0)


def test_the_serving_path_teaches_the_same_states_and_labels_every_position(tiny_model, plain):
    from engine.speculative.head_train import target_states

    prompts, replies = plain
    conversations = [(p + r, len(p)) for p, r in zip(prompts[:3], replies[:3], strict=True)]
    never = lambda: False  # noqa: E731
    dense = target_states(tiny_checkpoint(seed=0), conversations, 4, never, lambda _: None)
    served = target_states(
        tiny_checkpoint(seed=0),
        conversations,
        4,
        never,
        lambda _: None,
        serving=tiny_model,
        label_prompt=True,
    )
    for d, s, (ids, prompt_len) in zip(dense, served, conversations, strict=True):
        torch.testing.assert_close(s.states.float(), d.states.float(), atol=2e-2, rtol=2e-2)
        # Reply labels alike; the served sample labels the prompt's positions too.
        assert d.teacher.prompt_len == prompt_len and s.teacher.prompt_len == 1
        assert s.reply_from == prompt_len
        reply = s.teacher.top_ids[prompt_len - 1 :]
        assert (reply[:, 0] == d.teacher.top_ids[:, 0]).all()
        assert s.teacher.top_ids.shape[0] == len(ids)


@pytest.mark.parametrize("label_prompt", [True, False], ids=["every-position", "replies"])
def test_a_resent_conversation_shares_its_states_and_they_equal_a_fresh_computation(
    tiny_model, plain, label_prompt
):
    """A chat's next turn resends the last one whole: its shared positions' states come from
    the turn before (their KV kept in the pool), the rest are computed, and every state equals
    what the conversation computed on its own gives."""
    from engine.speculative.head_train import target_states

    prompts, replies = plain
    first = (prompts[0] + replies[0], len(prompts[0]))
    extended = first[0] + prompts[1] + replies[1]
    second = (extended, len(first[0]) + len(prompts[1]))
    lines: list[str] = []
    never = lambda: False  # noqa: E731
    args = (tiny_checkpoint(seed=0), [first, second], 4, never, lines.append)
    shared = target_states(*args, serving=tiny_model, label_prompt=label_prompt)
    # The first turn's positions once, then only what the second turn added.
    assert f"{len(first[0]) + len(extended)} tokens ({len(extended)} computed" in lines[-1]
    for conversation, sample in zip([first, second], shared, strict=True):
        alone = target_states(*args[:1], [conversation], *args[2:], serving=tiny_model,
                              label_prompt=label_prompt)[0]  # fmt: skip
        torch.testing.assert_close(sample.states.float(), alone.states.float(), atol=1e-2, rtol=0)
        assert (sample.teacher.top_ids[:, 0] == alone.teacher.top_ids[:, 0]).all()
        torch.testing.assert_close(
            sample.teacher.top_logprobs, alone.teacher.top_logprobs, atol=1e-3, rtol=0
        )
    # A turn resent whole after the one that extends it shares everything, labels included.
    again = target_states(*args[:1], [second, first], *args[2:], serving=tiny_model,
                          label_prompt=label_prompt)  # fmt: skip
    assert f"({len(extended)} computed" in lines[-1] and len(again[1].states) == len(first[0])
    assert torch.equal(again[1].teacher.top_ids, shared[0].teacher.top_ids)


def _chat(root: int, turns: int) -> list[tuple[list[int], int]]:
    """A chat of `turns` logged turns, each resending the one before and adding to it."""
    ids, out = [root, root], []
    for turn in range(turns):
        prompt = ids + [100 + turn]
        out.append((prompt + [200 + turn], len(prompt)))
        ids = prompt + [200 + turn]
    return out


def test_turns_group_into_chats_in_order_and_the_chats_come_in_drawn_order():
    from engine.speculative.head_train import prefix_order
    from shared.training_log import group_chats

    chats = [_chat(root, 3) for root in range(1, 9)]
    chats.append([([1, 1, 7, 8], 3)])  # shares a start with chat 1 but resends none of it
    turns = [t for c in chats for t in reversed(c)]
    assert sorted(map(str, group_chats(turns))) == sorted(map(str, chats))
    orders = set()
    for seed in range(4):
        ordered = prefix_order(group_chats(turns), random.Random(seed))
        assert sorted(map(str, ordered)) == sorted(map(str, turns))  # nothing lost or added
        orders.add(str(ordered))
        for chat in chats:  # each chat's turns together and in order
            at = ordered.index(chat[0])
            assert ordered[at : at + len(chat)] == chat
    assert len(orders) > 1  # the chats' order is drawn, not sorted


def test_a_chat_is_held_out_whole_so_no_held_out_reply_is_trained_on():
    from shared.training_log import is_heldout, split_heldout

    chats = [_chat(root, 3) for root in range(1, 41)]
    held, train = split_heldout([t for c in chats for t in c], 0.3)
    assert held and train and len(held) + len(train) == len(chats)
    for chat in held:
        assert chat in chats and is_heldout(chat[0][0][: chat[0][1]], 0.3)
    held_text = {tuple(ids) for chat in held for ids, _ in chat}
    for chat in train:
        for ids, _ in chat:
            assert not any(tuple(ids[: len(h)]) == h for h in held_text)
