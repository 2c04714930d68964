"""Score: what sending a request to a replica would cost, in prompt tokens of prefill work.

A prefill candidate's cost is the prefill it would still have to do (the prompt minus the
prefix it holds, host- and disk-tier hits counted as a fraction of recompute, since they must
be copied back first) plus the prompt tokens already queued ahead of it. Both terms are the
same unit, so a cached prefix pulls a request to its replica only until that replica's queue
outweighs the prefill the prefix saves: a hot conversation or a popular system prompt
spreads out as its replica fills up.

The simulator calls these same functions with its replicas' loads (`bench router`).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.index import PrefixHit
from services.router.replica import ReplicaState
from shared.config.router import RouterConfig, RouterPolicyName


@dataclass(frozen=True)
class CachedTokens:
    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


def cached_tokens(hit: PrefixHit, block_tokens: float, prompt_tokens: int) -> CachedTokens:
    """Tokens of the prompt a hit covers, by tier. The engine always computes the prompt's last
    token (it needs its logits), so at most `prompt_tokens - 1` are reused."""
    limit = max(0, prompt_tokens - 1)
    device = min(int(hit.device * block_tokens), limit)
    host = min(int((hit.device + hit.host) * block_tokens), limit) - device
    disk = min(int(hit.blocks * block_tokens), limit) - device - host
    return CachedTokens(device, host, disk)


@dataclass(frozen=True)
class PrefillScore:
    worker_id: str
    prompt_tokens: int
    cached: CachedTokens
    queued_tokens: int
    work: float  # prefill still to do, in recompute-equivalent tokens
    cost: float  # what `pick` minimizes
    tiebreak: tuple[float, ...]  # then this, then the replica id

    def describe(self) -> str:
        kv_tiers = ", ".join(
            f"{name} {n}"
            for name, n in (
                ("device", self.cached.device),
                ("host", self.cached.host),
                ("disk", self.cached.disk),
            )
            if n
        )
        cached = f"cached {self.cached.total}/{self.prompt_tokens} tokens"
        if kv_tiers:
            cached += f" ({kv_tiers})"
        return (
            f"{self.worker_id}: {cached}, work {self.work:.0f}, "
            f"queued {self.queued_tokens} → cost {self.cost:.0f}"
        )


def prefill_cost(
    worker_id: str,
    prompt_tokens: int,
    cached: CachedTokens,
    queued_tokens: int,
    cfg: RouterConfig,
    policy: RouterPolicyName | None = None,
    in_flight: int = 0,
) -> PrefillScore:
    """`in_flight`: requests routed there whose first token is not out yet. A replica that
    started its last queued chunk reports nothing queued while still busy; this tells it
    apart from an idle one."""
    policy = policy or cfg.policy
    work = (
        prompt_tokens
        - cached.total
        + cfg.host_hit_cost * cached.host
        + cfg.disk_hit_cost * cached.disk
    )
    if policy == "kv_aware":
        cost = work + cfg.queue_weight * queued_tokens
        tiebreak: tuple[float, ...] = (queued_tokens, in_flight)
    elif policy == "prefix_only":  # the longest prefix wins; load only breaks ties
        cost, tiebreak = -float(cached.total), (in_flight, queued_tokens)
    else:  # least_loaded, as the coordinator did before: requests in flight, then tokens
        cost, tiebreak = float(in_flight), (queued_tokens,)
    return PrefillScore(worker_id, prompt_tokens, cached, queued_tokens, work, cost, tiebreak)


def queued_estimate(r: ReplicaState, cfg: RouterConfig) -> int:
    """Queued prompt tokens as of the last heartbeat, plus a guess for what this coordinator
    routed there since (the heartbeat lags by up to an interval)."""
    return r.load.queued_prefill_tokens + cfg.in_flight_tokens * r.in_flight


def score_prefill(
    r: ReplicaState,
    prompt_tokens: int,
    hit: PrefixHit,
    block_tokens: float,
    cfg: RouterConfig,
    policy: RouterPolicyName | None = None,
) -> PrefillScore:
    cached = cached_tokens(hit, block_tokens, prompt_tokens)
    queued = queued_estimate(r, cfg)
    return prefill_cost(r.worker_id, prompt_tokens, cached, queued, cfg, policy, r.in_flight)


@dataclass(frozen=True)
class DecodeScore:
    worker_id: str
    active_kv_tokens: int
    sequences: int
    cost: float
    tiebreak: tuple[float, ...] = ()

    def describe(self) -> str:
        return (
            f"{self.worker_id}: {self.sequences} sequences, {self.active_kv_tokens} KV tokens "
            f"→ cost {self.cost:.0f}"
        )


def score_decode(r: ReplicaState, cfg: RouterConfig) -> DecodeScore:
    """A decode replica's load: the KV its running sequences hold (every step reads it all),
    plus a per-sequence share for those routed but not yet in a heartbeat."""
    sequences = r.load.running + r.in_flight
    cost = r.load.active_kv_tokens + cfg.decode_seq_tokens * sequences
    return DecodeScore(r.worker_id, r.load.active_kv_tokens, sequences, float(cost))
