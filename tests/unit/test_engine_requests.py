"""Bad requests get a clear error naming the parameter; aborts and hand-offs never leak blocks."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine, RequestError
from shared.sampling.params import SamplingParamError, SamplingParams


@pytest.fixture
def engine(tiny_model):
    return Engine(EngineConfig(num_blocks=32, max_model_len=256), model=tiny_model)


def test_prompt_over_context_window(engine):
    with pytest.raises(RequestError, match="context window is 256") as err:
        engine.add_request(list(range(3, 300)), SamplingParams(max_tokens=4))
    assert err.value.param == "prompt"


def test_empty_prompt_and_out_of_vocab_token(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary") as err:
        engine.add_request([1, 2, 99999], SamplingParams())
    assert err.value.param == "prompt"


def test_request_larger_than_the_whole_pool(tiny_model):
    small = Engine(EngineConfig(num_blocks=4), model=tiny_model)
    with pytest.raises(RequestError, match="KV blocks") as err:
        small.add_request(list(range(3, 40)), SamplingParams(max_tokens=100))
    assert err.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": tuple(f"s{i}" for i in range(17))}, "stop"),
    ],
)
def test_sampling_parameters_out_of_range_are_named(kwargs, param):
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_abort_mid_generation_frees_blocks(engine):
    """The abort itself, not the request finishing: `rid` could run for hundreds more steps
    (ignore_eos, a budget up to the context window), so only the abort can stop it now."""
    rid = engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=190, ignore_eos=True))
    other = engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    held = engine.blocks.num_blocks - engine.blocks.num_available_blocks
    assert held >= 4 + 3  # both are live: rid's 57 + outputs, other's 35 + outputs
    engine.abort(rid)
    # Gone at once: out of the engine and the scheduler, its blocks back before any step.
    assert engine.num_aborted == 1
    assert rid not in engine.sequences
    assert all(s.request_id != rid for s in engine.scheduler.running + engine.scheduler.waiting)
    other_blocks = len(engine.sequences[other].table.block_ids)
    assert engine.blocks.num_blocks - engine.blocks.num_available_blocks == other_blocks
    outs = list(engine.run_until_done())
    assert not any(o.request_id == rid for o in outs)  # no step computed it again
    assert any(o.request_id == other and o.finished for o in outs)
    engine.abort(rid)  # a second abort of the same id is a no-op, not a second count
    assert engine.num_aborted == 1
    engine.blocks.check_integrity()
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks


def test_prefill_role_keeps_kv_until_released(engine):
    rid = engine.add_request(
        list(range(3, 50)), SamplingParams(temperature=0.0), keep_kv=True, max_new_tokens=1
    )
    outs = list(engine.run_until_done())
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
    seq = engine.sequences[rid]
    assert seq.table is not None and len(seq.table.block_ids) == 3
    engine.release(rid)
    engine.blocks.check_integrity()
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    a = engine.generate([list(range(3, 30))], params)
    b = engine.generate([list(range(3, 30))], params)
    assert a == b


def test_prompt_logprobs_match_a_full_forward(engine, tiny_model):
    from tests.reference import dense_logits

    prompt = list(range(7, 40))
    engine.add_request(prompt, SamplingParams(max_tokens=1), prompt_logprobs=True)
    outs = list(engine.run_until_done())
    got = outs[0].prompt_logprobs
    logits = dense_logits(tiny_model, prompt).log_softmax(-1)
    expected = [logits[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert [lp.token_id for lp in got] == prompt[1:]  # token 0 has no context, so none
    assert [lp.logprob for lp in got] == pytest.approx(expected, abs=1e-4)
