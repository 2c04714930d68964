"""Truncating a distribution to its likely tokens: top-k, then top-p, then min-p.

Each of the three keeps a row's most likely tokens down to some cut, so together they come
down to one per-row logit threshold: tokens below it get ``-inf``, tokens at or above it
keep their logits. The most likely token is always kept, so a row never ends up empty, and
tokens tied with the cut value are all kept.

Finding the top-k/top-p cut needs the row in descending order. A full sort of the
vocabulary is cheap on a GPU but dominates a CPU step (tens of milliseconds for a batch of
50k-token rows), so on the CPU, where reading a value back costs nothing, the cut is first
looked for among the few hundred most likely tokens, falling back to the full sort only for
a batch in which some nucleus is wider than that.
"""

from __future__ import annotations

import torch

# Enough for the nucleus of a trained model's next-token distribution at usual top_p values.
CPU_CANDIDATES = 256


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask ``[B, V]`` temperature-scaled logits; returns a new tensor.

    ``top_k`` ``[B]`` long (0 = off), ``top_p`` ``[B]`` (keep the most likely tokens until
    their mass, renormalised after top-k, reaches p), ``min_p`` ``[B]`` (drop tokens less
    likely than ``min_p`` times the most likely one). Pass None for a mask no row uses.
    """
    threshold = None
    if top_k is not None or top_p is not None:
        threshold = _top_k_top_p_threshold(logits, top_k, top_p)
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps all.
        min_p_threshold = logits.amax(dim=-1) + min_p.to(logits.dtype).log()
        threshold = min_p_threshold if threshold is None else threshold.maximum(min_p_threshold)
    if threshold is None:
        return logits
    return logits.masked_fill(logits < threshold.unsqueeze(-1), float("-inf"))


def _top_k_top_p_threshold(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        width = _candidate_width(top_k, top_p, vocab)
        if width < vocab:
            candidates = logits.topk(width, dim=-1).values
            threshold, complete = _threshold_from_sorted(logits, candidates, top_k, top_p)
            if bool(complete.all()):
                return threshold
    ordered = logits.sort(dim=-1, descending=True).values
    return _threshold_from_sorted(logits, ordered, top_k, top_p)[0]


def _candidate_width(top_k: torch.Tensor | None, top_p: torch.Tensor | None, vocab: int) -> int:
    """How many of the most likely tokens to look at first; CPU only (reads ``top_k``)."""
    largest_k = 1
    if top_k is not None:
        truncating = top_k[(top_k > 0) & (top_k < vocab)]
        if truncating.numel():
            largest_k = int(truncating.max())
    if top_p is not None:
        largest_k = max(largest_k, CPU_CANDIDATES)
    return min(largest_k, vocab)


def _threshold_from_sorted(
    logits: torch.Tensor,
    ordered: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut from ``ordered`` ``[B, W]``, each row's W largest logits in descending order.

    Returns ``(threshold [B], complete [B] bool)``: ``complete`` is False for a row whose
    nucleus may extend past the W tokens seen, where the threshold is not yet exact.
    """
    batch, width = ordered.shape
    vocab = logits.shape[-1]
    threshold = torch.full((batch,), float("-inf"), dtype=logits.dtype, device=logits.device)
    complete = torch.ones(batch, dtype=torch.bool, device=logits.device)
    k_on = torch.zeros(batch, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        k_on = (top_k > 0) & (top_k < vocab)
        kth = ordered.gather(-1, (top_k.clamp(1, width) - 1).unsqueeze(-1)).squeeze(-1)
        threshold = torch.where(k_on, kth, threshold)
    if top_p is None:
        return threshold, complete

    kept = ordered >= threshold.unsqueeze(-1)
    in_top_k = ordered.masked_fill(~kept, float("-inf"))
    # Top-p renormalises over what top-k left: all within `ordered` for a top-k row, the
    # whole vocabulary otherwise.
    log_total = torch.where(k_on, in_top_k.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (in_top_k - log_total.unsqueeze(-1)).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    in_nucleus = (mass_before < top_p.to(probs.dtype).unsqueeze(-1)) & kept
    n_nucleus = in_nucleus.sum(dim=-1).clamp(min=1)
    nucleus_cut = ordered.gather(-1, (n_nucleus - 1).unsqueeze(-1)).squeeze(-1)
    # top_p = 1 must keep everything even where float rounding pushes the running mass to 1.
    p_on = top_p < 1.0
    threshold = torch.where(p_on, threshold.maximum(nucleus_cut), threshold)
    complete = ~p_on | k_on | (n_nucleus < width) | (width == vocab)
    return threshold, complete
