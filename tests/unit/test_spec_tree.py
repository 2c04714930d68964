"""Draft trees: verified in one pass with a tree attention mask, greedy output equal to plain
decoding at batch 1 and 8 on the torch and native paths, the KV of accepted nodes moved where a
chain keeps it, stops inside accepted paths, and the structure helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.kvcache.pool import KVPool
from engine.model.llama import LlamaModel
from engine.model.tiny import tiny_quantized_checkpoint
from engine.speculative.proposer import Draft
from engine.speculative.tree import accept_greedy, compaction, main_chain, merge_chain
from kernels.attention_metadata import AttentionMetadata, tree_depths, tree_visibility
from shared.sampling.params import SamplingParams
from tests.spec_helpers import TreeOracleProposer, checked_run, motif_prompts, verified_drafts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(model, draft=None, k=8, **overrides) -> Engine:
    cfg = dict(num_blocks=200, block_size=4, speculative_method="draft" if draft else "none")
    cfg.update(num_speculative_tokens=k, **overrides)
    return Engine(EngineConfig(**cfg), model=model, draft=draft)


def test_tree_structure_helpers():
    parents = (-1, -1, 0, 2, 1)  # root -> {0, 1}; 0 -> 2 -> 3; 1 -> 4
    assert tree_depths(parents) == [1, 1, 2, 3, 2]
    seen = tree_visibility(parents)
    assert seen[4].tolist() == [True, True, False, True, True, False]  # node 3: 0, 2, itself
    assert seen[5].tolist() == [True, False, True, False, False, True]  # node 4: 1, itself
    draft = Draft([10, 11, 12, 13, 14], None, parents)
    # targets per row: root, then each node; the target wants 11 then 14 then 99
    nodes, last = accept_greedy(draft, [11, 0, 14, 0, 0, 99])
    assert (nodes, last) == ([1, 4], 99)
    assert compaction([1, 4]) == [(2, 1), (5, 2)]
    assert compaction([0, 2, 3]) == [(3, 2), (4, 3)]
    assert main_chain(draft).token_ids == [10, 12, 13]
    merged = merge_chain(draft, [10, 12, 50, 51], limit=7)
    assert merged.token_ids == [10, 11, 12, 13, 14, 50, 51]
    assert merged.parents == (-1, -1, 0, 2, 1, 2, 5)
    assert merge_chain(draft, [10, 12, 50, 51], limit=6).token_ids[-1] == 50
    assert Draft([1, 2, 3], None, (-1, 0, 1)).parents is None  # a chain is stored as one
    assert draft.prefix(3).parents == (-1, -1, 0)
    with pytest.raises(ValueError, match="precede"):
        Draft([1, 2], None, (-1, 1))
    with pytest.raises(ValueError, match="chain"):
        Draft([1, 2], torch.full((2, 4), 0.25), (-1, -1))


def _continuations(model, prompts):
    plain = _engine(model).generate(prompts, SamplingParams(temperature=0.0, max_tokens=40))
    return {tuple(p): out for p, out in zip(prompts, plain, strict=True)}


@pytest.fixture(scope="module", params=["fp32", "native"])
def tree_model(request):
    model = LlamaModel(tiny_quantized_checkpoint(seed=2), weights=request.param)
    assert model.verifies_trees
    return model


@pytest.mark.parametrize("batch", [1, 8])
def test_tree_drafts_keep_greedy_output_plain(tree_model, batch):
    prompts = motif_prompts(8, seed=7)
    plain = _engine(tree_model).generate(prompts, GREEDY)
    proposer = TreeOracleProposer(_continuations(tree_model, prompts))
    engine = _engine(tree_model, proposer, k=15, max_num_seqs=batch)
    assert checked_run(engine, prompts, GREEDY) == plain
    stats = engine.spec_stats()
    # Paths through first and later children were accepted, to every depth.
    assert stats["verify_steps"] > 0 and stats["accepted_tokens"] > stats["verify_steps"]
    assert max(i for i, n in enumerate(stats["accepted_histogram"]) if n) >= 4


def test_a_stop_inside_an_accepted_path_lands_where_plain_decoding_puts_it(tree_model):
    prompts = motif_prompts(4, seed=9)
    plain = _engine(tree_model).generate(prompts, SamplingParams(temperature=0.0, max_tokens=30))
    stops = [out[7] for out in plain]
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[s]) for s in stops]
    want = [out[: out.index(s) + 1] for out, s in zip(plain, stops, strict=True)]
    proposer = TreeOracleProposer(_continuations(tree_model, prompts), wrong_every=0)
    engine = _engine(tree_model, proposer)
    assert engine.generate(prompts, params) == want
    engine.blocks.check_integrity()


def test_sampled_rows_keep_chains_and_greedy_rows_trees(tiny_model):
    """A tree offered for a sampled row is cut to its first branch (sampling verifies
    chains); greedy rows keep theirs."""
    prompts = motif_prompts(2, seed=4)
    proposer = TreeOracleProposer(_continuations(tiny_model, prompts), wrong_every=0)
    engine = _engine(tiny_model, proposer)
    seen = verified_drafts(engine)
    # Nearly greedy, so that the oracle (which knows the greedy reply) keeps proposing.
    engine.add_request(prompts[0], SamplingParams(temperature=0.05, max_tokens=12, seed=1))
    engine.add_request(prompts[1], GREEDY)
    list(engine.run_until_done())
    engine.blocks.check_integrity()
    assert any(greedy and d.is_tree for greedy, d in seen)
    assert any(not greedy for greedy, _ in seen)
    assert not any(not greedy and d.is_tree for greedy, d in seen)


def test_accepted_nodes_kv_lands_where_plain_decoding_writes_it(tree_model):
    """After a verify step that accepted a path through later children, the sequence's K/V
    at every kept position equals plain decoding's (bit for bit on the native step)."""
    prompt = motif_prompts(1, seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain_engine = _engine(tree_model)
    plain_engine.add_request(prompt, params, request_id="p", keep_kv=True)
    plain = [t for o in plain_engine.run_until_done() for t in o.new_token_ids]
    proposer = TreeOracleProposer({tuple(prompt): plain}, wrong_every=0)
    engine = _engine(tree_model, proposer, k=15)
    seen = verified_drafts(engine)
    engine.add_request(prompt, params, request_id="t", keep_kv=True)
    assert [t for o in engine.run_until_done() for t in o.new_token_ids] == plain
    assert any(d.is_tree and d.parents and d.parents[1] == -1 for _, d in seen)
    kept = len(prompt) + len(plain) - 1  # the last token's KV is never computed
    mine, theirs = engine.sequences["t"], plain_engine.sequences["p"]

    def kv(e, seq):
        ids = seq.table.attention_block_ids()
        return torch.stack([e.pool.tensor[ids[p // 4], :, :, p % 4] for p in range(kept)])

    got, want = kv(engine, mine), kv(plain_engine, theirs)
    if tree_model.native is not None:
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max().item() <= 1e-5


def test_native_tree_rows_compute_the_bits_of_plain_decoding():
    """A tree node's row through the native step equals, bit for bit, the row plain
    decoding computes for the same token at the same position after the same tokens: the
    remapped ancestors are scored and summed as ordinary context would be."""
    model = LlamaModel(tiny_quantized_checkpoint(seed=2), weights="native")
    assert model.native is not None
    bs, n = 4, 37
    prompt = motif_prompts(1, seed=3)[0] * 5
    prompt = (prompt * 4)[:n]
    pool = KVPool(model.kv_layout(bs, torch.float32), 24)
    table = list(range(24))
    model.forward_path(torch.tensor(prompt), AttentionMetadata([n], [n], [table], bs), pool, False)
    snapshot = pool.tensor.clone()
    # Root (last token, position n) then nodes: 0 -> 2 -> 3, and 1 -> 4.
    root, parents, nodes = 5, (-1, -1, 0, 2, 1), [6, 7, 8, 9, 10]
    meta = AttentionMetadata([6], [n + 6], [table], bs, trees=[parents])
    tree_rows = model.forward_path(torch.tensor([root, *nodes]), meta, pool, True)
    # Plain decoding of the path root, 6, 8, 9 (nodes 0, 2, 3) one token at a time.
    pool.tensor.copy_(snapshot)
    plain = []
    for i, token in enumerate([root, 6, 8, 9]):
        step = AttentionMetadata([1], [n + i + 1], [table], bs)
        plain.append(model.forward_path(torch.tensor([token]), step, pool, True)[0])
    for tree_row, plain_row in zip([0, 1, 3, 4], plain, strict=True):
        assert torch.equal(tree_rows[tree_row], plain_row)
    assert np.isfinite(tree_rows.numpy()).all()
