"""Sampler, masks, penalties and params against plain per-row Python references."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import truncation
from engine.sampling.batch import SamplingBatch, make_generator
from engine.sampling.penalties import apply_penalties
from engine.sampling.sampler import Sampler, probabilities
from engine.sampling.truncation import apply_top_k_top_p_min_p
from shared.sampling.params import SamplingParamError, SamplingParams

VOCAB = 37  # odd on purpose


def _batch(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        [make_generator(p.seed) for p in params],
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
    )


def _random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _softmax(row: list[float]) -> list[float]:
    finite = [x for x in row if x != -math.inf]
    top = max(finite)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


# Reference masks: each returns the set of kept token ids for one row.


def _ref_top_k(row: list[float], k: int) -> set[int]:
    if k <= 0 or k >= len(row):
        return set(range(len(row)))
    kth = sorted(row, reverse=True)[k - 1]
    return {i for i, x in enumerate(row) if x >= kth}


def _ref_top_p(row: list[float], p: float) -> set[int]:
    probs = _softmax(row)
    kept, mass = set(), 0.0
    for i in sorted(range(len(row)), key=lambda i: -probs[i]):
        if mass >= p or probs[i] == 0.0:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def _ref_min_p(row: list[float], min_p: float) -> set[int]:
    probs = _softmax(row)
    return {i for i, q in enumerate(probs) if q > 0.0 and q >= min_p * max(probs)}


def _restrict(row: list[float], kept: set[int]) -> list[float]:
    return [x if i in kept else -math.inf for i, x in enumerate(row)]


def _kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in masked]


def test_top_k_matches_reference():
    logits = _random_logits(6)
    ks = [0, 1, 2, 5, VOCAB, VOCAB + 10]
    masked = apply_top_k_top_p_min_p(logits, top_k=torch.tensor(ks))
    for row, k, kept in zip(logits.tolist(), ks, _kept(masked), strict=True):
        assert kept == _ref_top_k(row, k)
        assert len(kept) == min(k, VOCAB) if k > 0 else len(kept) == VOCAB


def test_top_p_matches_reference():
    logits = _random_logits(6, seed=1)
    ps = [1.0, 0.9, 0.5, 0.2, 1e-6, 0.75]
    masked = apply_top_k_top_p_min_p(logits, top_p=torch.tensor(ps))
    kept_sets = _kept(masked)
    for row, p, kept in zip(logits.tolist(), ps, kept_sets, strict=True):
        assert kept == _ref_top_p(row, p)
    assert len(kept_sets[4]) == 1  # a tiny p still keeps the most likely token


def test_min_p_matches_reference():
    logits = _random_logits(5, seed=2)
    ms = [0.0, 0.05, 0.3, 0.9, 1.0]
    masked = apply_top_k_top_p_min_p(logits, min_p=torch.tensor(ms))
    for row, m, kept in zip(logits.tolist(), ms, _kept(masked), strict=True):
        assert kept == _ref_min_p(row, m)


def test_masks_compose_in_order_top_k_top_p_min_p():
    logits = _random_logits(8, seed=3)
    ks = [0, 10, 3, 20, 1, 0, 8, 15]
    ps = [0.8, 0.6, 1.0, 0.95, 0.5, 0.3, 0.99, 0.7]
    ms = [0.1, 0.0, 0.2, 0.05, 0.0, 0.5, 0.01, 0.15]
    masked = apply_top_k_top_p_min_p(logits, torch.tensor(ks), torch.tensor(ps), torch.tensor(ms))
    for i, row in enumerate(logits.tolist()):
        row = _restrict(row, _ref_top_k(row, ks[i]))
        row = _restrict(row, _ref_top_p(row, ps[i]))
        expected = _ref_min_p(row, ms[i])
        assert _kept(masked[i : i + 1])[0] == expected
        # Kept tokens keep their logits unchanged.
        assert torch.equal(masked[i, sorted(expected)], logits[i, sorted(expected)])


def test_cpu_candidate_shortcut_and_its_fallback_match_reference(monkeypatch):
    widths: list[int] = []
    original = truncation._threshold_from_sorted

    def spy(logits, ordered, top_k, top_p):
        widths.append(ordered.shape[-1])
        return original(logits, ordered, top_k, top_p)

    monkeypatch.setattr(truncation, "_threshold_from_sorted", spy)
    vocab, ks, ps = 1000, [0, 300, 0, 40], [0.9, 0.95, 0.5, 0.99]
    peaky = _random_logits(4, vocab, seed=10) * 3  # nuclei of a few tokens
    flat = _random_logits(4, vocab, seed=11) * 0.02  # row 0's nucleus is ~900 tokens
    # The peaky batch is settled among the 300 candidates (the widest top-k); the flat one
    # needs the full sort.
    for logits, expected_widths in ((peaky, [300]), (flat, [300, vocab])):
        widths.clear()
        masked = apply_top_k_top_p_min_p(logits, torch.tensor(ks), torch.tensor(ps))
        assert widths == expected_widths
        for row, k, p, kept in zip(logits.tolist(), ks, ps, _kept(masked), strict=True):
            assert kept == _ref_top_p(_restrict(row, _ref_top_k(row, k)), p)


def _ref_penalties(
    row: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    out = list(row)
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_match_reference_through_greedy_probabilities():
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0, repetition_penalty=0.6, frequency_penalty=-1.5),
        SamplingParams(temperature=0),
    ]
    prompts = [[1, 2, 3], [4, 4], [5, 0, 9], [1]]
    outputs = [[3, 7, 7], [4, 8, 8, 8, 2], [], [1, 1]]
    logits = _random_logits(4, seed=4)
    got = apply_penalties(logits, _batch(params, outputs, prompts))
    for i, row in enumerate(logits.tolist()):
        expected = _ref_penalties(row, params[i], prompts[i], outputs[i])
        assert got[i].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert torch.equal(got[3], logits[3])  # no penalty: untouched


def test_greedy_takes_argmax_of_penalised_logits():
    logits = torch.zeros(2, 5)
    logits[:, 2] = 4.0
    logits[:, 3] = 3.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=2.0)]
    out = Sampler(seed=0).sample(logits, _batch(params, outputs=[[2], [2]]))
    assert out.token_ids.tolist() == [2, 3]
    random = _random_logits(16, seed=5)
    out = Sampler().sample(random, _batch([SamplingParams(temperature=0)] * 16))
    assert torch.equal(out.token_ids, random.argmax(dim=-1))


def _generate(
    params: SamplingParams, neighbours: list[SamplingParams], position: int, steps: int
) -> list[int]:
    """Generate `steps` tokens for one seeded request placed at `position` among others."""
    rows = [*neighbours[:position], params, *neighbours[position:]]
    gens = [make_generator(p.seed) for p in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    sampler = Sampler()
    for step in range(steps):
        batch = SamplingBatch.build(rows, gens, outputs, [[1, 2, 3]] * len(rows))
        # Each row sees its own logits: they depend on the row's history, like a real model.
        logits = torch.stack([_random_logits(1, 101, seed=31 * sum(o) + step)[0] for o in outputs])
        for out, tok in zip(outputs, sampler.sample(logits, batch).token_ids.tolist(), strict=True):
            out.append(tok)
    return outputs[position]


def test_seeded_request_gives_same_tokens_alone_and_anywhere_in_a_batch():
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2, seed=7)
    neighbours = [
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, min_p=0.1, seed=99),
        SamplingParams(top_p=0.5, frequency_penalty=1.0),
    ]
    alone = _generate(params, [], 0, steps=12)
    assert _generate(params, [], 0, steps=12) == alone
    for position in (0, 2, 4):
        assert _generate(params, neighbours, position, steps=12) == alone


def test_different_seeds_give_different_tokens():
    runs = {tuple(_generate(SamplingParams(seed=s), [], 0, steps=10)) for s in range(5)}
    assert len(runs) == 5


def test_shared_generator_is_reproducible_from_sampler_seed():
    logits = _random_logits(8, 101, seed=6)
    batch = _batch([SamplingParams()] * 8)
    first = Sampler(seed=3).sample(logits, batch).token_ids
    assert torch.equal(Sampler(seed=3).sample(logits, batch).token_ids, first)
    assert not torch.equal(Sampler(seed=4).sample(logits, batch).token_ids, first)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token with zero probability"
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


# 99.9th percentile of chi-square with 5 degrees of freedom is 20.5.
CHI2_LIMIT = 20.5


def test_unmasked_sampling_matches_softmax():
    n, logits = 30_000, torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0]])
    out = Sampler(seed=11).sample(logits.expand(n, -1), _batch([SamplingParams()] * n))
    counts = torch.bincount(out.token_ids, minlength=6).double()
    assert _chi_square(counts, logits.softmax(-1)[0].double()) < CHI2_LIMIT


def test_seeded_row_draws_from_the_processed_distribution():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 0.1]])
    params = SamplingParams(temperature=0.7, top_k=6, seed=5)
    batch = _batch([params])
    sampler = Sampler()
    tokens = [sampler.sample(logits, batch).token_ids[0] for _ in range(4000)]
    counts = torch.bincount(torch.stack(tokens), minlength=8).double()
    expected = probabilities(logits, batch)[0].double()
    assert (expected > 0).sum() == 6
    assert _chi_square(counts, expected) < CHI2_LIMIT


def test_probabilities_are_the_processed_distribution():
    logits = _random_logits(3, seed=8)
    params = [
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(temperature=0, top_k=4),
        SamplingParams(temperature=2.0, min_p=0.2),
    ]
    probs = probabilities(logits, _batch(params))
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    row0 = _restrict((logits[0] / 0.5).tolist(), _ref_top_k(logits[0].tolist(), 4))
    assert probs[0].tolist() == pytest.approx(_softmax(row0), abs=1e-6)
    assert probs[1].tolist() == [1.0 if i == logits[1].argmax() else 0.0 for i in range(VOCAB)]
    row2 = (logits[2] / 2.0).tolist()
    assert probs[2].tolist() == pytest.approx(_softmax(_restrict(row2, _ref_min_p(row2, 0.2))))


def test_sample_from_probs_respects_support_and_greedy_rows():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7], [0.1, 0.2, 0.6, 0.1]]).repeat(200, 1)
    params = [SamplingParams(), SamplingParams(temperature=0)] * 200
    tokens = Sampler(seed=0).sample_from_probs(probs, _batch(params))
    assert set(tokens[0::2].tolist()) == {1, 3}
    assert set(tokens[1::2].tolist()) == {2}


def test_logprobs_are_raw_model_logprobs():
    logits = _random_logits(3, seed=9)
    params = [
        SamplingParams(temperature=0.3, top_k=2, repetition_penalty=2.0, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(),
    ]
    out = Sampler(seed=1).sample(logits, _batch(params, outputs=[[1, 2], [], []]))
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, raw.gather(-1, out.token_ids[:, None])[:, 0])
    assert out.top_logprobs is not None
    values, ids = raw.topk(5, dim=-1)
    assert torch.equal(out.top_logprobs.token_ids, ids)
    assert torch.allclose(out.top_logprobs.logprobs, values)
    assert (out.top_logprobs.logprobs[:, :-1] >= out.top_logprobs.logprobs[:, 1:]).all()

    nobody_asked = Sampler().sample(logits, _batch([SamplingParams()] * 3))
    assert nobody_asked.top_logprobs is None
    only_chosen = Sampler().sample(logits, _batch([SamplingParams(logprobs=0)] * 3))
    assert only_chosen.top_logprobs is not None
    assert only_chosen.top_logprobs.token_ids.shape == (3, 0)


def test_batch_and_logits_must_agree():
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingBatch.build([SamplingParams()], [None, None], [[]], [[]])
    with pytest.raises(ValueError, match="batch of 2"):
        Sampler().sample(torch.zeros(3, VOCAB), _batch([SamplingParams()] * 2))


@pytest.mark.parametrize(
    ("kwargs", "param", "limit"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": True}, "max_tokens", "integer"),
        ({"temperature": -0.1}, "temperature", "[0.0, 100.0]"),
        ({"temperature": 100.5}, "temperature", "[0.0, 100.0]"),
        ({"temperature": math.nan}, "temperature", "finite"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"top_p": 0.0}, "top_p", "(0.0, 1.0]"),
        ({"top_p": 1.01}, "top_p", "(0.0, 1.0]"),
        ({"top_k": -1}, "top_k", ">= 0"),
        ({"top_k": 2.5}, "top_k", "integer"),
        ({"min_p": -0.01}, "min_p", "[0.0, 1.0]"),
        ({"min_p": 1.5}, "min_p", "[0.0, 1.0]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "(0.0, inf)"),
        ({"repetition_penalty": math.inf}, "repetition_penalty", "finite"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2.0, 2.0]"),
        ({"presence_penalty": -2.01}, "presence_penalty", "[-2.0, 2.0]"),
        ({"stop": ("a",) * 17}, "stop", "at most 16"),
        ({"stop": ("x" * 257,)}, "stop", "at most 256"),
        ({"stop": ("",)}, "stop", "empty"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids", ">= 0"),
        ({"seed": 2**64}, "seed", str(2**64 - 1)),
        ({"logprobs": 21}, "logprobs", "between 0 and 20"),
        ({"logprobs": -1}, "logprobs", "between 0 and 20"),
        ({"ignore_eos": 1}, "ignore_eos", "boolean"),
    ],
)
def test_every_validation_error_names_its_parameter_and_limit(kwargs, param, limit):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")
    assert limit in info.value.message
    assert isinstance(info.value, ValueError)


def test_context_limit_is_checked_when_known():
    params = SamplingParams(max_tokens=100)
    params.validate(max_context=2048, prompt_tokens=1948)
    with pytest.raises(SamplingParamError, match="2048") as info:
        params.validate(max_context=2048, prompt_tokens=1949)
    assert info.value.param == "max_tokens"


def test_boundary_values_are_accepted_and_stop_is_normalised():
    SamplingParams(temperature=0, top_p=1.0, min_p=1.0, logprobs=20, presence_penalty=-2.0)
    SamplingParams(temperature=100.0, frequency_penalty=2.0, stop=("x" * 256,) * 16, seed=-5)
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[2]).stop_token_ids == (2,)
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    # Negative seeds fold into the generator's unsigned range instead of failing.
    assert make_generator(-5) is not None and make_generator(None) is None
