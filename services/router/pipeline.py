"""The routing pipeline: filter -> score -> pick for each role, with the conditional
disaggregation decision in front. Returns replica ids and the reasons, nothing else: the
coordinator maps ids back to its registry entries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.router.disagg import local_prefill
from services.router.filter import filter_replicas
from services.router.index import KVIndex
from services.router.pick import pick
from services.router.replica import ReplicaState
from services.router.score import score_decode, score_prefill
from shared.config.router import RouterConfig
from shared.kvblocks.hashing import hash_prompt_blocks


@dataclass(frozen=True)
class RouteRequest:
    model: str
    prompt_token_ids: Sequence[int] | None = None
    previous_decode: str | None = None  # replica that served this conversation's last turn


@dataclass(frozen=True)
class Route:
    prefill: str | None  # None: `decode` prefills the prompt itself
    decode: str
    reasoning: list[str] = field(default_factory=list)


class RouterPipeline:
    def __init__(self, cfg: RouterConfig, block_size: int):
        self.cfg = cfg
        self.block_size = block_size
        self._turn = 0  # round_robin only: the one policy with state of its own

    def block_hashes(self, request: RouteRequest, salt: bytes) -> list[int]:
        if not request.prompt_token_ids:
            return []
        return hash_prompt_blocks(request.prompt_token_ids, self.block_size, salt)

    def route(
        self,
        replicas: Sequence[ReplicaState],
        index: KVIndex,
        request: RouteRequest,
        salt: bytes,
    ) -> Route | None:
        cfg = self.cfg
        prompt = len(request.prompt_token_ids or ())
        hashes = self.block_hashes(request, salt)
        need = -(-max(prompt, 1) // self.block_size)
        prefills = filter_replicas(replicas, request.model, ("prefill",), cfg)
        decodes = filter_replicas(replicas, request.model, ("decode",), cfg, need)
        if prefills.kept and decodes.kept:
            notes = [*prefills.notes, *decodes.notes]
            local = local_prefill(
                decodes.kept,
                index,
                hashes,
                prompt,
                self.block_size,
                request.previous_decode,
                cfg,
            )
            if local.replica is not None:
                return Route(None, local.replica.worker_id, [*notes, local.reason])
            prefill, why = self._choose_prefill(prefills.kept, index, hashes, prompt)
            decode = pick([score_decode(d, cfg) for d in decodes.kept])
            assert decode is not None  # decodes.kept is not empty
            return Route(
                prefill,
                decode.worker_id,
                [
                    *notes,
                    local.reason,
                    *why,
                    f"decode {decode.worker_id} (least loaded): {decode.describe()}",
                ],
            )
        both = filter_replicas(replicas, request.model, ("both",), cfg, need)
        if both.kept:
            chosen, why = self._choose_prefill(both.kept, index, hashes, prompt)
            return Route(None, chosen, [*both.notes, "colocated replicas", *why])
        return None

    def _choose_prefill(
        self,
        candidates: list[ReplicaState],
        index: KVIndex,
        hashes: list[int],
        prompt: int,
    ) -> tuple[str, list[str]]:
        cfg = self.cfg
        if cfg.policy == "round_robin":
            chosen = candidates[self._turn % len(candidates)]
            self._turn += 1
            return chosen.worker_id, [f"prefill {chosen.worker_id} (round_robin)"]
        scores = [
            score_prefill(r, prompt, index.prefix(r.worker_id, hashes), self.block_size, cfg)
            for r in candidates
        ]
        best = pick(scores)
        assert best is not None  # candidates is not empty
        lines = [f"prefill {best.worker_id} ({cfg.policy}, lowest cost)"]
        lines += [s.describe() for s in scores]
        return best.worker_id, lines
