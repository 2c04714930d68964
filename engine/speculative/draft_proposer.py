"""The model-based DraftProposer: a distilled draft model with its own dense per-request KV cache.

Each request keeps the token ids its cache covers and per-layer K/V buffers. A proposal first
re-syncs with the sequence (keeps the longest common prefix, so a missed `rollback` costs time,
never correctness), feeds what is new in one batched chunk, then runs k-1 single-token steps for
the whole batch at once. A batch of one works in the request's own buffers; larger batches are
gathered into one padded tensor for the call and the new positions copied back afterwards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.speculative.draft_data import target_to_draft_map
from engine.speculative.draft_file import (
    DraftLoadError,
    check_compatible,
    draft_path_for,
    read_draft,
)
from engine.speculative.draft_model import BatchKV, DraftModel, gather_kv, scatter_kv
from engine.speculative.proposer import Draft, DraftRequest

log = logging.getLogger(__name__)

__all__ = ["DraftLoadError", "ModelDraftProposer", "draft_path_for", "load_draft_proposer"]


@dataclass
class _RequestCache:
    tokens: list[int]  # target ids whose K/V are in the buffers, in order
    kv: BatchKV  # batch of one: [1, kv_heads, capacity, head_dim] per layer

    def ensure(self, model: DraftModel, capacity: int) -> None:
        self.kv = self.kv.grown(model.config, capacity, len(self.tokens))


class ModelDraftProposer:
    name = "draft"

    def __init__(
        self, model: DraftModel, vocab_ids: torch.Tensor, target_vocab_size: int, seed: int = 0
    ):
        self.model = model
        self.vocab_ids = vocab_ids.long()  # draft id -> target id
        self.to_draft = target_to_draft_map(self.vocab_ids, target_vocab_size)
        self.target_vocab_size = target_vocab_size
        self._caches: dict[str, _RequestCache] = {}
        self._generator = torch.Generator().manual_seed(seed)

    @property
    def num_cached_requests(self) -> int:
        return len(self._caches)

    def cached_tokens(self, request_id: str) -> list[int]:
        cache = self._caches.get(request_id)
        return list(cache.tokens) if cache else []

    def release(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        cache = self._caches.get(request_id)
        if cache is not None and len(cache.tokens) > num_tokens:
            # Stale K/V beyond the new length stay in the buffer but are never attended:
            # the next chunk overwrites them position by position.
            del cache.tokens[num_tokens:]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        drafts = [Draft(token_ids=[]) for _ in requests]
        # Guesses past the draft's RoPE table could never be verified either (same max position).
        room = self.model.config.max_position
        limits = [min(r.max_tokens, room - len(r.token_ids)) for r in requests]
        active = [i for i, r in enumerate(requests) if limits[i] > 0 and r.token_ids]
        if not active:
            return drafts
        reqs = [requests[i] for i in active]
        caches = [self._sync(r) for r in reqs]
        starts = torch.tensor([len(c.tokens) for c in caches])
        new = [r.token_ids[len(c.tokens) :] for r, c in zip(reqs, caches, strict=True)]
        steps = max(limits[i] for i in active)
        width = max(len(n) for n in new)
        capacity = int(starts.max()) + width + steps
        for cache in caches:
            cache.ensure(self.model, capacity)
        kv = caches[0].kv if len(caches) == 1 else self._gather(caches, starts, capacity)
        ids = torch.zeros(len(reqs), width, dtype=torch.long)
        for row, chunk in enumerate(new):
            ids[row, : len(chunk)] = self.to_draft[torch.tensor(chunk)]
        hidden = self.model(ids, starts, kv)
        lens = torch.tensor([len(n) for n in new])
        last = hidden[torch.arange(len(reqs)), lens - 1]
        pos = starts + lens
        want_q = [sampling[i] for i in active]
        tokens, probs = [], []
        for step in range(steps):
            logits = self.model.logits(last)
            q = torch.softmax(logits, dim=-1)
            greedy = logits.argmax(-1)
            if any(want_q):
                drawn = torch.multinomial(q, 1, generator=self._generator)[:, 0]
                flags = torch.tensor(want_q)
                greedy = torch.where(flags, drawn, greedy)
            tokens.append(greedy)
            probs.append(q)
            if step + 1 < steps:
                # Rows already past their own limit keep stepping (the batch moves together);
                # clamping keeps their junk positions inside the RoPE table.
                last = self.model(greedy[:, None], pos.clamp(max=room - 1), kv)[:, 0]
                pos = pos + 1
        for row, (index, req) in enumerate(zip(active, reqs, strict=True)):
            m = limits[index]
            proposed = self.vocab_ids[torch.stack([t[row] for t in tokens[:m]])].tolist()
            # The last proposal was never fed through the draft (proposals past a row's own
            # limit were fed, but at clamped positions: not cached).
            caches[row].tokens = list(req.token_ids) + proposed[: m - 1]
            drafts[index] = Draft(
                token_ids=proposed, probs=self._full_q(probs, row, m, want_q[row])
            )
        if len(caches) > 1:
            self._scatter(caches, kv, starts)
        return drafts

    def _sync(self, req: DraftRequest) -> _RequestCache:
        cache = self._caches.get(req.request_id)
        if cache is None:
            cache = _RequestCache(tokens=[], kv=BatchKV.empty(self.model.config, 1, 64))
            self._caches[req.request_id] = cache
        common = 0
        limit = min(len(cache.tokens), len(req.token_ids) - 1)  # keep >= 1 token to feed
        while common < limit and cache.tokens[common] == req.token_ids[common]:
            common += 1
        del cache.tokens[common:]
        return cache

    def _gather(self, caches: list[_RequestCache], starts: torch.Tensor, capacity: int) -> BatchKV:
        return gather_kv(self.model.config, [c.kv for c in caches], starts.tolist(), capacity)

    def _scatter(self, caches: list[_RequestCache], kv: BatchKV, starts: torch.Tensor) -> None:
        spans = [(n, len(c.tokens)) for c, n in zip(caches, starts.tolist(), strict=True)]
        scatter_kv(kv, [c.kv for c in caches], spans)

    def _full_q(
        self, probs: list[torch.Tensor], row: int, m: int, wanted: bool
    ) -> torch.Tensor | None:
        if not wanted:
            return None
        # q is zero outside the draft vocabulary; verification stays exact with it.
        q = torch.zeros(m, self.target_vocab_size)
        q[:, self.vocab_ids] = torch.stack([p[row] for p in probs[:m]])
        return q


def load_draft_proposer(
    draft_path: str | Path,
    target_tokenizer_fingerprint: str,
    target_vocab_size: int,
    device: str = "cpu",
    num_threads: int | None = None,
) -> ModelDraftProposer:
    """Load a draft file for a target; DraftLoadError if it is missing, corrupt or was trained
    for another tokenizer or vocabulary (the message names both)."""
    if device != "cpu":
        # The dense draft is sized for CPU decode; on an accelerator it would run on the CPU
        # beside the target, which the engine's own device choice should decide. Refuse loudly.
        raise DraftLoadError(f"{draft_path}: the draft model runs on cpu only, not {device!r}")
    if num_threads:
        torch.set_num_threads(num_threads)
    draft = read_draft(draft_path)
    check_compatible(draft, draft_path, target_tokenizer_fingerprint, target_vocab_size)
    log.info(
        "draft model %s: %d layers, vocab %d, held-out top-1 agreement %s",
        draft_path,
        draft.config.num_layers,
        draft.config.vocab_size,
        draft.stats.get("heldout_agreement", "?"),
    )
    return ModelDraftProposer(draft.build_model(), draft.vocab_ids, target_vocab_size)
