"""Speculative sampling keeps the target's distribution: with a draft whose q differs from p,
the joint distribution of three sampled tokens matches the exact one (chi-square, tiny model)."""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.sampling.batch import SamplingBatch
from engine.sampling.sampler import probabilities
from shared.sampling.params import SamplingParams
from tests.reference import dense_logits
from tests.spec_helpers import FixedQProposer

PROMPT = [17, 203, 45, 311, 9, 128]
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
SAMPLES = 3000


def _target(model, history: list[int]) -> torch.Tensor:
    """The exact next-token distribution plain sampling draws from after `history`."""
    logits = dense_logits(model, PROMPT + history)[-1:]
    batch = SamplingBatch.build([PARAMS], [None], [history], [PROMPT])
    return probabilities(logits, batch)[0]


def _exact_joint(model) -> dict[tuple[int, ...], float]:
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(PARAMS.max_tokens):
        grown = {}
        for prefix, mass in joint.items():
            p = _target(model, list(prefix))
            for token in p.nonzero().flatten().tolist():
                grown[(*prefix, token)] = mass * float(p[token])
        joint = grown
    return joint


def _chi_square_p_value(observed: Counter, expected: dict, total: int) -> float:
    stat = sum((observed.get(c, 0) - total * p) ** 2 / (total * p) for c, p in expected.items())
    assert sum(observed.values()) == sum(observed.get(c, 0) for c in expected)  # no stray cell
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def sampling_engine(model, draft) -> Engine:
    """The engine both sampling-distribution tests draw SAMPLES replies from, k = 2."""
    return Engine(
        EngineConfig(
            num_blocks=512,
            block_size=16,
            speculative_method="draft",
            num_speculative_tokens=2,
            max_num_seqs=256,
            seed=5,
        ),
        model=model,
        draft=draft,
    )


def test_speculative_sampling_matches_the_target_joint_distribution(tiny_model):
    exact = _exact_joint(tiny_model)
    support = sorted({t for cell in exact for t in cell})
    # q: mass on the target's tokens in the wrong proportions, plus tokens p never picks (which
    # must always be rejected).
    q = torch.zeros(tiny_model.config.vocab_size)
    for i, token in enumerate(support):
        q[token] = 1.0 + 2.0 * (i % 3)
    q[[1, 2, 500]] = 1.5
    engine = sampling_engine(tiny_model, FixedQProposer(q))
    samples = Counter(tuple(out) for out in engine.generate([PROMPT] * SAMPLES, PARAMS))
    stats = engine.spec_stats()["by_method"]["draft"]
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # both paths were exercised
    assert _chi_square_p_value(samples, exact, SAMPLES) > 1e-3
    engine.blocks.check_integrity()


def test_chi_square_detects_a_wrong_distribution(tiny_model):
    """The check above has power: plain sampling at another temperature fails it."""
    exact = _exact_joint(tiny_model)
    hot = SamplingParams(temperature=3.0, top_k=3, max_tokens=3, ignore_eos=True)
    engine = Engine(EngineConfig(num_blocks=512, max_num_seqs=256, seed=5), model=tiny_model)
    samples = Counter(tuple(out) for out in engine.generate([PROMPT] * SAMPLES, hot))
    observed = Counter({c: n for c, n in samples.items() if c in exact})
    assert _chi_square_p_value(observed, exact, sum(observed.values())) < 1e-3


def test_exact_joint_is_a_distribution(tiny_model):
    exact = _exact_joint(tiny_model)
    assert abs(sum(exact.values()) - 1.0) < 1e-4
    assert len(exact) == 3**3 and all(len(c) == 3 for c in itertools.islice(exact, 3))
