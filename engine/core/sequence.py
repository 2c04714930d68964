"""A request as the engine sees it: tokens, progress through prefill, and its KV blocks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.grammar.state import GrammarState
from engine.kvcache.tables import BlockTable, SwappedBlocks
from engine.speculative.proposer import Draft
from shared.sampling.logprob import TokenLogprob
from shared.sampling.params import SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to resume
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Smaller runs first (tiers map onto it: priority 0, default 1, flex 2, batch 3).
    priority: int = 1
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    table: BlockTable | None = None
    swapped: SwappedBlocks | None = None
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens reused from the prefix cache
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    # Keep the KV after finishing (prefill role: it is handed to a decode replica).
    keep_kv: bool = False
    max_new_tokens: int | None = None  # overrides params.max_tokens (prefill role: 1)
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Speculative decoding: tokens proposed for this step (verified after the last sampled
    # token in one forward pass) and the source that proposed them. Set by the speculator
    # each step, never carried over.
    draft: Draft | None = None
    draft_method: str | None = None
    # Asked for prompt logprobs: those of prompt tokens 1, 2, ... computed so far (token 0
    # has no context, so none). None: not asked.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def max_reused_tokens(self) -> int | None:
        """How much of its prefix the sequence may take from the prefix cache (None: all).

        Prompt logprobs are computed, never cached: the logprob of token p comes from the
        forward pass over token p - 1, so a sequence still missing some must compute every
        position from the first one it lacks. Costs a cache hit; keeps the values exact and
        the same whether or not another request cached the prefix.
        """
        if self.prompt_logprobs is None:
            return None
        known = len(self.prompt_logprobs)  # tokens 1..known have theirs
        return None if known >= self.num_prompt_tokens - 1 else known

    def add_prompt_logprobs(self, first_token: int, logprobs: list[TokenLogprob]) -> None:
        """Logprobs of prompt tokens `first_token`, `first_token + 1`, ...; positions already
        known (recomputed after a preemption) are kept as they were."""
        assert self.prompt_logprobs is not None
        known = len(self.prompt_logprobs)
        if first_token > known + 1:
            raise RuntimeError(
                f"{self.request_id}: prompt logprobs from token {first_token} but only "
                f"1..{known} are known (a cached prefix skipped some)"
            )
        self.prompt_logprobs.extend(logprobs[known + 1 - first_token :])

    # Structured output: where the output stands in its grammar (None: free text).
    grammar: GrammarState | None = None

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft.token_ids) if self.draft is not None else 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet computed (prompt chunks, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_limit(self) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)
