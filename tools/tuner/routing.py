"""Router policies in the simulator. Prefill replicas are scored with the live router's own
code (`services.router.score`, `services.router.pick`), so `bench router` measures what the
coordinator ships; only `round_robin` (in turn, blind to load and cache) needs no score.

- `least_loaded`: the fewest requests in flight, then prompt tokens queued.
- `prefix_only`: the longest cached prefix, load only breaking ties.
- `kv_aware`: prefill work left (uncached tokens, host hits at a fraction) plus queued tokens.
Decode replicas are always least-loaded: (requests in flight + running, KV tokens held).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

from services.router.index import PrefixHit
from services.router.pick import pick
from services.router.score import cached_tokens, prefill_cost
from shared.config.router import RouterConfig
from tools.tuner.decode_sim import DecodeReplica
from tools.tuner.fleet import RouterPolicy
from tools.tuner.prefill_sim import PrefillReplica


class SimulatedRouter:
    def __init__(self, policy: RouterPolicy, cfg: RouterConfig | None = None):
        self.policy = policy
        self.cfg = cfg or RouterConfig()
        self.uses_prefix = policy in ("prefix_only", "kv_aware")
        self._turn = count()
        self._ids: list[str] = []

    def choose(
        self,
        replicas: Sequence[PrefillReplica],
        now: float,
        prompt_tokens: int,
        hits: Sequence[PrefixHit],
        block_tokens: float,
    ) -> int:
        """`hits[r]`: replica r's cached leading blocks (empty when the policy ignores them)."""
        if self.policy == "round_robin":
            return next(self._turn) % len(replicas)
        if len(self._ids) != len(replicas):  # ids that sort as the indices do
            self._ids = [f"prefill-{r:05d}" for r in range(len(replicas))]
        scores = []
        for r, replica in enumerate(replicas):
            in_flight, queued = replica.load(now)
            cached = cached_tokens(hits[r], block_tokens, prompt_tokens)
            scores.append(
                prefill_cost(
                    self._ids[r], prompt_tokens, cached, queued, self.cfg, self.policy, in_flight
                )
            )
        best = pick(scores)
        assert best is not None  # a fleet has at least one prefill replica
        return self._ids.index(best.worker_id)


def choose_decode(replicas: Sequence[DecodeReplica]) -> int:
    best, best_key = 0, None
    for r, replica in enumerate(replicas):
        key = replica.load()
        if best_key is None or key < best_key:
            best, best_key = r, key
    return best
