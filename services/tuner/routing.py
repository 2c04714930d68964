"""Router policies in the simulator, each a score over the prefill replicas (lowest wins, ties
to the lower index), as filter -> score -> pick: every live replica is a candidate here.

- `round_robin`: in turn, blind to load and cache.
- `least_loaded`: what the coordinator does today, (requests in flight, queued prompt tokens).
- `prefix_only`: the replica holding the longest prefix of the prompt, load only breaking ties.
- `kv_aware`: the replica that would finish the prompt soonest: the prompt tokens it still
  has queued plus those of this prompt it does not hold. A cached prefix pulls a request to
  a replica until that replica's queue outweighs the prefill the prefix saves.
Decode replicas are always least-loaded: (requests in flight + running, KV tokens held).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

from services.tuner.decode_sim import DecodeReplica
from services.tuner.fleet import RouterPolicy
from services.tuner.prefill_sim import PrefillReplica


class PrefillRouter:
    def __init__(self, policy: RouterPolicy):
        self.policy = policy
        self.uses_prefix = policy in ("prefix_only", "kv_aware")
        self._turn = count()

    def choose(
        self,
        replicas: Sequence[PrefillReplica],
        now: float,
        new_tokens: Sequence[int],
        matched: Sequence[int],
    ) -> int:
        """`new_tokens[r]`: prompt tokens replica r would compute; `matched[r]`: its cached
        leading blocks (zeros when the policy ignores the cache)."""
        policy = self.policy
        if policy == "round_robin":
            return next(self._turn) % len(replicas)
        best, best_key = 0, None
        for r, replica in enumerate(replicas):
            in_flight, queued = replica.load(now)
            if policy == "least_loaded":
                key = (in_flight, queued)
            elif policy == "prefix_only":
                key = (-matched[r], in_flight, queued)
            else:  # kv_aware
                key = (queued + new_tokens[r], -matched[r], in_flight)
            if best_key is None or key < best_key:
                best, best_key = r, key
        return best


def choose_decode(replicas: Sequence[DecodeReplica]) -> int:
    best, best_key = 0, None
    for r, replica in enumerate(replicas):
        key = replica.load()
        if best_key is None or key < best_key:
            best, best_key = r, key
    return best
