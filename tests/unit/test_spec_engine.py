"""Speculative decoding in the engine (tiny model): greedy output equals plain decoding, KV
rollback stays clean, stops land exactly where plain decoding puts them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.core.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model.tiny import TINY_CONFIG, tiny_checkpoint
from engine.speculative.draft_model import model_from_checkpoint
from engine.speculative.draft_proposer import ModelDraftProposer
from shared.sampling.params import SamplingParams
from tests.spec_helpers import OracleProposer, checked_run, motif_prompts, pin_step_costs

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(model, method="none", draft=None, **overrides) -> Engine:
    cfg = dict(num_blocks=96, block_size=16, speculative_method=method)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model, draft=draft)


@pytest.fixture(scope="module")
def plain(tiny_model):
    prompts = motif_prompts(8)
    return prompts, _engine(tiny_model).generate(prompts, GREEDY)


@pytest.mark.parametrize("method", ["ngram", "adaptive"])
@pytest.mark.parametrize("batch", [1, 8])
def test_model_free_greedy_equals_plain(tiny_model, plain, method, batch):
    prompts, expected = plain
    engine = _engine(tiny_model, method, num_speculative_tokens=5)
    pin_step_costs(engine)
    got = []
    for i in range(0, len(prompts), batch):
        got += checked_run(engine, prompts[i : i + batch], GREEDY)
    assert got == expected
    # Drafts were really verified: an adaptive that never speculates cannot pass.
    assert engine.spec_stats()["verify_steps"] > 0


@pytest.mark.parametrize("k", [1, 4, 16])
def test_oracle_drafts_greedy_equal_plain_and_roll_back_cleanly(tiny_model, plain, k):
    prompts, expected = plain
    oracle = OracleProposer(
        {tuple(p): e for p, e in zip(prompts, expected, strict=True)}, wrong_every=3
    )
    # Small blocks: accepted runs and rollbacks cross block boundaries all the time.
    engine = _engine(
        tiny_model, "draft", oracle, num_speculative_tokens=k, block_size=4, num_blocks=200
    )
    assert checked_run(engine, prompts, GREEDY) == expected
    stats = engine.spec_stats()
    assert stats["by_method"]["draft"]["accepted_tokens"] > 0
    hist = stats["accepted_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0  # both rejections and acceptances happened
    assert sum(hist) == stats["verify_steps"]
    assert oracle.released == set(engine.sequences) | {f"req-{i}" for i in range(8)}


def test_penalties_greedy_equal_plain(tiny_model):
    prompts = motif_prompts(4, seed=9)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    )
    expected = _engine(tiny_model).generate(prompts, params)
    oracle = OracleProposer({tuple(p): e for p, e in zip(prompts, expected, strict=True)}, 4)
    got = checked_run(
        _engine(tiny_model, "draft", oracle, num_speculative_tokens=6), prompts, params
    )
    assert got == expected


def test_stop_token_and_length_inside_an_accepted_run(tiny_model, plain):
    prompts, expected = plain
    prompt, cont = prompts[0], expected[0]
    stop_at = next(i for i in range(3, len(cont)) if cont[i] not in cont[:i])
    oracle = OracleProposer({tuple(prompt): cont}, wrong_every=0)  # never wrong: long runs
    engine = _engine(tiny_model, "draft", oracle, num_speculative_tokens=8)
    stop = SamplingParams(
        temperature=0.0, max_tokens=24, stop_token_ids=[cont[stop_at]], ignore_eos=True
    )
    assert checked_run(engine, [prompt], stop) == [cont[: stop_at + 1]]
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    assert checked_run(engine, [prompt], short) == [cont[:7]]


def test_async_engine_streams_multi_token_chunks(tiny_model, plain):
    prompts, expected = plain
    oracle = OracleProposer({tuple(prompts[1]): expected[1]}, wrong_every=0)
    engine = _engine(tiny_model, "draft", oracle, num_speculative_tokens=6)
    runner = AsyncEngine(engine)
    runner.start()

    async def collect() -> list[list[int]]:
        chunks = []
        async for out in runner.generate(lambda e: e.add_request(prompts[1], GREEDY)):
            chunks.append(out.new_token_ids)
        return chunks

    try:
        chunks = asyncio.run(collect())
    finally:
        runner.stop()
    assert [t for c in chunks for t in c] == expected[1]
    assert max(len(c) for c in chunks) > 1


def test_seeded_sampling_is_reproducible(tiny_model, plain):
    prompts, _ = plain
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=11, ignore_eos=True)
    runs = [
        checked_run(_engine(tiny_model, "ngram", num_speculative_tokens=4), prompts[:3], params)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_logprob_requests_are_served_alongside_drafts(tiny_model, plain):
    prompts, expected = plain
    oracle = OracleProposer({tuple(p): e for p, e in zip(prompts, expected, strict=True)}, 0)
    engine = _engine(tiny_model, "draft", oracle, num_speculative_tokens=4)
    with_lp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    engine.add_request(prompts[0], GREEDY, request_id="fast")
    engine.add_request(prompts[1], with_lp, request_id="lp")
    tokens: dict[str, list[int]] = {"fast": [], "lp": []}
    logprobs = []
    for out in engine.run_until_done():
        tokens[out.request_id].extend(out.new_token_ids)
        if out.request_id == "lp":
            logprobs.extend(out.logprobs)
    assert tokens == {"fast": expected[0], "lp": expected[1]}
    assert [lp.token_id for lp in logprobs] == expected[1]
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_num_speculative_tokens_range_is_enforced():
    from pydantic import ValidationError

    from shared.config.speculative import SpeculativeConfig

    with pytest.raises(ValueError, match=r"0\.\.16"):
        EngineConfig(num_speculative_tokens=17)
    with pytest.raises(ValidationError, match=r"0\.\.16"):
        SpeculativeConfig(num_speculative_tokens=17)
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="magic")  # type: ignore[arg-type]
    assert SpeculativeConfig(num_speculative_tokens=16).num_speculative_tokens == 16
    from shared.config.schema import ConfigError, parse_config

    bad = {"models": [{"speculative": {"method": "adaptive", "num_speculative_tokens": 17}}]}
    with pytest.raises(ConfigError, match=r"num_speculative_tokens must be in 0\.\.16, got 17"):
        parse_config(bad)


def test_missing_draft_keeps_ngram_on(tiny_model, tmp_path, plain):
    prompts, expected = plain
    engine = _engine(
        tiny_model, "draft", draft_path=str(tmp_path / "nope.draft.pt"), num_speculative_tokens=4
    )
    reason = engine.spec_stats()["draft_unavailable"]
    assert "nope.draft.pt" in reason
    assert checked_run(engine, prompts[:2], GREEDY) == expected[:2]
    assert engine.spec_stats()["by_method"]["ngram"]["steps"] > 0


def test_corrupt_draft_file_is_reported(tiny_model, tmp_path):
    bad = tmp_path / "bad.draft.pt"
    bad.write_bytes(b"not a draft")
    engine = _engine(tiny_model, "adaptive", draft_path=str(bad))
    assert "bad.draft.pt" in engine.spec_stats()["draft_unavailable"]


def _model_draft(layers: tuple[int, ...]):
    """The DRAFT helper's proposer over a subset of the tiny target's own layers."""
    vocab = torch.arange(TINY_CONFIG.vocab_size)
    model = model_from_checkpoint(tiny_checkpoint(seed=0), layers, vocab).eval()
    return ModelDraftProposer(model, vocab, TINY_CONFIG.vocab_size)


@pytest.mark.parametrize("method", ["draft", "adaptive"])
@pytest.mark.parametrize("batch", [1, 8])
def test_model_draft_greedy_equals_plain(tiny_model, plain, method, batch):
    prompts, expected = plain
    engine = _engine(tiny_model, method, _model_draft((0,)), num_speculative_tokens=4)
    pin_step_costs(engine)
    got = []
    for i in range(0, len(prompts), batch):
        got += checked_run(engine, prompts[i : i + batch], GREEDY)
    assert got == expected
    assert engine.spec_stats()["verify_steps"] > 0  # adaptive too: it really speculated
    if method == "draft":
        stats = engine.spec_stats()["by_method"]["draft"]
        assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]


def test_model_draft_sampling_runs_clean(tiny_model, plain):
    prompts, _ = plain
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)
    engine = _engine(tiny_model, "draft", _model_draft((0,)), num_speculative_tokens=4)
    outputs = checked_run(engine, prompts, params)
    assert all(len(o) == 16 for o in outputs)
    assert engine.spec_stats()["by_method"]["draft"]["steps"] > 0
