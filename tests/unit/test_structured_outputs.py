"""Structured outputs in the engine, on the real SmolLM2: greedy output parses and validates
against its schema for 20 schemas, in one mixed batch whose free rows stay exactly what they
are alone; with speculative decoding; resumed on another engine from the tokens already
generated (migration, a first token sampled by the prefill replica); cut by max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.core.config import EngineConfig
from engine.core.constraints import OutputConstraints, fit_drafts_to_grammar
from engine.core.engine import Engine, RequestError
from engine.core.sequence import Sequence
from engine.speculative.proposer import Draft
from shared.sampling.params import SamplingParams
from shared.sampling.structured import StructuredOutput
from tests.spec_helpers import OracleProposer
from tools.bench.structured_bench import load_schemas

pytestmark = pytest.mark.real_model

SCHEMAS: dict[str, dict] = load_schemas()
MAX_TOKENS = 64
FREE_TEXT = ["Name three colours.", "What is the capital of France?"]


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _schema_prompt(tokenizer, name: str) -> list[int]:
    return _chat(tokenizer, f"Reply with a JSON object for: {name.replace('_', ' ')}.")


def _structured(schema: dict, **overrides) -> SamplingParams:
    fields = dict(temperature=0.0, max_tokens=MAX_TOKENS)
    fields.update(overrides)
    return SamplingParams(**fields, structured=StructuredOutput.json_schema(schema))


def _engine(model, tokenizer, **overrides) -> Engine:
    cfg = dict(num_blocks=256, block_size=16, max_num_batched_tokens=512, max_num_seqs=32)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model, tokenizer=tokenizer)


def _run(engine: Engine, prompts, params) -> tuple[list[list[int]], list[str | None]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {}
    for out in engine.run_until_done():
        tokens[out.request_id].extend(out.new_token_ids)
        if out.finished:
            reasons[out.request_id] = out.finish_reason
    engine.blocks.check_integrity()
    return [tokens[i] for i in ids], [reasons.get(i) for i in ids]


def _assert_valid(tokenizer, name: str, schema: dict, ids: list[int], reason: str | None):
    text = tokenizer.decode(ids)
    assert reason == "stop", f"{name}: ended {reason!r} before the value was complete: {text!r}"
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def batch_run(real_model, real_tokenizer):
    """All 20 schemas and two free rows (greedy and seeded sampling) in one batch, and the
    free rows on their own, unconstrained engine."""
    names = list(SCHEMAS)
    prompts = [_schema_prompt(real_tokenizer, n) for n in names]
    params = [_structured(SCHEMAS[n]) for n in names]
    free_prompts = [_chat(real_tokenizer, t) for t in FREE_TEXT]
    free_params = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=11, max_tokens=24),
    ]
    # Free rows interleaved with constrained ones, so masks land on rows in the middle.
    order = [*prompts[:7], free_prompts[0], *prompts[7:14], free_prompts[1], *prompts[14:]]
    order_params = [*params[:7], free_params[0], *params[7:14], free_params[1], *params[14:]]
    engine = _engine(real_model, real_tokenizer)
    outputs, reasons = _run(engine, order, order_params)
    alone, _ = _run(_engine(real_model, real_tokenizer), free_prompts, free_params)
    constrained = [*range(7), *range(8, 15), *range(16, 22)]
    return {
        "names": names,
        "outputs": [outputs[i] for i in constrained],
        "reasons": [reasons[i] for i in constrained],
        "free": [outputs[7], outputs[15]],
        "free_alone": alone,
        "engine": engine,
    }


def test_twenty_schemas_parse_and_validate_in_one_mixed_batch(batch_run, real_tokenizer):
    for name, ids, reason in zip(
        batch_run["names"], batch_run["outputs"], batch_run["reasons"], strict=True
    ):
        _assert_valid(real_tokenizer, name, SCHEMAS[name], ids, reason)
    stats = batch_run["engine"].structured_stats()
    assert stats["misses"] == 20 and stats["mask_steps"] > 0


def test_free_rows_in_a_mixed_batch_equal_their_unconstrained_run(batch_run):
    assert batch_run["free"] == batch_run["free_alone"]


def test_a_constrained_request_alone_equals_its_batched_output(
    batch_run, real_model, real_tokenizer
):
    index = 3  # a nested object
    name = batch_run["names"][index]
    alone, _ = _run(
        _engine(real_model, real_tokenizer),
        [_schema_prompt(real_tokenizer, name)],
        [_structured(SCHEMAS[name])],
    )
    assert alone[0] == batch_run["outputs"][index], name


def test_json_object_mode_returns_an_object(real_model, real_tokenizer):
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured=StructuredOutput("json_object")
    )
    (ids,), (reason,) = _run(
        _engine(real_model, real_tokenizer),
        [_chat(real_tokenizer, "Give me a JSON object with a greeting.")],
        [params],
    )
    assert reason == "stop"
    assert isinstance(json.loads(real_tokenizer.decode(ids)), dict)


def test_speculative_decoding_keeps_constrained_greedy_output(
    batch_run, real_model, real_tokenizer
):
    """Drafts with planted mistakes (some outside the grammar, cut before verification; some
    inside it but wrong, rejected by verification) change nothing; accepted drafts happen."""
    names = batch_run["names"][:6]
    prompts = [_schema_prompt(real_tokenizer, n) for n in names]
    expected = batch_run["outputs"][:6]
    # The oracle proposes the plain continuation after the first token, corrupting some.
    oracle = OracleProposer(
        {tuple(p + e[:1]): e[1:] for p, e in zip(prompts, expected, strict=True)}, wrong_every=2
    )
    engine = Engine(
        EngineConfig(
            num_blocks=512,
            block_size=16,
            max_num_batched_tokens=512,
            speculative_method="draft",
            num_speculative_tokens=4,
        ),
        model=real_model,
        tokenizer=real_tokenizer,
        draft=oracle,
    )
    outputs, reasons = _run(engine, prompts, [_structured(SCHEMAS[n]) for n in names])
    assert outputs == expected
    assert reasons == ["stop"] * len(names)
    stats = engine.spec_stats()
    assert stats["accepted_tokens"] > 0, stats


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_sampled_constrained_output_validates_with_and_without_speculation(
    real_model, real_tokenizer, method
):
    """Temperature and top-p draw only among the tokens the mask leaves; with n-gram drafts
    the acceptance test runs on the masked distribution."""
    names = ["sentiment", "intent", "safety", "refs"]
    params = [_structured(SCHEMAS[n], temperature=0.8, top_p=0.95, seed=3) for n in names]
    engine = _engine(real_model, real_tokenizer, speculative_method=method)
    outputs, reasons = _run(engine, [_schema_prompt(real_tokenizer, n) for n in names], params)
    for name, ids, reason in zip(names, outputs, reasons, strict=True):
        _assert_valid(real_tokenizer, name, SCHEMAS[name], ids, reason)


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(real_tokenizer):
    constraints = OutputConstraints(real_tokenizer)
    params = _structured(SCHEMAS["person"])
    good = real_tokenizer.encode('{"name":"Al","age":3}')
    seq = Sequence("r", [1, 2], params, grammar=constraints.start("r", params, [1, 2]))
    # Nothing may follow the closing brace: the draft is cut right after it.
    seq.draft = Draft(good + real_tokenizer.encode(" more"))
    fit_drafts_to_grammar([seq])
    assert seq.draft is not None and seq.draft.token_ids == good
    seq.draft = Draft(real_tokenizer.encode("no json"))
    fit_drafts_to_grammar([seq])
    assert seq.draft is None


def test_a_continuation_rebuilds_the_grammar_from_the_tokens_already_generated(
    batch_run, real_model, real_tokenizer
):
    """Migration resends prompt + streamed tokens with `params.continued(n)`; the new engine
    replays them through the grammar and goes on exactly where the old one was."""
    name = batch_run["names"][4]
    prompt = _schema_prompt(real_tokenizer, name)
    full = batch_run["outputs"][4]
    params = _structured(SCHEMAS[name])
    for cut in (1, len(full) // 2):
        rest, reasons = _run(
            _engine(real_model, real_tokenizer), [prompt + full[:cut]], [params.continued(cut)]
        )
        assert full[:cut] + rest[0] == full
        assert reasons == ["stop"]


def test_the_prefill_replica_masks_the_first_token_and_decode_resumes_after_it(
    batch_run, real_model, real_tokenizer
):
    name = batch_run["names"][2]
    prompt = _schema_prompt(real_tokenizer, name)
    full = batch_run["outputs"][2]
    params = _structured(SCHEMAS[name])
    prefill = _engine(real_model, real_tokenizer)
    rid = prefill.add_request(prompt, params, keep_kv=True, max_new_tokens=1)
    first = [t for out in prefill.run_until_done() for t in out.new_token_ids]
    assert first == full[:1]
    # The decode replica's state after the prefilled first token: the rest of the output.
    decode = _engine(real_model, real_tokenizer)
    state = decode.constraints.start("d", params, prompt, first)
    assert state is not None
    assert state.valid_prefix(full[1:]) == len(full) - 1 and not state.is_finished
    prefill.release(rid)


def test_replayed_tokens_outside_the_schema_are_refused(real_model, real_tokenizer):
    params = _structured(SCHEMAS["person"]).continued(2)
    prompt = _chat(real_tokenizer, "hi") + real_tokenizer.encode("no")[:1] * 2
    with pytest.raises(RequestError) as err:
        _engine(real_model, real_tokenizer).add_request(prompt, params)
    assert err.value.param == "response_format"


def test_a_schema_that_cannot_finish_within_max_tokens_ends_with_length(real_model, real_tokenizer):
    (ids,), (reason,) = _run(
        _engine(real_model, real_tokenizer),
        [_schema_prompt(real_tokenizer, "address")],
        [_structured(SCHEMAS["address"], max_tokens=4)],
    )
    assert reason == "length" and len(ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(real_tokenizer.decode(ids))


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "if": {"type": "object"}, "then": {}}, '"if"'),
        ({"type": "strin"}, "strin"),
        ({"type": "string", "format": "colour"}, "colour"),
    ],
)
def test_schemas_the_engine_cannot_compile_are_refused_naming_the_keyword(
    real_model, real_tokenizer, schema, named
):
    engine = _engine(real_model, real_tokenizer)
    with pytest.raises(RequestError) as err:
        engine.add_request([1, 2, 3], _structured(schema))
    assert err.value.param == "response_format"
    assert named in str(err.value)
    assert not engine.has_work


def test_an_engine_without_a_tokenizer_refuses_structured_requests(real_model):
    engine = _engine(real_model, None)
    with pytest.raises(RequestError, match="tokenizer"):
        engine.add_request([1, 2, 3], _structured(SCHEMAS["person"]))
