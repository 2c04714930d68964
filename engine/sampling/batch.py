"""Per-step sampling state for a batch of requests, packed into device tensors.

The engine builds one ``SamplingBatch`` per step from its requests' params, generators and
token histories. All decisions that need Python values (which rows are greedy, which
transforms any row uses, which rows carry their own generator) are made here on the host,
so the sampler never has to read a tensor back from a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.token_mask import TokenMask
from shared.sampling.params import SamplingParams


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The per-request generator for a seeded request (None for unseeded ones).

    The request keeps it for its whole life: the generator's advancing state is what makes
    the n-th token of a seeded request reproducible.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed % 2**64)


@dataclass(frozen=True, eq=False)
class PaddedIds:
    """Ragged token-id lists as ``ids [B, L]`` plus ``weight [B, L]`` (1 real, 0 padding).

    Padding uses id 0 with weight 0, so a ``scatter_add`` of ``weight`` counts real tokens
    without knowing the vocabulary size.
    """

    ids: torch.Tensor
    weight: torch.Tensor

    @classmethod
    def build(cls, rows: Sequence[Sequence[int]], device: torch.device) -> PaddedIds:
        width = max((len(r) for r in rows), default=0)
        ids = [list(r) + [0] * (width - len(r)) for r in rows]
        weight = [[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows]
        return cls(
            ids=torch.tensor(ids, dtype=torch.long, device=device).reshape(len(rows), width),
            weight=torch.tensor(weight, dtype=torch.float32, device=device).reshape(
                len(rows), width
            ),
        )

    def counts(self, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
        """``[B, vocab_size]`` occurrence count of each token in each row."""
        out = torch.zeros((self.ids.shape[0], vocab_size), dtype=dtype, device=self.ids.device)
        return out.scatter_add_(1, self.ids, self.weight.to(dtype))


@dataclass(frozen=True, eq=False)
class RepetitionPenalty:
    penalty: torch.Tensor  # [B] float
    seen: PaddedIds  # prompt + output tokens


@dataclass(frozen=True, eq=False)
class CountPenalties:
    frequency: torch.Tensor  # [B] float
    presence: torch.Tensor  # [B] float
    output: PaddedIds  # output tokens only


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Tensors are ``[B]`` on the batch device; an optional tensor is None when no row uses
    that transform, which lets the sampler skip it entirely."""

    params: tuple[SamplingParams, ...]
    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # float; 1.0 on greedy rows so dividing is always safe
    top_k: torch.Tensor | None  # long; 0 means off
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition: RepetitionPenalty | None
    counts: CountPenalties | None
    # Host-side row partition for the random draw.
    seeded_rows: tuple[tuple[int, torch.Generator], ...]
    unseeded_rows: torch.Tensor | None  # long indices of sampled rows without a generator
    max_logprobs: int | None  # widest top-logprobs request in the batch
    # Tokens the grammars of structured-output rows allow (None: every row is free text).
    mask: TokenMask | None = None

    @property
    def size(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return all(p.is_greedy for p in self.params)

    @property
    def any_greedy(self) -> bool:
        return any(p.is_greedy for p in self.params)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        device: str | torch.device = "cpu",
        mask: TokenMask | None = None,
    ) -> SamplingBatch:
        n = len(params)
        if not (len(generators) == len(output_token_ids) == len(prompt_token_ids) == n):
            raise ValueError(
                f"SamplingBatch.build: params ({n}), generators ({len(generators)}), "
                f"output_token_ids ({len(output_token_ids)}) and prompt_token_ids "
                f"({len(prompt_token_ids)}) must have one entry per request"
            )
        device = torch.device(device)

        def column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def optional(
            used: bool, values: Sequence[float], dtype: torch.dtype
        ) -> torch.Tensor | None:
            return column(values, dtype) if used else None

        repetition = None
        if any(p.uses_repetition_penalty for p in params):
            seen = [[*pr, *out] for pr, out in zip(prompt_token_ids, output_token_ids, strict=True)]
            repetition = RepetitionPenalty(
                penalty=column([p.repetition_penalty for p in params], torch.float32),
                seen=PaddedIds.build(seen, device),
            )
        counts = None
        if any(p.uses_count_penalties for p in params):
            counts = CountPenalties(
                frequency=column([p.frequency_penalty for p in params], torch.float32),
                presence=column([p.presence_penalty for p in params], torch.float32),
                output=PaddedIds.build(output_token_ids, device),
            )

        seeded: list[tuple[int, torch.Generator]] = []
        unseeded: list[int] = []
        for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
            if p.is_greedy:
                continue  # greedy rows draw nothing, so their generators do not advance
            if gen is None:
                unseeded.append(row)
            else:
                seeded.append((row, gen))
        asked = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            params=tuple(params),
            greedy=column([p.is_greedy for p in params], torch.bool),
            temperature=column(
                [1.0 if p.is_greedy else p.temperature for p in params], torch.float32
            ),
            top_k=optional(any(p.top_k > 0 for p in params), [p.top_k for p in params], torch.long),
            top_p=optional(
                any(p.top_p < 1.0 for p in params), [p.top_p for p in params], torch.float32
            ),
            min_p=optional(
                any(p.min_p > 0.0 for p in params), [p.min_p for p in params], torch.float32
            ),
            repetition=repetition,
            counts=counts,
            seeded_rows=tuple(seeded),
            unseeded_rows=column(unseeded, torch.long) if unseeded else None,
            max_logprobs=max(asked) if asked else None,
            mask=mask,
        )
