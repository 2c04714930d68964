"""A replica's capacities for the planner, read from a profile (`splitserve profile`, measured
or analytic) instead of typed in as flags.

- prompt tokens per second: a full chunk of a fresh prompt per engine step, back to back;
- sequences at once: as many contexts of the typical length as the KV pool holds, capped by
  the engine's batch limit;
- generated tokens per second: that batch stepping at that context.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.replica_profile import ReplicaProfile


@dataclass(frozen=True)
class Capacities:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_seqs: int
    rests_on: str  # which profile, of which kind, for the log

    def describe(self) -> str:
        return (
            f"per replica: {self.prefill_tokens_per_s:,.0f} prompt tokens/s, "
            f"{self.decode_tokens_per_s:,.0f} generated tokens/s, {self.decode_seqs} sequences "
            f"(from the {self.rests_on})"
        )


def capacities(profile: ReplicaProfile, context_tokens: int, max_seqs: int) -> Capacities:
    if context_tokens < 1 or max_seqs < 1:
        raise ValueError("context_tokens and max_seqs must be positive")
    chunk = profile.chunk_tokens
    prefill_tps = chunk / profile.prefill_ms(chunk) * 1e3
    seqs = max(1, min(max_seqs, profile.kv_capacity_tokens // context_tokens))
    step = profile.decode.step(seqs, seqs * context_tokens)
    kind = profile.meta.get("kind", "measured")
    signature = profile.meta.get("signature") or {}
    where = signature.get("processor", "an unrecorded machine")
    return Capacities(prefill_tps, seqs / step * 1e3, seqs, f"{kind} profile of {where}")
