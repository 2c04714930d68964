"""Prompt chunks are kept short while replies stream (chunk_tokens_while_decoding): a long
prompt arriving mid-reply cannot stall every stream for a whole budget of prefill, and the
output is unchanged."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from shared.sampling.params import SamplingParams

STREAMING = list(range(3, 40))
LONG = [(7 * i) % 400 + 3 for i in range(300)]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def _engine(tiny_model, cap: int | None) -> Engine:
    config = EngineConfig(num_blocks=64, block_size=16, chunk_tokens_while_decoding=cap)
    return Engine(config, model=tiny_model)


def _run(engine: Engine) -> tuple[dict[str, list[int]], list[list[tuple[str, int]]]]:
    steps: list[list[tuple[str, int]]] = []
    engine.step_observers.append(
        lambda plan, *_: steps.append([(s.seq.request_id, s.num_tokens) for s in plan.scheduled])
    )
    engine.add_request(STREAMING, _params(40), request_id="streaming")
    engine.step()  # its prompt
    engine.step()  # now decoding
    engine.add_request(LONG, _params(4), request_id="long")
    tokens: dict[str, list[int]] = {"streaming": [], "long": []}
    for out in engine.run_until_done():
        tokens[out.request_id].extend(out.new_token_ids)
    engine.blocks.check_integrity()
    return tokens, steps


@pytest.mark.parametrize("cap", [32, 128])
def test_a_long_prompt_is_cut_while_another_reply_streams(tiny_model, cap):
    capped, steps = _run(_engine(tiny_model, cap))
    uncapped, free_steps = _run(_engine(tiny_model, None))
    long_chunks = [n for step in steps for rid, n in step if rid == "long" and n > 1]
    assert max(long_chunks) <= cap and sum(long_chunks) >= len(LONG) - 1
    # Without the cap the whole prompt goes in one step beside the streaming reply.
    free_chunks = [n for step in free_steps for rid, n in step if rid == "long" and n > 1]
    assert free_chunks[0] == len(LONG)
    # The streaming reply kept a token in every step that carried the long prompt.
    for step in steps:
        if any(rid == "long" and n > 1 for rid, n in step):
            assert ("streaming", 1) in step
    # Chunking changes no output.
    assert capped == uncapped


def test_with_no_reply_streaming_a_prompt_takes_the_whole_budget(tiny_model):
    engine = _engine(tiny_model, 32)
    steps: list[int] = []
    engine.step_observers.append(lambda plan, *_: steps.append(plan.num_batched_tokens))
    engine.add_request(LONG, _params(2), request_id="alone")
    list(engine.run_until_done())
    assert steps[0] == len(LONG)


def test_a_bad_cap_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens_while_decoding"):
        EngineConfig(chunk_tokens_while_decoding=0)
