"""The draft head as a DraftProposer: fed the target's hidden states after every step.

Per request the head keeps the target's final-normed states of the positions it has seen and
its own one-layer KV cache, both indexed by *slot* = position - origin. `origin` is the first
position whose state the head saw: a prompt prefix served from the prefix cache, or KV pushed
by a prefill replica, was never computed here, so its states do not exist; the head then
attends over what it has (it is trained on windows that start mid-sequence for this reason).
RoPE depends only on position differences, so slot-based positions change nothing.

Slot i holds the pair (h_t, x_{t+1}) for t = origin + i and predicts h_{t+1}. Only states of
tokens whose KV the target kept are observed (rejected drafts' rows are dropped by the
engine), so the head's state needs no rollback: chained guesses occupy slots past the last
true one and are overwritten by the next true pairs, never attended before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.speculative.draft_model import BatchKV, gather_kv, scatter_kv
from engine.speculative.head_model import DraftHead
from engine.speculative.proposer import Draft, DraftRequest


@dataclass
class _HeadState:
    origin: int  # sequence position of slot 0
    features: torch.Tensor  # [capacity, H]; slots [0, known) hold target states
    known: int
    fed: int  # slots whose true pair is in `kv`
    kv: BatchKV

    @property
    def end(self) -> int:
        """The first position without a target state."""
        return self.origin + self.known


class HeadDraftProposer:
    name = "draft"
    consumes_hidden = True  # the engine hands it the target's states (see observe_hidden)

    def __init__(
        self,
        head: DraftHead,
        vocab_ids: torch.Tensor,
        target_vocab_size: int,
        seed: int = 0,
        version: str = "untracked",
        min_chain_confidence: float = 0.0,
        tree_width: int = 1,
        tree_min_confidence: float = 0.0,
    ):
        self.head = head.eval().requires_grad_(False)
        self.head.serve()
        # A greedy row's chain ends before the guess at which the product of the head's own
        # top probabilities (its estimate that the chain so far is accepted, as in EAGLE-2)
        # falls below this: a guess the head doubts costs a verify row and a head step and
        # is seldom kept. 0 drafts the full chain. Sampled rows always draft the full chain
        # (their q must stay the head's distribution for every proposed position).
        self.min_chain_confidence = min_chain_confidence
        # Greedy rows draft a tree when > 1: at each depth the `tree_width` likeliest new
        # nodes are extended, each with its `tree_width` likeliest next tokens, and the
        # likeliest nodes overall (at most the row's k) are proposed (EAGLE-2's dynamic tree).
        # Whether rows may verify trees at all is the engine's call (Speculator.trees).
        self.tree_width = tree_width
        # In a tree the same estimate (the product along a node's path) admits or drops each
        # node. Lower than a chain's cutoff: a tree keeps only its k likeliest nodes anyway,
        # and a doubted sibling is a second chance where a chain's guess is the only one.
        self.tree_min_confidence = tree_min_confidence
        self.version = version  # the head file's content hash (stats, /metrics)
        self.vocab_ids = vocab_ids.long()  # head id -> target id
        self.target_vocab_size = target_vocab_size
        self._states: dict[str, _HeadState] = {}
        self._generator = torch.Generator().manual_seed(seed)

    @property
    def num_cached_requests(self) -> int:
        return len(self._states)

    def observed_span(self, request_id: str) -> tuple[int, int] | None:
        """(origin, end) of the positions whose target states the head holds."""
        state = self._states.get(request_id)
        return (state.origin, state.end) if state else None

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Nothing to undo: only kept tokens' states were ever observed."""

    def observe_hidden(self, request_id: str, start: int, states: torch.Tensor) -> None:
        """The target's final-normed states [n, H] of positions start .. start + n - 1."""
        n = states.shape[0]
        if n == 0:
            return
        state = self._states.get(request_id)
        if state is None or not state.origin <= start <= state.end:
            # First sight, or a gap (cached prefix, recompute from scratch): a new window.
            state = self._new_state(start, n)
            self._states[request_id] = state
        slot = start - state.origin
        needed = slot + n
        if needed > state.features.shape[0]:
            grown = torch.empty(max(needed, 2 * state.features.shape[0]), states.shape[1])
            grown[:slot] = state.features[:slot]
            state.features = grown
        state.features[slot:needed] = states
        state.known = needed
        state.fed = min(state.fed, slot)

    def _new_state(self, origin: int, n: int) -> _HeadState:
        c = self.head.config
        return _HeadState(
            origin=origin,
            features=torch.empty(max(64, 2 * n), c.hidden_size),
            known=0,
            fed=0,
            kv=BatchKV.empty(c, 1, max(64, 2 * n)),
        )

    @torch.inference_mode()
    def propose(
        self, requests: list[DraftRequest], sampling: list[bool], trees: list[bool] | None = None
    ) -> list[Draft]:
        """`trees[i]`: request i may get a tree (greedy, and `tree_width` > 1 here)."""
        drafts = [Draft(token_ids=[]) for _ in requests]
        room = self.head.config.max_position
        active: list[int] = []
        for i, req in enumerate(requests):
            state = self._states.get(req.request_id)
            # The head continues from the state of the second-to-last token: without it (a
            # sequence the engine never showed us in full) there is nothing to draft from.
            if req.max_tokens > 0 and state is not None and state.end == len(req.token_ids) - 1:
                if state.known + req.max_tokens < room:
                    active.append(i)
        if not active:
            return drafts
        reqs = [requests[i] for i in active]
        states = [self._states[r.request_id] for r in reqs]
        want_q = [sampling[i] for i in active]
        tree_rows = [
            row
            for row, i in enumerate(active)
            if trees is not None and trees[i] and self.tree_width > 1 and not want_q[row]
        ]
        chain_rows = [row for row in range(len(reqs)) if row not in set(tree_rows)]
        steps = max(r.max_tokens for r in reqs)
        # A tree's depth expands at most `tree_width` nodes, each one cache entry.
        f, kv = self._feed_true_pairs(reqs, states, steps * (self.tree_width if tree_rows else 1))
        if tree_rows:
            # Tree rows read their own batch rows of the batch's cache (no copy of it).
            grown = self._trees(
                [_Growth(reqs[r].max_tokens, states[r].known, f[r], r) for r in tree_rows], kv
            )
            for row, draft in zip(tree_rows, grown, strict=True):
                drafts[active[row]] = draft
        if chain_rows:
            if len(chain_rows) < len(reqs):
                index = torch.tensor(chain_rows)
                kv = kv.select(index)
            chains = self._chains(
                [reqs[r] for r in chain_rows],
                [states[r] for r in chain_rows],
                f[chain_rows],
                [want_q[r] for r in chain_rows],
                kv,
            )
            for row, draft in zip(chain_rows, chains, strict=True):
                drafts[active[row]] = draft
        return drafts

    def _feed_true_pairs(
        self, reqs: list[DraftRequest], states: list[_HeadState], room: int
    ) -> tuple[torch.Tensor, BatchKV]:
        """Feed each request's true pairs the head has not seen yet (batched); returns the
        predicted state after each request's last one [B, H] and the batch's cache (each
        request's own cache when alone, else a gathered copy, whose true pairs are already
        written back to every request's cache) with `room` slots past every row's true
        pairs for the guesses."""
        for state in states:
            state.fed = min(state.fed, state.known - 1)  # at least one pair gives the next f
        width = max(s.known - s.fed for s in states)
        # The torch path pads a short chunk and writes its padding slots too (past its row's
        # end, never attended); the native path feeds exactly the new pairs.
        capacity = max(s.fed for s in states) + width + room
        for state in states:
            state.kv = state.kv.grown(self.head.config, capacity, state.fed)
        starts = [s.fed for s in states]
        c = self.head.config
        lens = [s.known - s.fed for s in states]
        kv = (
            states[0].kv
            if len(states) == 1
            else gather_kv(c, [s.kv for s in states], starts, capacity)
        )
        if self.head.native is not None:
            last = self._feed_ragged(reqs, states, lens, kv)
        else:
            features = torch.zeros(len(reqs), width, c.hidden_size)
            next_ids = torch.zeros(len(reqs), width, dtype=torch.long)
            for row, (req, state, n) in enumerate(zip(reqs, states, lens, strict=True)):
                features[row, :n] = state.features[state.fed : state.known]
                first = state.origin + state.fed + 1
                next_ids[row, :n] = torch.tensor(req.token_ids[first : first + n])
            out = self.head(features, next_ids, torch.tensor(starts), kv)
            last = out[torch.arange(len(reqs)), torch.tensor(lens) - 1]
        for state in states:
            state.fed = state.known
        if len(states) > 1:
            scatter_kv(
                kv,
                [s.kv for s in states],
                [(a, s.known) for a, s in zip(starts, states, strict=True)],
            )
        return last, kv

    def _feed_ragged(
        self, reqs: list[DraftRequest], states: list[_HeadState], lens: list[int], kv: BatchKV
    ) -> torch.Tensor:
        """The native step over exactly the new pairs, each request's after the other's (its
        rows say their batch row and slot): a request that catches up on a whole prompt no
        longer pads every other request's few new pairs to its width (at `bench spec`'s chat
        b8, 3,275 head rows were computed for 2,249 pairs). Returns each request's last
        predicted state [B, H]."""
        assert self.head.native is not None
        total = sum(lens)
        features = torch.empty(total, self.head.config.hidden_size)
        next_ids = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int32)
        rows = np.empty(total, dtype=np.int32)
        at = 0
        for row, (req, state, n) in enumerate(zip(reqs, states, lens, strict=True)):
            features[at : at + n] = state.features[state.fed : state.known]
            first = state.origin + state.fed + 1
            next_ids[at : at + n] = req.token_ids[first : first + n]
            slots[at : at + n] = np.arange(state.fed, state.known, dtype=np.int32)
            rows[at : at + n] = row
            at += n
        out = self.head.native.forward(next_ids, features, slots, rows, kv)
        return out[torch.from_numpy(np.cumsum(lens) - 1)]

    def _chains(
        self,
        reqs: list[DraftRequest],
        states: list[_HeadState],
        f: torch.Tensor,
        want_q: list[bool],
        kv: BatchKV,
    ) -> list[Draft]:
        """Each row's chain of guesses, all rows stepped together; a greedy row's chain ends
        where the head's confidence in it falls below `min_chain_confidence`."""
        room = self.head.config.max_position
        pos = torch.tensor([s.known for s in states])
        steps = max(r.max_tokens for r in reqs)
        lengths = [r.max_tokens for r in reqs]
        confidence = torch.ones(len(reqs))
        tokens, probs = [], []
        for step in range(steps):
            logits = self.head.logits(f)
            q = torch.softmax(logits, dim=-1)
            top, choice = q.max(-1)
            if any(want_q):
                drawn = torch.multinomial(q, 1, generator=self._generator)[:, 0]
                choice = torch.where(torch.tensor(want_q), drawn, choice)
            tokens.append(choice)
            probs.append(q)
            if self.min_chain_confidence > 0.0:
                confidence = confidence * top
                for row in range(len(reqs)):
                    doubt = float(confidence[row]) < self.min_chain_confidence
                    if doubt and not want_q[row] and lengths[row] > step:
                        lengths[row] = step
                if all(n <= step + 1 for n in lengths):
                    break
            if step + 1 < steps:
                ids = self.vocab_ids[choice]
                f = self.head(f[:, None], ids[:, None], pos.clamp(max=room - 1), kv)[:, 0]
                pos = pos + 1
        drafts = []
        for row in range(len(reqs)):
            m = lengths[row]
            if m == 0:
                drafts.append(Draft([]))
                continue
            proposed = self.vocab_ids[torch.stack([t[row] for t in tokens[:m]])].tolist()
            q_full = None
            if want_q[row]:
                # q is zero outside the head vocabulary; verification stays exact with it.
                q_full = torch.zeros(m, self.target_vocab_size)
                q_full[:, self.vocab_ids] = torch.stack([p[row] for p in probs[:m]])
            drafts.append(Draft(token_ids=proposed, probs=q_full))
        return drafts

    def _trees(self, rows: list[_Growth], kv: BatchKV) -> list[Draft]:
        """Greedy rows' draft trees, each of at most its `budget` nodes over its batch row of
        `kv` (its true pairs in slots < its `known`): EAGLE-2's dynamic tree.

        Expansion: depth by depth, the `tree_width` likeliest nodes of each row's newest depth
        are stepped through the head, every row's together (one call per depth for the
        whole batch, as chains are), and each offers its `tree_width` likeliest next tokens
        as candidates. A node's likelihood is the product of the head's probabilities along
        its path; candidates below `tree_min_confidence` are never kept. Selection: the
        `budget` likeliest candidates of *every* depth. Choosing depth by depth instead
        spent the budget on the first depths' siblings and cut the main path short where the
        head was sure of it. A child is never likelier than its parent, so the likeliest
        candidates always include their ancestors, and a row stops expanding once its
        newest depth cannot beat the selection it would join."""
        floor = math.log(self.tree_min_confidence) if self.tree_min_confidence > 0 else -math.inf
        for depth in range(1, max(g.budget for g in rows) + 1):
            live = [r for r, g in enumerate(rows) if g.frontier]
            if not live:
                break
            states = torch.stack([rows[r].predicted[n] for r in live for n in rows[r].frontier])
            logp = torch.log_softmax(self.head.logits(states), dim=-1)
            top, choice = logp.topk(min(self.tree_width, logp.shape[-1]), dim=-1)
            at = 0
            for r in live:
                g = rows[r]
                m = len(g.frontier)
                g.offer(top[at : at + m], choice[at : at + m], floor, self.tree_width, depth)
                at += m
            stepping = [rows[r] for r in live if rows[r].frontier]
            if stepping:
                self._step_nodes(stepping, depth, kv)
        return [g.draft(self.vocab_ids) for g in rows]

    def _step_nodes(self, rows: list[_Growth], depth: int, kv: BatchKV) -> None:
        """One head call for every row's new frontier (the nodes of `depth`)."""
        for g in rows:
            for node in g.frontier:
                g.entry[node] = len(g.entry)
        width = max(len(g.entry) for g in rows)
        nodes = [(g, node) for g in rows for node in g.frontier]
        ancestry = torch.zeros((len(nodes), width), dtype=torch.bool)
        for i, (g, node) in enumerate(nodes):
            walk = node
            while walk >= 0:
                ancestry[i, g.entry[walk]] = True
                walk = g.parents[walk]
        known = torch.tensor([g.known for g, _ in nodes])
        out = self.head.forward_nodes(
            torch.stack([g.predicted[g.parents[n]] for g, n in nodes]),
            self.vocab_ids[torch.tensor([g.tokens[n] for g, n in nodes])],
            known + depth - 1,
            torch.tensor([g.known + g.entry[n] for g, n in nodes]),
            known,
            ancestry,
            kv,
            torch.tensor([g.batch_row for g, _ in nodes]),
        )
        for i, (g, node) in enumerate(nodes):
            g.predicted[node] = out[i]


class _Growth:
    """One row's tree as it grows (HeadDraftProposer._trees): every candidate so far, with
    its parent and the log-likelihood of its path; the nodes to expand next; the head's
    predicted state after each expanded node, and each one's cache entry (slot known + entry
    of batch row `batch_row` of the head's cache)."""

    def __init__(self, budget: int, known: int, f_root: torch.Tensor, batch_row: int):
        self.budget = budget
        self.known = known
        self.batch_row = batch_row
        self.tokens: list[int] = []  # head vocabulary ids
        self.parents: list[int] = []
        self.score: list[float] = []
        self.entry: dict[int, int] = {}
        self.predicted: dict[int, torch.Tensor] = {-1: f_root}
        self.frontier = [-1]

    def offer(
        self, top: torch.Tensor, choice: torch.Tensor, floor: float, width: int, depth: int
    ) -> None:
        """Take the frontier's `width` likeliest next tokens each as candidates (above
        `floor`), and choose the next frontier: empty once expanding cannot pay."""
        base = torch.tensor([self.score[n] if n >= 0 else 0.0 for n in self.frontier])[:, None]
        total = (base + top).flatten()
        added: list[int] = []
        for flat in total.argsort(descending=True).tolist():
            if float(total[flat]) < floor:
                break
            self.parents.append(self.frontier[flat // choice.shape[1]])
            self.tokens.append(int(choice.flatten()[flat]))
            self.score.append(float(total[flat]))
            added.append(len(self.tokens) - 1)
        self.frontier = added[:width]
        if depth >= self.budget:
            self.frontier = []
        elif self.frontier and len(self.score) >= self.budget:
            # The selection's weakest member: a deeper node, no likelier than the best of
            # this depth, would have to beat it to be proposed.
            weakest = sorted(self.score, reverse=True)[self.budget - 1]
            if self.score[self.frontier[0]] <= weakest:
                self.frontier = []

    def draft(self, vocab_ids: torch.Tensor) -> Draft:
        if not self.tokens:
            return Draft([])
        # Likeliest first, ties to the earlier candidate (a parent before its children);
        # then back in creation order, in which every parent precedes its children.
        order = sorted(range(len(self.tokens)), key=lambda n: -self.score[n])
        chosen = sorted(order[: self.budget])
        index = {node: i for i, node in enumerate(chosen)}
        parents = tuple(index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in chosen)
        kept = [self.tokens[n] for n in chosen]
        return Draft(vocab_ids[torch.tensor(kept)].tolist(), None, parents)
