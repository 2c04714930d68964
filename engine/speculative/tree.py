"""Draft trees: several guessed continuations verified in one forward pass.

A chain of k guesses is lost from its first wrong guess on. Where the draft is unsure between
two tokens, a tree proposes both and extends each, and the target keeps whichever branch it
agrees with (EAGLE-2 and SpecInfer verify this way). The target checks every node in one pass:

- the sequence's last token (the *root*, query row 0) and node i (query row i + 1) are laid out
  in consecutive KV slots, as a chain's rows are;
- node i sits at position root + depth(i) for RoPE, and attends to the context up to the root
  plus its own ancestors and itself, never to a sibling's branch (the attention contract,
  kernels/attention_metadata.py: `tree_depths`, `tree_visibility`);
- after verification the accepted path's KV (and hidden states) are moved down to the slots a
  chain of the same tokens would have used (`compaction`), so the cache ends up exactly as if
  the accepted tokens had been drafted as a chain.

Only greedy rows draft trees: accepting one of several sampled candidates exactly needs
multi-draft rejection sampling, so sampled rows keep chains (Draft refuses a tree with q).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.speculative.proposer import Draft


def ancestors(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's first child down to `node` (inclusive), in order."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def path_tokens(draft: Draft, node: int) -> list[int]:
    """The draft tokens from the root down to `node` (inclusive); [] for the root (-1)."""
    if node < 0:
        return []
    if draft.parents is None:
        return draft.token_ids[: node + 1]
    return [draft.token_ids[i] for i in ancestors(draft.parents, node)]


def accept_greedy(draft: Draft, targets: Sequence[int]) -> tuple[list[int], int]:
    """Walk down from the root while a child carries the target's token. `targets[r]` is the
    target's token after query row r. Returns the accepted nodes and the target's token
    after the last of them (the one token every verify step adds)."""
    children: dict[int, dict[int, int]] = {}
    parents = draft.parents or tuple(range(-1, len(draft) - 1))
    for i, (token, p) in enumerate(zip(draft.token_ids, parents, strict=True)):
        children.setdefault(p, {}).setdefault(token, i)  # first of equal siblings wins
    node, accepted = -1, []
    while True:
        target = targets[node + 1]
        nxt = children.get(node, {}).get(target)
        if nxt is None:
            return accepted, target
        accepted.append(nxt)
        node = nxt


def compaction(nodes: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) query-row moves that put accepted nodes' rows where a chain keeps them:
    the j-th accepted node (row nodes[j] + 1) to row j + 1. Rows only move down (nodes are
    increasing, nodes[j] >= j), so applying the moves in order never overwrites a source
    still to be read."""
    return [(n + 1, j + 1) for j, n in enumerate(nodes) if n != j]


def merge_chain(draft: Draft, chain: Sequence[int], limit: int) -> Draft:
    """`draft` with `chain` (guesses following the root) added as a branch: shared leading
    tokens reuse existing nodes, the rest hang off the last shared one. At most `limit` nodes
    in all (the chain is cut, never the existing tree)."""
    if draft.probs is not None:
        raise ValueError("only greedy (q-free) drafts merge into a tree")
    tokens = list(draft.token_ids)
    parents = list(draft.parents or range(-1, len(tokens) - 1))
    node = -1
    for token in chain:
        nxt = next((i for i, p in enumerate(parents) if p == node and tokens[i] == token), None)
        if nxt is None:
            if len(tokens) >= limit:
                break
            tokens.append(token)
            parents.append(node)
            nxt = len(tokens) - 1
        node = nxt
    return Draft(tokens, None, tuple(parents))


def main_chain(draft: Draft) -> Draft:
    """The tree's first branch (each node's first child) as a chain: what a row that may not
    verify a tree (structured output) keeps of it."""
    if draft.parents is None:
        return draft
    keep, node = [], -1
    for i, p in enumerate(draft.parents):
        if p == node:
            keep.append(i)
            node = i
    return Draft([draft.token_ids[i] for i in keep])
