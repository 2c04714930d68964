"""The token embedding held as the file's Q8_0 blocks: the same rows as the fp32 copy, bit for
bit, on every path that reads them, in a quarter of the memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kvcache.pool import KVPool
from engine.model.embedding import TokenEmbedding
from engine.model.llama import LlamaModel
from engine.model.native_step import NativeStep
from engine.model.tiny import tiny_checkpoint, tiny_quantized_checkpoint


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_quantized_checkpoint(seed=3)


def test_q8_0_rows_are_the_fp32_rows_bit_for_bit(checkpoint):
    emb = TokenEmbedding.from_checkpoint(checkpoint, torch.device("cpu"), keep_blocks=True)
    assert emb.quantized
    ids = torch.tensor([[0, 5, 511], [7, 7, 300]])
    assert torch.equal(emb[ids], checkpoint.tensors["embed_tokens"][ids])
    every = torch.arange(checkpoint.config.vocab_size)
    assert torch.equal(emb[every], checkpoint.tensors["embed_tokens"])
    assert emb.nbytes < checkpoint.tensors["embed_tokens"].numel() * 4 / 3


def test_a_file_without_q8_0_blocks_or_a_tied_torch_head_keeps_fp32(checkpoint):
    cpu = torch.device("cpu")
    assert not TokenEmbedding.from_checkpoint(tiny_checkpoint(seed=3), cpu, True).quantized
    assert not TokenEmbedding.from_checkpoint(checkpoint, cpu, keep_blocks=False).quantized
    # fp32 weights with a tied head: the head holds the fp32 rows, so lookups use them too.
    assert not LlamaModel(checkpoint, weights="fp32").embed_tokens.quantized
    assert LlamaModel(checkpoint, weights="native").embed_tokens.quantized


def test_the_native_step_reads_q8_0_rows_as_it_read_fp32_rows(checkpoint):
    model = LlamaModel(checkpoint, weights="fp32", decode_weights="native-a8")
    assert model.native is not None and model.native.shares_embedding
    dense = TokenEmbedding.from_checkpoint(checkpoint, torch.device("cpu"), keep_blocks=False)
    twin, reason = NativeStep.create(
        checkpoint, dense, model.rope.cos, model.rope.sin, activations="int8"
    )
    assert twin is not None, reason
    layout = model.kv_layout(16)
    args = (
        np.asarray([3, 400, 17], dtype=np.int64),
        np.asarray([0, 0, 0], dtype=np.int32),
        np.asarray([[0], [1], [2]], dtype=np.int32),
    )
    a, b = KVPool(layout, 3), KVPool(layout, 3)
    got = model.native.forward(*args, a.tensor, 16)
    want = twin.forward(*args, b.tensor, 16)
    assert torch.equal(got, want)
    assert torch.equal(a.tensor, b.tensor)
    # The shared head is the embedding's blocks: same logits as a head of its own.
    assert torch.equal(model.native.logits(got), twin.logits(want))


def test_memory_counts_the_shared_blocks_once(checkpoint):
    model = LlamaModel(checkpoint, weights="native-a8")
    held = model.memory_bytes()
    assert held["embedding+norms"] >= model.embed_tokens.nbytes
    assert model.native is not None
    # The step reads the head every step, so the bytes per step still include it.
    assert (
        model.native.nbytes.per_step_b1 == model.native.nbytes.weights + model.embed_tokens.nbytes
    )
    # The head's int8 twin for greedy rows is held apart, and reported on its own line.
    twin = model.native.nbytes.greedy_twin
    assert twin >= model.embed_tokens.nbytes // 2
    assert held["native head int8 twin (greedy rows)"] == twin


@pytest.mark.real_model
def test_the_bundled_model_holds_its_embedding_in_q8_0(real_checkpoint):
    model = LlamaModel(real_checkpoint, weights="native-a8")
    assert model.embed_tokens.quantized
    fp32_bytes = real_checkpoint.tensors["embed_tokens"].numel() * 4
    assert model.embed_tokens.nbytes < 0.3 * fp32_bytes  # 29 MiB of 108
    ids = torch.tensor([1, 2, 300, 49151])
    assert torch.equal(model.embed_tokens[ids], real_checkpoint.tensors["embed_tokens"][ids])
