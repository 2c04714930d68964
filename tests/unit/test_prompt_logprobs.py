"""Prompt logprobs are computed for every prompt position, cached prefix or not.

A request asking for them takes no more of its prefix from the cache than the positions it
already has logprobs for (`Sequence.max_reused_tokens`), so the values are the same whether
another request cached the prefix, the prompt was chunked, or the sequence was preempted
and recomputed.
"""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.sequence import Sequence
from shared.sampling.logprob import TokenLogprob
from shared.sampling.params import SamplingParams
from tests.reference import dense_logits

BLOCK = 16
PROMPT = list(range(7, 60))  # 53 tokens: three full blocks and a partial one


def _engine(tiny_model, **config) -> Engine:
    return Engine(EngineConfig(num_blocks=48, block_size=BLOCK, **config), model=tiny_model)


def _prompt_logprobs(engine: Engine, prompt: list[int], k: int = 3) -> list[TokenLogprob]:
    rid = engine.add_request(
        prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), prompt_logprobs=True
    )
    outs = [o for o in engine.run_until_done() if o.request_id == rid]
    assert outs[0].prompt_logprobs is not None
    return outs[0].prompt_logprobs


def test_values_and_alternatives_match_a_dense_forward(tiny_model):
    got = _prompt_logprobs(_engine(tiny_model), PROMPT, k=3)
    logits = dense_logits(tiny_model, PROMPT).log_softmax(-1)
    assert [lp.token_id for lp in got] == PROMPT[1:]
    for position, lp in enumerate(got, start=1):
        row = logits[position - 1]
        assert lp.logprob == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
        values, ids = row.topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_cached_prefix_gives_the_same_logprobs_as_a_cold_cache(tiny_model):
    cold = _prompt_logprobs(_engine(tiny_model), PROMPT)

    warm = _engine(tiny_model)
    warm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2))  # caches 3 blocks
    assert warm.blocks.match_prefix(PROMPT).num_blocks == 3
    rid = warm.add_request(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3), prompt_logprobs=True
    )
    seq = warm.sequences[rid]
    outs = list(warm.run_until_done())
    assert seq.num_cached_prompt_tokens == 0  # computed, and reported as not cached
    hot = outs[0].prompt_logprobs
    assert hot is not None and len(hot) == len(cold) == len(PROMPT) - 1
    for a, b in zip(cold, hot, strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # A plain request after it still reuses the prefix.
    rid = warm.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    seq = warm.sequences[rid]
    list(warm.run_until_done())
    assert seq.num_cached_prompt_tokens == 3 * BLOCK
    warm.blocks.check_integrity()


def test_chunked_prefill_gives_the_same_logprobs(tiny_model):
    whole = _prompt_logprobs(_engine(tiny_model), PROMPT)
    chunked = _prompt_logprobs(_engine(tiny_model, max_num_batched_tokens=BLOCK), PROMPT)
    assert [lp.logprob for lp in chunked] == pytest.approx([lp.logprob for lp in whole], abs=1e-4)


def test_reuse_is_limited_to_the_positions_already_known():
    seq = Sequence("r", list(range(40)), SamplingParams())
    assert seq.max_reused_tokens is None  # not asked: the whole cached prefix may be reused
    seq.prompt_logprobs = []
    assert seq.max_reused_tokens == 0
    seq.add_prompt_logprobs(1, [TokenLogprob(t, -1.0) for t in range(1, 21)])  # tokens 1..20
    assert seq.max_reused_tokens == 20  # the pass over token 20 gives token 21's
    # Recomputed from token 16 after a preemption: what is known stays, the rest is added.
    seq.add_prompt_logprobs(17, [TokenLogprob(t, -2.0) for t in range(17, 40)])
    assert [lp.token_id for lp in seq.prompt_logprobs] == list(range(1, 40))
    assert {lp.logprob for lp in seq.prompt_logprobs[:20]} == {-1.0}
    assert seq.max_reused_tokens is None  # complete: reuse is free again
    with pytest.raises(RuntimeError, match="skipped"):
        gap = Sequence("g", list(range(40)), SamplingParams(), prompt_logprobs=[])
        gap.add_prompt_logprobs(17, [TokenLogprob(t, -1.0) for t in range(17, 40)])
