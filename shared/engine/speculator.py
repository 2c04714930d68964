"""The engine's speculation front end: which decoding sequences get drafts, how many, from where.

Called once per step before scheduling. Sets ``seq.draft`` on decoding sequences (the scheduler
reserves KV slots for them, the runner verifies them) and learns from each verified step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.config import EngineConfig
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import SeqStatus, Sequence
from shared.speculative.adaptive import (
    AcceptanceTracker,
    Candidate,
    StepCostModel,
    choose_k,
    expected_tokens,
)
from shared.speculative.head_proposer import HeadDraftProposer
from shared.speculative.ngram import NgramProposer
from shared.speculative.proposer import Draft, DraftProposer, DraftRequest
from shared.speculative.stats import SpecStats
from shared.speculative.tree import main_chain, merge_chain

log = logging.getLogger(__name__)

# k + 1 query tokens must stay on the attention kernel's batched (padded) path.
MAX_VERIFY_DRAFTS = 15
# Seconds of drafting per proposed token assumed before a model draft has been timed.
PRIOR_DRAFT_COST = 0.002
# The acceptance key of head drafts that carry the n-gram guess as a branch.
MERGED = "draft+ngram"


@dataclass
class _Choice:
    seq: Sequence
    method: str  # "ngram" | "draft"
    k: int


class Speculator:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        draft: DraftProposer | None = None,
        draft_unavailable: str | None = None,
        trees: bool = False,
    ):
        self.method = config.speculative_method
        self.max_k = min(config.num_speculative_tokens, MAX_VERIFY_DRAFTS)
        self.max_model_len = max_model_len
        # Whether verify steps may carry draft trees (the model's decode path honours them).
        self.trees = trees
        # Method `draft` drafts head trees (not chains) only while a step decodes at most this
        # many rows: it proposes k nodes a row whatever they cost, and at larger batches a
        # verify row costs the step real compute. Adaptive prices each step's k from measured
        # step costs, so its trees stay small where rows are dear: it drafts trees at any
        # batch size (engine_defaults.DRAFT_TREE_MAX_BATCH has the measurements).
        self.tree_max_batch = config.draft_tree_max_batch
        self._wide_trees = False  # this step's: head trees rather than chains
        self.ngram = NgramProposer(config.ngram_max, config.ngram_min)
        self.draft = draft
        self.stats = SpecStats(method=self.method, draft_unavailable=draft_unavailable)
        self.acceptance = AcceptanceTracker()
        self.cost = StepCostModel()
        self._draft_cost: float | None = None
        self._calibrate: Callable[[], dict[int, float]] | None = None
        # Acceptance is tracked per n-gram match length ("ngram:3"), and apart for head drafts
        # merged with an n-gram branch (MERGED): set with the drafts, read at record.
        self._alpha_keys: dict[str, str] = {}
        # Per request, this step: the n-gram guess to merge into its head draft.
        self._merge: dict[str, list[int]] = {}

    def install_draft(self, draft: DraftProposer, version: str) -> None:
        """Serve `draft` from the next step on (engine thread, between steps: no sequence
        holds a draft of the old one then). What was learnt of the old one is dropped."""
        self.draft = draft
        self.stats.draft_version = version
        self.stats.draft_swaps += 1
        self.stats.draft_unavailable = None
        self._draft_cost = None
        self.acceptance = AcceptanceTracker()

    def set_calibration(self, measure: Callable[[], dict[int, float]]) -> None:
        """Run once before the first adaptive decision: step seconds by query tokens."""
        self._calibrate = measure

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.max_k > 0

    def attach_drafts(self, running: list[Sequence]) -> None:
        """Attach drafts to the decoding sequences in ``running`` (clearing stale ones)."""
        if self._calibrate is not None and self.method == "adaptive":
            for n, seconds in self._calibrate().items():
                self.cost.observe(n, seconds)
            self._calibrate = None
        # Both are this step's: a row that ends up without a draft must not leave its key
        # (or n-gram branch) to a later step's different draft.
        self._alpha_keys.clear()
        self._merge.clear()
        decoding: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft = None
            limit = self._room(seq)
            if limit > 0:
                decoding.append((seq, limit))
        if not decoding:
            return
        self._wide_trees = self.method == "adaptive" or len(decoding) <= self.tree_max_batch
        if self.method == "draft" and self.draft is None:
            choices = self._ngram_or_adaptive(decoding, "ngram")  # the draft failed to load
        elif self.method == "draft":
            choices = [_Choice(s, "draft", lim) for s, lim in decoding] if self.draft else []
        else:
            choices = self._ngram_or_adaptive(decoding, self.method)
        self._propose_model_drafts([c for c in choices if c.method == "draft" and c.k > 0])
        chosen = {id(c.seq) for c in choices if c.seq.draft is not None and len(c.seq.draft)}
        self.stats.plain_steps += sum(1 for s, _ in decoding if id(s) not in chosen)

    def record(self, seq: Sequence, accepted: int) -> None:
        draft, method = seq.draft, seq.draft_method
        if draft is None or method is None or not len(draft):
            return
        self.stats.record(method, len(draft), accepted)
        key = self._alpha_keys.pop(seq.request_id, method)
        self.acceptance.observe(seq.request_id, key, len(draft), accepted)
        if method == "draft" and self.draft is not None and accepted < len(draft):
            # Called before the accepted tokens are appended to the sequence.
            self.draft.rollback(seq.request_id, seq.num_tokens + accepted)

    @property
    def consumes_hidden(self) -> bool:
        """The draft drafts from the target's hidden states (a draft head)."""
        return self.enabled and bool(getattr(self.draft, "consumes_hidden", False))

    def observe_hidden(
        self,
        scheduled: list[ScheduledSeq],
        first_positions: list[int],
        hidden: torch.Tensor,
        row_starts: list[int],
    ) -> None:
        """Hand the draft head the states of the tokens whose KV was kept this step (after
        postprocess: a verified row's `num_tokens` is then 1 + accepted)."""
        draft = self.draft
        assert draft is not None
        for item, position, row in zip(scheduled, first_positions, row_starts, strict=True):
            if item.seq.status is SeqStatus.FINISHED:
                continue  # released already; its state must not come back
            draft.observe_hidden(  # type: ignore[attr-defined]
                item.seq.request_id, position, hidden[row : row + item.num_tokens].clone()
            )

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def release(self, request_id: str) -> None:
        self._alpha_keys.pop(request_id, None)
        self.ngram.release(request_id)
        self.acceptance.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)

    # -- internals -----------------------------------------------------------------------

    def _may_tree(self, seq: Sequence) -> bool:
        """A tree is verified for greedy rows without a grammar, on a model that can."""
        return self.trees and seq.params.is_greedy and seq.grammar is None

    def _merges(self, seq: Sequence) -> bool:
        """The row's n-gram guess joins its head draft as a branch (adaptive, a tree-capable
        row, a draft head)."""
        return isinstance(self.draft, HeadDraftProposer) and self._may_tree(seq)

    def _room(self, seq: Sequence) -> int:
        """Drafts this sequence may take: 0 unless it is decoding and can use them."""
        if seq.num_pending_tokens != 1 or not seq.output_token_ids or seq.params.logprobs:
            return 0
        # Drafts past max_tokens or the context window could never be emitted.
        left = min(
            seq.output_limit - len(seq.output_token_ids), self.max_model_len - seq.num_tokens
        )
        return max(0, min(self.max_k, left - 1))

    def _ngram_or_adaptive(
        self, decoding: list[tuple[Sequence, int]], method: str
    ) -> list[_Choice]:
        requests = [DraftRequest(s.request_id, s.token_ids, lim) for s, lim in decoding]
        drafts = self.ngram.propose(requests, [not s.params.is_greedy for s, _ in decoding])
        if method == "ngram":
            for (seq, _), draft in zip(decoding, drafts, strict=True):
                seq.draft, seq.draft_method = draft, "ngram"
            return [_Choice(s, "ngram", len(d)) for (s, _), d in zip(decoding, drafts, strict=True)]
        choices: list[_Choice] = []
        candidates: list[Candidate] = []
        draft_cost = self._draft_cost if self._draft_cost is not None else PRIOR_DRAFT_COST
        for (seq, limit), draft in zip(decoding, drafts, strict=True):
            key = f"ngram:{self.ngram.match_length.get(seq.request_id, 0)}"
            a_ngram = self.acceptance.alpha(seq.request_id, key)
            use_model = self.draft is not None
            # A draft head's tree takes the n-gram guess in as one more branch: the row
            # keeps whichever of the two the target agrees with, in one verify step.
            merge = use_model and len(draft) > 0 and self._merges(seq)
            model_key = MERGED if merge else "draft"
            a_model = self.acceptance.alpha(seq.request_id, model_key)
            if use_model and len(draft):
                # Tokens per second of this row alone: an n-gram draft is free, a model draft
                # adds its drafting time to the step.
                step = self.cost.cost(len(decoding))
                model_rate = expected_tokens(a_model, limit) / (step + draft_cost * limit)
                use_model = model_rate > expected_tokens(a_ngram, len(draft)) / step
            if use_model:
                choices.append(_Choice(seq, "draft", limit))
                candidates.append(Candidate(a_model, limit, draft_cost))
                if merge:
                    self._merge[seq.request_id] = draft.token_ids
                    self._alpha_keys[seq.request_id] = MERGED
            else:
                seq.draft, seq.draft_method = draft, "ngram"
                self._alpha_keys[seq.request_id] = key
                choices.append(_Choice(seq, "ngram", len(draft)))
                candidates.append(Candidate(a_ngram, len(draft)))
        for choice, k in zip(choices, choose_k(candidates, self.max_k, self.cost), strict=True):
            choice.k = k
            if choice.method == "ngram":
                assert choice.seq.draft is not None
                choice.seq.draft = Draft(choice.seq.draft.token_ids[:k])
        return choices

    def _propose_model_drafts(self, choices: list[_Choice]) -> None:
        if not choices or self.draft is None:
            return
        requests = [DraftRequest(c.seq.request_id, c.seq.token_ids, c.k) for c in choices]
        sampling = [not c.seq.params.is_greedy for c in choices]
        start = time.perf_counter()
        if isinstance(self.draft, HeadDraftProposer):
            trees = [self._wide_trees and self._may_tree(c.seq) for c in choices]
            drafts = self.draft.propose(requests, sampling, trees)
        else:
            drafts = self.draft.propose(requests, sampling)
        per_token = (time.perf_counter() - start) / max(c.k for c in choices)
        self._draft_cost = (
            per_token if self._draft_cost is None else 0.8 * self._draft_cost + 0.2 * per_token
        )
        for choice, draft in zip(choices, drafts, strict=True):
            if len(draft) > choice.k:  # a proposer must not exceed max_tokens; trust but trim
                draft = draft.prefix(choice.k)
            chain = self._merge.pop(choice.seq.request_id, None)
            if chain is not None and choice.k > 0:
                draft = merge_chain(draft, chain[: self.max_k], self.max_k)
            if draft.is_tree and not self._may_tree(choice.seq):
                draft = main_chain(draft)
            choice.seq.draft, choice.seq.draft_method = draft, "draft"
