"""Exact verification of drafted tokens against the target's distribution at k+1 positions.

Sequence i brings its last sampled token plus k_i drafts; the target's forward pass yields
logits at all k_i + 1 positions (rows ``offset_i .. offset_i + k_i``). Row j is processed
exactly as plain decoding would process it after the drafts before j were emitted — same
penalties over the output so far, temperature, top-k/p, min-p — so:

- greedy: accept the longest run where draft == target argmax, then the target's argmax at the
  first mismatch (or after the last draft). Output is plain decoding's, token for token. A
  draft tree (greedy rows only) is walked from its root the same way, following at each node
  the child that carries the target's token (engine/speculative/tree.py).
- sampling: accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
  rejection draw from norm(max(p_j - q_j, 0)); after k acceptances draw from p_k. The emitted
  tokens are distributed as the target's (Leviathan et al. 2023). Random numbers come from the
  sequence's own generator, so a seeded request is reproducible under a given configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.batch import SamplingBatch
from engine.sampling.sampler import Sampler, probabilities
from engine.sampling.token_mask import TokenMask
from engine.speculative.proposer import Draft
from engine.speculative.tree import accept_greedy, path_tokens
from shared.sampling.params import SamplingParams


@dataclass
class VerifyInput:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # before this step's drafts
    draft: Draft  # k tokens (k may be 0: plain decoding for this sequence)


@dataclass
class Verified:
    token_ids: list[int]  # accepted drafts followed by one target token
    num_accepted: int
    # A tree draft's accepted nodes, root side first (their KV is moved to a chain's slots);
    # None for a chain, whose accepted drafts are its first num_accepted.
    nodes: list[int] | None = None


def verify(
    logits: torch.Tensor,
    items: list[VerifyInput],
    sampler: Sampler,
    shared: torch.Generator,
    mask: TokenMask | None = None,
) -> list[Verified]:
    """``logits``: [sum(k_i + 1), vocab], the rows of each sequence in order. ``mask``: the
    grammar masks of structured-output rows, position j of a row assuming its drafts before
    j were emitted; the target distribution is the masked one, which keeps acceptance
    exact (drafts were cut to what the grammar allows, so q never puts a draft token where
    p cannot)."""
    if mask is not None:
        logits = mask.apply(logits.float())
    needs_probs = any(
        not it.params.is_greedy
        or it.params.uses_repetition_penalty
        or it.params.uses_count_penalties
        for it in items
    )
    if not needs_probs:
        # Plain greedy without penalties: the argmax of the raw logits is all there is.
        targets = logits.float().argmax(dim=-1).tolist()
        return verify_greedy(items, targets)
    rows_params: list[SamplingParams] = []
    rows_out: list[list[int]] = []
    rows_prompt: list[list[int]] = []
    for it in items:
        for j in range(len(it.draft) + 1):
            rows_params.append(it.params)
            rows_out.append(it.output_token_ids + path_tokens(it.draft, j - 1))
            rows_prompt.append(it.prompt_token_ids)
    row_batch = SamplingBatch.build(
        rows_params, [None] * len(rows_params), rows_out, rows_prompt, logits.device
    )
    p = probabilities(logits, row_batch)  # [R, V], one-hot at the (penalised) argmax if greedy
    targets = p.argmax(dim=-1).tolist()
    results: list[Verified] = []
    final_rows: list[torch.Tensor] = []
    final_index: list[int] = []  # results still owed their last (drawn) token
    offset = 0
    for it in items:
        k = len(it.draft)
        if it.params.is_greedy:
            results.extend(verify_greedy([it], targets[offset : offset + k + 1]))
        else:
            accepted, residual = _accept_sampled(it, p[offset : offset + k + 1], shared)
            final_index.append(len(results))
            final_rows.append(residual)
            results.append(Verified(it.draft.token_ids[:accepted], accepted))
        offset += k + 1
    if final_index:
        batch = SamplingBatch.build(
            [items[i].params for i in final_index],
            [items[i].generator for i in final_index],
            [[] for _ in final_index],  # the rows are final distributions: no penalties again
            [[] for _ in final_index],
            logits.device,
        )
        drawn = sampler.sample_from_probs(torch.stack(final_rows), batch).tolist()
        for i, token in zip(final_index, drawn, strict=True):
            results[i].token_ids.append(token)
    return results


def verify_greedy(items: list[VerifyInput], targets: list[int]) -> list[Verified]:
    """Greedy rows without penalties, given the target's argmax at each of their rows."""
    out: list[Verified] = []
    offset = 0
    for it in items:
        k = len(it.draft)
        mine = targets[offset : offset + k + 1]
        if it.draft.is_tree:
            nodes, last = accept_greedy(it.draft, mine)
            tokens = [it.draft.token_ids[n] for n in nodes]
            out.append(Verified(tokens + [last], len(nodes), nodes))
        else:
            accepted = 0
            while accepted < k and it.draft.token_ids[accepted] == mine[accepted]:
                accepted += 1
            out.append(Verified(it.draft.token_ids[:accepted] + [mine[accepted]], accepted))
        offset += k + 1
    return out


def _accept_sampled(
    it: VerifyInput, p: torch.Tensor, shared: torch.Generator
) -> tuple[int, torch.Tensor]:
    """Number of drafts accepted and the distribution the next token is drawn from."""
    k = len(it.draft)
    if k == 0:
        return 0, p[0]
    draft = torch.tensor(it.draft.token_ids, device=p.device)
    steps = torch.arange(k, device=p.device)
    p_draft = p[steps, draft]
    q = it.draft.probs
    q_draft = q[steps, draft].to(p.dtype) if q is not None else torch.ones_like(p_draft)
    u = torch.rand(k, generator=it.generator or shared, device=p.device, dtype=p.dtype)
    # u < p/q without dividing by a q that could be 0.
    rejected = (u * q_draft >= p_draft).nonzero()
    if rejected.numel() == 0:
        return k, p[k]
    j = int(rejected[0, 0])
    if q is None:
        residual = p[j].clone()
        residual[draft[j]] = 0.0
    else:
        residual = (p[j] - q[j].to(p.dtype)).clamp_(min=0.0)
    total = residual.sum()
    # p == q exactly leaves nothing; then any draw from p is exact (rejection had prob 0).
    return j, (residual / total if total > 0 else p[j])
