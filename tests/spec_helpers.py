"""Test draft sources for speculative decoding: an oracle that knows the target's continuation
(with planted mistakes, so every acceptance length occurs) and a proposer drawing from a fixed
distribution q that differs from the target's p."""

from __future__ import annotations

import random

import torch

from engine.speculative.proposer import Draft, DraftRequest


class OracleProposer:
    """Proposes the known continuation of a prompt, corrupting every `wrong_every`-th token."""

    name = "draft"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
        self.continuations = continuations
        self.wrong_every = wrong_every
        self.calls = 0
        self.released: set[str] = set()

    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        drafts = []
        for req in requests:
            self.calls += 1
            ids = self._continuation(req.token_ids)[: req.max_tokens]
            if self.wrong_every and ids and self.calls % self.wrong_every == 0:
                cut = self.calls % len(ids)
                ids = ids[:cut] + [(ids[cut] + 1) % 500]  # a wrong guess at position `cut`
            drafts.append(Draft(ids))
        return drafts

    def _continuation(self, tokens: list[int]) -> list[int]:
        for prompt, cont in self.continuations.items():
            n = len(prompt)
            done = len(tokens) - n
            if tuple(tokens[:n]) == prompt and tokens[n:] == cont[:done]:
                return cont[done:]
        return []

    def release(self, request_id: str) -> None:
        self.released.add(request_id)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        pass


class TreeOracleProposer(OracleProposer):
    """Proposes draft trees around the known continuation: at each depth a decoy sibling
    before or after the true node (and a decoy child under the decoy), the true path cut
    every `wrong_every`-th call at a varying depth, so that accepted paths run through
    first, middle and last children and stop at every depth."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
        super().__init__(continuations, wrong_every)
        self.rng = random.Random(5)

    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        drafts = []
        for req in requests:
            self.calls += 1
            truth = self._continuation(req.token_ids)
            cut = len(truth)
            if self.wrong_every and truth and self.calls % self.wrong_every == 0:
                cut = self.calls % len(truth)
            tokens: list[int] = []
            parents: list[int] = []
            node = -1
            for depth, token in enumerate(truth[: req.max_tokens]):
                decoy = (token + 1 + depth) % 500
                order = ["decoy", "true"] if self.rng.random() < 0.5 else ["true", "decoy"]
                placed: dict[str, int] = {}
                for kind in order:
                    if kind == "true" and depth >= cut:
                        continue
                    tokens.append(decoy if kind == "decoy" else token)
                    parents.append(node)
                    placed[kind] = len(tokens) - 1
                tokens.append((decoy + 7) % 500)  # a child of the decoy
                parents.append(placed["decoy"])
                if "true" not in placed:
                    break
                node = placed["true"]
            n = min(len(tokens), req.max_tokens)
            drafts.append(Draft(tokens[:n], None, tuple(parents[:n])) if n else Draft([]))
        return drafts


class FixedQProposer:
    """Draws every draft token from one fixed distribution q over the vocabulary."""

    name = "draft"

    def __init__(self, q: torch.Tensor, seed: int = 7):
        self.q = q / q.sum()
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, requests: list[DraftRequest], sampling: list[bool]) -> list[Draft]:
        drafts = []
        for req in requests:
            k = req.max_tokens
            if k == 0:
                drafts.append(Draft([]))
                continue
            ids = torch.multinomial(self.q, k, replacement=True, generator=self.generator)
            drafts.append(Draft(ids.tolist(), self.q.expand(k, -1).clone()))
        return drafts

    def release(self, request_id: str) -> None:
        pass

    def rollback(self, request_id: str, num_tokens: int) -> None:
        pass


def motif_prompts(count: int, seed: int = 3) -> list[list[int]]:
    """Prompts of a repeated motif and a random tail: n-gram drafts find matches in them."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, 80) for _ in range(rng.randrange(3, 7))]
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))]
        out.append(motif * rng.randrange(2, 6) + tail)
    return out


def checked_run(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Run prompts to completion, checking the block manager after every step and that no
    KV block leaked at the end; returns each prompt's output ids."""
    ids = [engine.add_request(p, params) for p in prompts]
    results: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        engine.blocks.check_integrity()
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks  # nothing leaked
    return [results[i] for i in ids]


def pin_draft_cost(engine, seconds: float = 0.0) -> None:
    """Price model drafting at `seconds` per token whatever it measures (see pin_step_costs)."""
    speculator = engine.speculator
    propose = speculator._propose_model_drafts

    def pinned(choices):
        propose(choices)
        speculator._draft_cost = seconds

    speculator._draft_cost = seconds
    speculator._propose_model_drafts = pinned


def pin_step_costs(engine, seconds: float = 0.01) -> None:
    """Price every step alike for the adaptive controller: step times on a shared CPU are
    noise at test sizes, so its choices then depend on acceptance only and nothing timed."""
    engine.speculator.set_calibration(lambda: {n: seconds for n in range(1, 257)})
    engine.speculator.observe_step = lambda num_tokens, seconds: None


def verified_drafts(engine) -> list[tuple[bool, Draft]]:
    """(greedy?, draft) of every row the engine verifies from now on."""
    seen: list[tuple[bool, Draft]] = []
    run = engine.runner.run

    def spy(scheduled, want):
        for item in scheduled:
            if item.num_draft and item.seq.draft is not None:
                seen.append((item.seq.params.is_greedy, item.seq.draft))
        return run(scheduled, want)

    engine.runner.run = spy
    return seen
