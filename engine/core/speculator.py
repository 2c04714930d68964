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

from engine.core.config import EngineConfig
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import SeqStatus, Sequence
from engine.speculative.adaptive import (
    AcceptanceTracker,
    Candidate,
    StepCostModel,
    choose_k,
    expected_tokens,
)
from engine.speculative.head_proposer import HeadDraftProposer
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import Draft, DraftProposer, DraftRequest
from engine.speculative.stats import SpecStats
from engine.speculative.tree import main_chain, merge_chain

log = logging.getLogger(__name__)

# k + 1 query tokens must stay on the attention kernel's batched (padded) path.
MAX_VERIFY_DRAFTS = 15
# Seconds of drafting per proposed token assumed before a model draft has been timed.
PRIOR_DRAFT_COST = 0.002
# The acceptance key of head drafts that carry the n-gram guess as a branch.
MERGED = "draft+ngram"
# Head nodes a row's n-gram draft (or a row left without one) may take along as a second
# branch of its tree (_ride_along). Forced on every row of `bench spec`'s grounded set at
# batch 1 (fp32, 2-core AVX-512 EPYC, one process, interleaved): 2, 4 and 6 nodes gave 2.15x,
# 2.11x and 2.10x of plain against 1.96x for n-gram drafts alone (2.21x against 2.00x in a
# second run); on the chat set 3.07x against 3.17x. At batch 8 it lost (1.15x against
# adaptive's 1.49x): a verify row there costs a third of a plain token.
RIDE_ALONG_NODES = 2
RIDE = "ride-along"  # the acceptance key of ride-alongs (read by nothing: see _ride_along)
# Tokens the ride-along's head nodes add where the row's n-gram guess fails at its first
# token, until measured (see _ride_along): the head's trees recorded over `bench spec`'s
# replies gave 0.57 (grounded) and 0.63 (chat) where the first guess failed, 0.48 where no
# n-gram matched.
PRIOR_RIDE_GAIN = 0.5
RIDE_EWMA = 0.1
PRIOR_RIDE_COST = RIDE_ALONG_NODES * PRIOR_DRAFT_COST  # a ride-along's head call, unmeasured


@dataclass
class _Choice:
    seq: Sequence
    method: str  # "ngram" | "draft"
    k: int  # nodes in all
    # Nodes the head proposes where fewer than k: the rest are the row's n-gram guess (a
    # ride-along, Speculator._ride_along).
    head_nodes: int | None = None


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
        # Ride-alongs: the seconds a head call of their size takes, the tokens their head
        # nodes add where the n-gram's first guess fails, and this step's chains by request.
        self._ride_cost: float | None = None
        self._ride_gain = PRIOR_RIDE_GAIN
        self._ride_chains: dict[str, tuple[list[int], str]] = {}  # chain, its n-gram key
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
        self._ride_cost = None
        self._ride_gain = PRIOR_RIDE_GAIN
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
        self._ride_chains.clear()
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

    def record(self, seq: Sequence, accepted: int, tokens: list[int] | None = None) -> None:
        """`tokens`: the accepted drafts' tokens (a ride-along's gain is measured with them)."""
        draft, method = seq.draft, seq.draft_method
        ride = self._ride_chains.pop(seq.request_id, None)
        if ride is not None and tokens is not None:
            chain, key = ride
            along = 0
            while along < min(len(chain), len(tokens)) and chain[along] == tokens[along]:
                along += 1
            if chain:
                # The chain's own outcome keeps its n-gram estimate measured: the choice of
                # k reads it, and rows that ride along would otherwise leave it at its prior
                # (measured: chat b1 fell to 2.3x on chains cut short).
                self.acceptance.observe(seq.request_id, key, len(chain), along)
            if along == 0:
                # The n-gram's first guess failed: whatever was accepted came from the head.
                self._ride_gain += RIDE_EWMA * (accepted - self._ride_gain)
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
        self._ride_along(choices, candidates, decoding)
        return choices

    def _ride_along(
        self,
        choices: list[_Choice],
        candidates: list[Candidate],
        decoding: list[tuple[Sequence, int]],
    ) -> None:
        """Give a row whose n-gram draft was chosen (or that drafts nothing) the head's
        `RIDE_ALONG_NODES` likeliest guesses as one more branch of its tree, where what they
        are expected to add is worth more than their verify rows and the head's call.

        The choice above weighs a row's head draft *against* its n-gram draft, and a copying
        reply's short, doubtful n-gram matches then win, or nothing is drafted: on `bench
        spec`'s grounded set at batch 1 adaptive drafted from the head in few steps. But a
        tree verifies both in one step, and where a verify row is nearly free (batch 1: ~1 ms
        against a ~30 ms step) two head nodes cost little. Their worth: the tokens they add
        where the n-gram's first guess fails (measured on the ride-alongs themselves, from
        PRIOR_RIDE_GAIN), times the chance it fails, at what a plain token costs now. Their
        price: a verify row's (the chord of the step-cost model from a plain step to a full
        one: neighbouring counts, each its own moving average, differ by rows' worth) per
        node, and the head's call. In a crowd a row costs real arithmetic and they stay out."""
        if not isinstance(self.draft, HeadDraftProposer) or not choices:
            return
        rows = len(decoding)
        plain_token_seconds = self.cost.cost(rows) / rows
        full = rows * (self.max_k + 1)
        row_seconds = (self.cost.cost(full) - self.cost.cost(rows)) / max(1, full - rows)
        head_call = self._ride_cost if self._ride_cost is not None else PRIOR_RIDE_COST
        head_paid = any(c.method == "draft" and c.k > 0 for c in choices)
        for choice, candidate, (seq, limit) in zip(choices, candidates, decoding, strict=True):
            if choice.method != "ngram" or not self._merges(seq):
                continue
            # The head's nodes sit at depth 1-2, within the row's room for emitted tokens
            # (`limit`); the chain keeps its length (its long runs are what it is for) unless
            # the tree would outgrow the verify kernel's rows or the context's KV slots.
            nodes = min(RIDE_ALONG_NODES, limit)
            slots = min(MAX_VERIFY_DRAFTS, self.max_model_len - seq.num_tokens - 1)
            keep = min(choice.k, slots - nodes)
            if keep < 0:
                continue
            miss = 1.0 - candidate.alpha if keep > 0 else 1.0
            worth = miss * self._ride_gain * plain_token_seconds
            added = keep + nodes - choice.k
            price = added * row_seconds + (0.0 if head_paid else head_call)
            if worth <= price:
                continue
            assert seq.draft is not None
            chain = list(seq.draft.token_ids[:keep])
            seq.draft = None
            choice.method, choice.head_nodes, choice.k = "draft", nodes, keep + nodes
            self._merge[seq.request_id] = chain
            key = self._alpha_keys.get(seq.request_id, "ngram")
            self._ride_chains[seq.request_id] = (chain, key)
            # Its own key: a 2-node tree fully accepted would read to the per-position
            # estimate of the head's (or merged) drafts as near-certain acceptance, and the
            # choice above would then hand rows long head drafts (measured: chat b1 2.96x ->
            # 2.48x). Its worth is measured as _ride_gain instead.
            self._alpha_keys[seq.request_id] = RIDE
            head_paid = True

    def _propose_model_drafts(self, choices: list[_Choice]) -> None:
        if not choices or self.draft is None:
            return
        requests = [
            DraftRequest(c.seq.request_id, c.seq.token_ids, c.head_nodes or c.k) for c in choices
        ]
        sampling = [not c.seq.params.is_greedy for c in choices]
        start = time.perf_counter()
        if isinstance(self.draft, HeadDraftProposer):
            trees = [self._wide_trees and self._may_tree(c.seq) for c in choices]
            drafts = self.draft.propose(requests, sampling, trees)
        else:
            drafts = self.draft.propose(requests, sampling)
        seconds = time.perf_counter() - start
        depth = max(r.max_tokens for r in requests)
        per_token = seconds / depth
        self._draft_cost = (
            per_token if self._draft_cost is None else 0.8 * self._draft_cost + 0.2 * per_token
        )
        if depth <= RIDE_ALONG_NODES:
            # From the prior, not from the first such call alone: the head then takes in
            # every token since its last call, which steady ride-alongs do not.
            old = self._ride_cost if self._ride_cost is not None else PRIOR_RIDE_COST
            self._ride_cost = 0.8 * old + 0.2 * seconds
        for choice, draft in zip(choices, drafts, strict=True):
            if len(draft) > choice.k:  # a proposer must not exceed max_tokens; trust but trim
                draft = draft.prefix(choice.k)
            chain = self._merge.pop(choice.seq.request_id, None)
            if chain is not None and choice.k > 0:
                # A ride-along's chain was cut to its room already; its tree holds both.
                limit = choice.k if choice.head_nodes else self.max_k
                draft = merge_chain(draft, chain[:limit], limit)
            if draft.is_tree and not self._may_tree(choice.seq):
                draft = main_chain(draft)
            choice.seq.draft, choice.seq.draft_method = draft, "draft"
