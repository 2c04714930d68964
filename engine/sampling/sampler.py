"""Choosing the next token for a batch of requests with different sampling params.

Order of operations on the ``[B, V]`` logits: penalties → temperature → top-k → top-p →
min-p → draw. Greedy rows (temperature 0) take the argmax of the penalised logits.

The draw is an exponential race: ``argmax(p / E)`` with ``E ~ Exponential(1)`` i.i.d. per
token picks token i with probability ``p_i``. Unlike ``torch.multinomial`` it lets every row
take its noise from its own generator, so a seeded request gets the same tokens whether it
is sampled alone or at any position in any batch. Unseeded rows share the sampler's
generator. Nothing here waits on a GPU: the only values read back are read on the CPU
(see ``truncation``), where reading is free.

A structured-output row's grammar mask (``batch.mask``) comes first: tokens it forbids are
at -inf before anything else, so penalties, truncation and the draw only see allowed ones.

Reported logprobs are the raw ``log_softmax`` of the model's logits, before the mask,
penalties, temperature and truncation: they describe the model, not the sampling settings (vLLM's
default too), and stay finite for tokens a mask removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.sampling.batch import SamplingBatch
from engine.sampling.penalties import apply_penalties
from engine.sampling.truncation import apply_top_k_top_p_min_p

__all__ = [
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "TopLogprobs",
    "apply_top_k_top_p_min_p",
    "probabilities",
]


class TopLogprobs(NamedTuple):
    """The ``n`` most likely tokens per row, most likely first, where ``n`` is the largest
    ``logprobs`` any request in the batch asked for; each request reads its own prefix."""

    token_ids: torch.Tensor  # [B, n] long
    logprobs: torch.Tensor  # [B, n] float32


@dataclass(frozen=True, eq=False)
class SampleOutput:
    token_ids: torch.Tensor  # [B] long
    # [B] float32, raw model logprob of the chosen token; None when no request asked for
    # logprobs (a logsumexp over the vocabulary is ~5% of a batch-1 decode step).
    logprobs: torch.Tensor | None
    top_logprobs: TopLogprobs | None  # None when no request asked for logprobs


class Sampler:
    def __init__(self, seed: int | None = None):
        # One shared generator per device for unseeded rows; seed it for reproducible tests.
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Pick one token per row of ``[B, V]`` logits."""
        _check_shape(logits, batch)
        logits = logits.to(torch.float32)
        allowed = batch.mask.apply(logits) if batch.mask is not None else logits
        penalised = apply_penalties(allowed, batch)
        if batch.all_greedy:
            token_ids = penalised.argmax(dim=-1)
        else:
            token_ids = self._race(_sampling_probs(penalised, batch), batch)
            if batch.any_greedy:
                token_ids = torch.where(batch.greedy, penalised.argmax(dim=-1), token_ids)
        if batch.max_logprobs is None:
            return SampleOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
        # logit - logsumexp instead of a full log_softmax: only a few entries are reported.
        log_total = logits.logsumexp(dim=-1, keepdim=True)
        chosen = (logits.gather(-1, token_ids.unsqueeze(-1)) - log_total).squeeze(-1)
        n = min(batch.max_logprobs, logits.shape[-1])
        values, ids = logits.topk(n, dim=-1)
        top = TopLogprobs(token_ids=ids, logprobs=values - log_total)
        return SampleOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=top)

    def sample_from_probs(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Draw ``[B]`` tokens from already-final ``[B, V]`` distributions (e.g. a speculative
        decoder's residual ``norm(max(p - q, 0))``) with the batch's generators; greedy rows
        take the argmax."""
        _check_shape(probs, batch)
        if batch.all_greedy:
            return probs.argmax(dim=-1)
        token_ids = self._race(probs, batch)
        if batch.any_greedy:
            token_ids = torch.where(batch.greedy, probs.argmax(dim=-1), token_ids)
        return token_ids

    def _race(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # Greedy rows get no noise (their generators must not advance); whatever their rows
        # hold, the caller replaces their result.
        noise = torch.empty_like(probs)
        unseeded = batch.unseeded_rows
        if unseeded is not None:
            shared = self._shared_generator(probs.device)
            if unseeded.shape[0] == batch.size:
                noise.exponential_(generator=shared)
            else:
                draws = torch.empty(
                    (unseeded.shape[0], probs.shape[-1]), dtype=probs.dtype, device=probs.device
                )
                noise.index_copy_(0, unseeded, draws.exponential_(generator=shared))
        # One draw of V values per seeded row (a loop over requests, not over the vocab):
        # the row's generator advances identically whatever else is in the batch.
        for row, generator in batch.seeded_rows:
            noise[row].exponential_(generator=generator)
        # exponential_ may return exactly 0, and 0 / 0 = NaN would win the argmax for a
        # masked token.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from (speculative acceptance tests use it too)."""
        return self._shared_generator(device)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._shared_generators[device] = generator
        return generator


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The ``[B, V]`` distribution ``Sampler.sample`` draws from: penalised, tempered and
    truncated, then softmaxed; one-hot at the argmax for greedy rows. Speculative decoding
    needs exactly this ``p`` for its acceptance test."""
    _check_shape(logits, batch)
    logits = logits.to(torch.float32)
    if batch.mask is not None:
        logits = batch.mask.apply(logits)
    penalised = apply_penalties(logits, batch)
    one_hot = None
    if batch.any_greedy:
        one_hot = torch.zeros_like(penalised).scatter_(
            -1, penalised.argmax(dim=-1, keepdim=True), 1.0
        )
        if batch.all_greedy:
            return one_hot
    probs = _sampling_probs(penalised, batch)
    if one_hot is not None:
        probs = torch.where(batch.greedy.unsqueeze(-1), one_hot, probs)
    return probs


def _sampling_probs(penalised: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    scaled = penalised
    if any(p.temperature not in (0.0, 1.0) for p in batch.params):
        scaled = penalised / batch.temperature.to(penalised.dtype).unsqueeze(-1)
    masked = apply_top_k_top_p_min_p(scaled, batch.top_k, batch.top_p, batch.min_p)
    return masked.softmax(dim=-1)


def _check_shape(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2 or logits.shape[0] != batch.size:
        raise ValueError(
            f"expected logits of shape [{batch.size}, vocab] for a batch of {batch.size} "
            f"requests, got {tuple(logits.shape)}"
        )
