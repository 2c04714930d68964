"""Conditional disaggregation: skip the prefill replica when a decode replica already holds
the conversation and only a short tail of the prompt is new.

The decode replica that served the previous turn usually still holds its KV (prompt and
reply), so the next turn's prompt is mostly cached there. Prefilling a short tail in place
costs that replica a little time; sending it through a prefill replica would recompute or
transfer the whole prompt's KV. Past `local_prefill_max_tokens` the tail would stall the
replica's running decodes for too long, and the request is disaggregated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.index import KVIndex
from services.router.replica import ReplicaState
from services.router.score import cached_tokens
from shared.config.router import RouterConfig


@dataclass(frozen=True)
class LocalPrefill:
    replica: ReplicaState | None  # None: go through a prefill replica
    reason: str


def local_prefill(
    decodes: Sequence[ReplicaState],
    index: KVIndex,
    block_hashes: Sequence[int],
    prompt_tokens: int,
    block_size: int,
    previous_decode: str | None,
    cfg: RouterConfig,
) -> LocalPrefill:
    if cfg.local_prefill_max_tokens <= 0:
        return LocalPrefill(None, "conditional disaggregation off (local_prefill_max_tokens=0)")
    if not decodes or not block_hashes:
        return LocalPrefill(None, "no decode replica holds any of the prompt")
    by_id = {d.worker_id: d for d in decodes}
    if previous_decode is not None and previous_decode in by_id:
        target, why = by_id[previous_decode], "served the previous turn"
    else:
        # Absent a usable previous turn: the decode replica holding the longest prefix.
        target = min(
            decodes, key=lambda d: (-index.prefix(d.worker_id, block_hashes).blocks, d.worker_id)
        )
        why = "holds the longest prefix"
        if previous_decode is not None:
            why += f" (previous {previous_decode} is gone or full)"
    hit = index.prefix(target.worker_id, block_hashes)
    cached = cached_tokens(hit, block_size, prompt_tokens).total
    if cached == 0:
        return LocalPrefill(None, f"{target.worker_id} ({why}) holds none of the prompt")
    held = f"{target.worker_id} ({why}) holds {cached}/{prompt_tokens} tokens"
    refusal = disaggregate_because(cached, prompt_tokens, cfg)
    if refusal is not None:
        return LocalPrefill(None, f"{held}{refusal}: disaggregated")
    tail = prompt_tokens - cached
    return LocalPrefill(
        target,
        f"local prefill: {held}; tail {tail} ≤ {cfg.local_prefill_max_tokens}, no transfer",
    )


def disaggregate_because(cached: int, prompt_tokens: int, cfg: RouterConfig) -> str | None:
    """Why a decode replica holding `cached` of the prompt should not prefill the rest
    itself, or None when it should. The rule the simulator applies too."""
    if cfg.local_prefill_max_tokens <= 0 or cached <= 0:
        return " (conditional disaggregation off, or nothing held)"
    if cached < cfg.local_prefill_min_cached * prompt_tokens:
        return f", under {cfg.local_prefill_min_cached:.0%} of the prompt"
    tail = prompt_tokens - cached
    if tail > cfg.local_prefill_max_tokens:
        return f"; tail {tail} > {cfg.local_prefill_max_tokens}"
    return None
