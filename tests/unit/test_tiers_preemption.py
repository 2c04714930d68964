"""Tiers inside the engine: a `batch` decode gives up its KV blocks when a `priority`
request needs them, and both still finish with the tokens they would have had alone."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.service_tiers import tier_priority
from shared.sampling.params import SamplingParams

BLOCK = 16
BATCH_PROMPT = list(range(3, 51))  # 48 tokens, 3 blocks
PRIORITY_PROMPT = list(range(60, 108))  # 48 tokens, 3 blocks
BIG_BATCH_PROMPT = list(range(110, 210))  # 100 tokens: fits one step's budget with the above


def _engine(tiny_model, mode: str, num_blocks: int = 5) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=128,
        preemption_mode=mode,
        host_cache_bytes=8 * 1024**2 if mode == "swap" else 0,
    )
    return Engine(config, model=tiny_model)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def _alone(tiny_model, prompt: list[int], n: int) -> list[int]:
    engine = _engine(tiny_model, "recompute", num_blocks=16)
    engine.add_request(prompt, _params(n), request_id="alone")
    return [t for out in engine.run_until_done() for t in out.new_token_ids]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_request_preempts_a_batch_decode(tiny_model, mode):
    engine = _engine(tiny_model, mode)
    engine.add_request(
        BATCH_PROMPT, _params(24), request_id="batch", priority=tier_priority("batch")
    )
    tokens: dict[str, list[int]] = {"batch": [], "priority": []}
    order: list[str] = []  # which request produced each token, in time order
    for _ in range(4):  # the batch request is decoding, holding 4 of the 5 blocks
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["batch"], "the batch request should be decoding before priority arrives"
    batch_seq = engine.sequences["batch"]
    engine.add_request(
        PRIORITY_PROMPT, _params(8), request_id="priority", priority=tier_priority("priority")
    )
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            order += [out.request_id] * len(out.new_token_ids)
    assert batch_seq.num_preemptions >= 1
    # The priority request ran to completion before the batch one produced another token.
    last_priority = max(i for i, rid in enumerate(order) if rid == "priority")
    first_batch = order.index("batch")
    assert last_priority < first_batch
    # Preemption (swap or recompute) does not change what either request says.
    assert tokens["priority"] == _alone(tiny_model, PRIORITY_PROMPT, 8)
    assert tokens["batch"] == _alone(tiny_model, BATCH_PROMPT, 24)
    engine.blocks.check_integrity()


def test_a_priority_prompt_does_not_share_its_step_with_a_batch_prompt(tiny_model):
    engine = _engine(tiny_model, "recompute", num_blocks=32)
    engine.add_request(
        BIG_BATCH_PROMPT, _params(4), request_id="batch", priority=tier_priority("batch")
    )
    engine.add_request(
        PRIORITY_PROMPT, _params(4), request_id="priority", priority=tier_priority("priority")
    )
    batch = engine.scheduler.schedule()
    # The priority prompt's chunk runs alone (the budget would have fit both), so its first
    # token is not delayed by computing the batch prompt alongside it.
    assert [(s.seq.request_id, s.num_tokens) for s in batch.scheduled] == [
        ("priority", len(PRIORITY_PROMPT))
    ]
    fresh = _engine(tiny_model, "recompute", num_blocks=32)
    fresh.add_request(
        BIG_BATCH_PROMPT, _params(4), request_id="batch", priority=tier_priority("batch")
    )
    fresh.add_request(
        PRIORITY_PROMPT, _params(4), request_id="priority", priority=tier_priority("priority")
    )
    done = {out.request_id for out in fresh.run_until_done() if out.finished}
    assert done == {"batch", "priority"}  # the batch prompt is deferred, not starved
    fresh.blocks.check_integrity()


def test_background_prompts_are_cut_into_short_steps(tiny_model):
    engine = _engine(tiny_model, "recompute", num_blocks=32)
    assert engine.config.background_chunk_tokens == 64
    engine.add_request(BIG_BATCH_PROMPT, _params(2), request_id="batch", priority=3)
    engine.add_request(PRIORITY_PROMPT, _params(2), request_id="default", priority=1)
    # Default first (alone: a more urgent prompt is pending), then batch in 64-token chunks.
    sizes = []
    engine.step_observers.append(
        lambda batch, *_: sizes.append([(s.seq.request_id, s.num_tokens) for s in batch.scheduled])
    )
    list(engine.run_until_done())
    prompt_steps = [step for step in sizes if any(n > 1 for _, n in step)]
    assert prompt_steps[0] == [("default", len(PRIORITY_PROMPT))]
    batch_chunks = [n for step in prompt_steps for rid, n in step if rid == "batch" and n > 1]
    assert batch_chunks == [64, len(BIG_BATCH_PROMPT) - 64]
    engine.blocks.check_integrity()
