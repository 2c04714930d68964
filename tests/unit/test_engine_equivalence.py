"""Greedy output through every engine path equals the plain single-sequence reference."""

from __future__ import annotations

import random

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from shared.sampling.params import SamplingParams
from tests.reference import greedy_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 70))] for _ in range(count)]


def _engine(model, **overrides) -> Engine:
    cfg = dict(num_blocks=128, block_size=16, max_num_batched_tokens=512)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model)


def _filler(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(100 + seed)
    return [rng.randrange(3, 500) for _ in range(length)]


@pytest.fixture(scope="module")
def references(tiny_model):
    return [greedy_reference(tiny_model, p, GREEDY.max_tokens) for p in _prompts(8)]


def test_single_sequence_matches_reference(tiny_model, references):
    prompt = _prompts(8)[0]
    engine = _engine(tiny_model)
    assert engine.generate([prompt], GREEDY) == [references[0]]
    engine.blocks.check_integrity()


def test_batch_of_eight_mixed_lengths_matches_alone(tiny_model, references):
    engine = _engine(tiny_model)
    assert engine.generate(_prompts(8), GREEDY) == references
    engine.blocks.check_integrity()


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_matches_unchunked(tiny_model, references, chunk):
    engine = _engine(tiny_model, max_num_batched_tokens=chunk)
    assert engine.generate(_prompts(8), GREEDY) == references
    engine.blocks.check_integrity()


def test_cached_prefix_matches_fresh(tiny_model, references):
    engine = _engine(tiny_model)
    prompt = _prompts(8)[3]
    first = engine.generate([prompt], GREEDY)
    rid = engine.add_request(prompt, GREEDY)
    outs = list(engine.run_until_done())
    assert [t for o in outs for t in o.new_token_ids] == first[0] == references[3]
    assert outs[0].num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert rid
    engine.blocks.check_integrity()


LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def growing(tiny_model):
    """Four 32-token prompts that each grow to 72 tokens: 4 x 5 blocks > a 10-block pool."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(32)] for _ in range(4)]
    return prompts, [greedy_reference(tiny_model, p, LONG.max_tokens) for p in prompts]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_and_resumed_matches_uninterrupted(tiny_model, growing, mode):
    prompts, expected = growing
    engine = _engine(
        tiny_model, num_blocks=10, preemption_mode=mode, host_cache_bytes=64 * 1024 * 1024
    )
    ids = [engine.add_request(p, LONG) for p in prompts]
    seqs = [engine.sequences[i] for i in ids]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    for out in engine.run_until_done():
        outputs[out.request_id].extend(out.new_token_ids)
        engine.blocks.check_integrity()
    assert sum(s.num_preemptions for s in seqs) > 0, "the pool was meant to run out"
    assert [outputs[i] for i in ids] == expected
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks


def test_spilled_to_host_and_back_matches_never_spilled(tiny_model, references):
    engine = _engine(tiny_model, num_blocks=12, host_cache_bytes=64 * 1024 * 1024)
    prompts = _prompts(8)
    target = prompts[5]
    assert engine.generate([target], GREEDY) == [references[5]]
    # A 176-token filler needs all 12 blocks: the target's cached blocks must leave the
    # device, and they spill to the host tier instead of being dropped.
    engine.generate([_filler(176)], GREEDY)
    match = engine.blocks.match_prefix(target)
    assert match.num_host_blocks > 0 and match.num_device_blocks == 0
    assert engine.generate([target], GREEDY) == [references[5]]
    assert engine.blocks.stats.host_hit_blocks > 0
    engine.blocks.check_integrity()


def test_spill_to_disk_and_back(tiny_model, references, tmp_path):
    layout = tiny_model.kv_layout(16)
    engine = _engine(
        tiny_model,
        num_blocks=12,
        host_cache_bytes=2 * layout.block_bytes,
        disk_cache_bytes=64 * layout.block_bytes,
        disk_cache_dir=str(tmp_path),
    )
    prompts = _prompts(8)
    engine.generate([prompts[6]], GREEDY)
    for seed in range(3):  # each filler pushes the previous blocks device -> host -> disk
        engine.generate([_filler(150, seed)], GREEDY)
    match = engine.blocks.match_prefix(prompts[6])
    assert match.num_disk_blocks > 0
    assert engine.generate([prompts[6]], GREEDY) == [references[6]]
    engine.blocks.check_integrity()
