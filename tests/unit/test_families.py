"""Every served family against `transformers` on tiny random weights (fp32): the same logits,
and the same greedy tokens through every engine path (batching, chunked prefill, a cached
prefix, preemption, host-tier spill, n-gram speculation), with the block manager clean."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.kvcache.pool import KVPool
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.model.tiny_families import (
    FAMILIES,
    VOCAB,
    WINDOW,
    reference_greedy,
    reference_logits,
    save_family,
)
from kernels.attention_metadata import AttentionMetadata
from shared.sampling.params import SamplingParams
from tools.bench.models_bench import hit_rate, replay_conversation

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Lengths straddle the 12-token window and the 16-token block.
LENGTHS = (3, 11, 17, 30, 45)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


def _repetitive(seed: int = 1) -> list[list[int]]:
    """Prompts whose motifs repeat: the n-gram drafter finds proposals in them."""
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 6))]
        out.append(motif * rng.randrange(3, 6) + [rng.randrange(3, VOCAB)])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, our model loaded from the saved folder, the transformers reference)."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_family(request.param, folder)
    return request.param, LlamaModel(read_checkpoint(folder), weights="fp32"), reference


def _engine(model: LlamaModel, **overrides) -> Engine:
    cfg = dict(num_blocks=64, block_size=16, max_num_batched_tokens=256)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model)


def _run(engine: Engine, prompts, params=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    results: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        engine.blocks.check_integrity()
    return [results[i] for i in ids]


def test_registered_as_its_family(family):
    name, model, _ = family
    expected = {"llama3": "llama"}.get(name, name)
    assert model.config.architecture == expected
    assert not model.config.is_plain_llama


def test_logits_equal_transformers(family):
    """Whole prompts, and the same prompts in two chunks over the paged cache."""
    _, model, reference = family
    for prompt in _prompts():
        want = reference_logits(reference, prompt)
        n = len(prompt)
        pool = KVPool(model.kv_layout(16), 4)
        meta = AttentionMetadata([n], [n], [[0, 1, 2, 3]], 16)
        got = model.logits(model.forward(torch.tensor(prompt), meta, pool))
        assert (got - want).abs().max().item() <= 1e-3
        if n > 1:
            cut = n // 2
            pool = KVPool(model.kv_layout(16), 4)
            parts = []
            for start, end in ((0, cut), (cut, n)):
                meta = AttentionMetadata([end - start], [end], [[0, 1, 2, 3]], 16)
                hidden = model.forward(torch.tensor(prompt[start:end]), meta, pool)
                parts.append(model.logits(hidden))
            assert (torch.cat(parts) - want).abs().max().item() <= 1e-3


@pytest.fixture(scope="module")
def expected(family):
    _, _, reference = family
    return [reference_greedy(reference, p, GREEDY.max_tokens) for p in _prompts()]


def test_greedy_alone_batched_and_chunked_equal_transformers(family, expected):
    _, model, _ = family
    prompts = _prompts()
    alone = [_run(_engine(model), [p])[0] for p in prompts]
    assert alone == expected
    assert _run(_engine(model), prompts) == expected
    assert _run(_engine(model, max_num_batched_tokens=7), prompts) == expected


def test_cached_prefix_equals_fresh(family, expected):
    _, model, _ = family
    engine = _engine(model)
    prompts = _prompts()
    assert _run(engine, prompts) == expected
    long = prompts[-1]
    rid = engine.add_request(long, GREEDY)
    outs = []
    while engine.has_work:
        outs += [o for o in engine.step() if o.request_id == rid]
        engine.blocks.check_integrity()
    assert [t for o in outs for t in o.new_token_ids] == expected[-1]
    assert outs[0].num_cached_tokens == (len(long) - 1) // 16 * 16 > 0


def test_preempted_and_spilled_equal_transformers(family, expected):
    _, model, _ = family
    prompts = _prompts()
    host = 64 * 1024 * 1024
    for mode in ("recompute", "swap"):
        # 6 blocks for prompts needing 1+1+2+3+4: they cannot all stay resident.
        engine = _engine(model, num_blocks=6, preemption_mode=mode, host_cache_bytes=host)
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        seqs = [engine.sequences[i] for i in ids]
        got: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_work:
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
            engine.blocks.check_integrity()
        assert [got[i] for i in ids] == expected
        assert sum(s.num_preemptions for s in seqs) > 0, "the pool was meant to run out"
        assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
    engine = _engine(model, num_blocks=6, host_cache_bytes=host)
    assert _run(engine, [prompts[-1]]) == [expected[-1]]
    _run(engine, [prompts[-2][:1] * 60])  # a filler that needs every block: the target spills
    assert engine.blocks.match_prefix(prompts[-1]).num_host_blocks > 0
    assert _run(engine, [prompts[-1]]) == [expected[-1]]
    assert engine.blocks.stats.host_hit_blocks > 0


def test_ngram_speculation_equals_plain(family):
    _, model, reference = family
    prompts = _repetitive()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [reference_greedy(reference, p, params.max_tokens) for p in prompts]
    engine = _engine(model, speculative_method="ngram", num_speculative_tokens=4)
    assert _run(engine, prompts, params) == want
    assert engine.spec_stats()["verify_steps"] > 0
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks


# Per family: the windows transformers' own config gives each layer (None: global).
WINDOWS = {
    "llama3": (None, None),
    "qwen2": (None, None),
    "qwen3": (None, None),
    "mistral": (WINDOW, WINDOW),
    "gemma3": (WINDOW, None),
    "qwen3_moe": (None, None),
    "qwen2_moe": (None, None),
    "mixtral": (WINDOW, WINDOW),
}


def test_layer_windows_follow_the_config(family):
    name, model, _ = family
    assert tuple(model.config.window(i) for i in range(2)) == WINDOWS[name]


def test_sharded_folder_loads_through_its_index(tmp_path):
    reference = save_family("qwen3", tmp_path)
    reference.save_pretrained(str(tmp_path / "sharded"), max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    model = LlamaModel(read_checkpoint(tmp_path / "sharded"), weights="fp32")
    prompt = _prompts()[-1]
    pool = KVPool(model.kv_layout(16), 4)
    meta = AttentionMetadata([len(prompt)], [len(prompt)], [[0, 1, 2, 3]], 16)
    got = model.logits(model.forward(torch.tensor(prompt), meta, pool))
    assert (got - reference_logits(reference, prompt)).abs().max().item() <= 1e-3


def test_expert_load_is_exported_as_a_metric(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from services.worker.engine_metrics import EngineMetrics

    save_family("qwen3_moe", tmp_path)
    model = LlamaModel(read_checkpoint(tmp_path), weights="fp32")
    engine = _engine(model)
    registry = CollectorRegistry()
    EngineMetrics(registry, engine, "tiny-moe", "prefill")
    prompt = _prompts()[-1]
    _run(engine, [prompt])
    text = generate_latest(registry).decode()
    rows = [line for line in text.splitlines() if line.startswith("splitserve_moe_expert_tokens")]
    # Layer 0 is sparse (layer 1 is in mlp_only_layers): 4 experts, top-2 of every token.
    assert len(rows) == 4 and all('layer="0"' in r for r in rows)
    computed = len(prompt) + GREEDY.max_tokens - 1
    assert sum(float(r.rsplit(" ", 1)[1]) for r in rows) == 2 * computed


# Families whose every layer slides: only they can release blocks behind the window (a
# global layer anywhere keeps every block; the other families' replays cover that).
SLIDING_ONLY = tuple(name for name, windows in WINDOWS.items() if all(windows))


@pytest.mark.parametrize("family", SLIDING_ONLY, indirect=True)
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_sliding_models_release_blocks_behind_the_window(family, expected, method):
    """Every layer slides (Mistral, Mixtral): a decoding sequence holds only the blocks its
    window reaches, and its output is unchanged, batched and speculating."""
    name, model, _ = family
    assert model.config.max_window == WINDOW, f"{name} was listed as sliding on every layer"
    block = 4
    bound = -(-WINDOW // block) + 2 + (4 // block if method == "ngram" else 0)
    prompts = _prompts()
    for mode, num_blocks in (("recompute", 40), ("swap", 20)):
        engine = _engine(
            model,
            block_size=block,
            num_blocks=num_blocks,
            speculative_method=method,
            num_speculative_tokens=4,
            preemption_mode=mode,
            host_cache_bytes=64 * 1024 * 1024,
        )
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        got: dict[str, list[int]] = {i: [] for i in ids}
        released = 0
        while engine.has_work:
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
            engine.blocks.check_integrity()
            for seq in engine.scheduler.running:
                table = seq.table
                if table is not None and seq.num_computed_tokens > seq.num_prompt_tokens:
                    assert len(table.live_block_ids) <= bound
                    released = max(released, table.num_released)
        assert [got[i] for i in ids] == expected
        assert released > 0
        assert engine.blocks.num_available_blocks == engine.blocks.num_blocks


# Eviction is family-independent but for what a family releases: one plain, one releasing
# blocks behind its window, one hybrid (keeps every block) carry the tight-pool replays.
PRESSURE_FAMILIES = ("llama3", "mistral", "gemma3")


def test_conversation_hits_and_the_router_agrees_with_the_engine(family):
    """A 12-turn replay reuses >= 90% of each later prompt, and the router's index — fed the
    engine's KV events — predicts every turn's hit exactly, also when a second conversation
    evicts the first (dropped, or spilled to the host tier)."""
    name, model, _ = family
    events: list = []
    roomy = Engine(
        EngineConfig(num_blocks=64, block_size=16), model=model, event_sink=events.append
    )
    turns = replay_conversation(roomy, events)
    assert hit_rate(turns) >= 0.9
    assert all(t.cached_tokens == t.router_cached_tokens for t in turns)
    if name not in PRESSURE_FAMILIES:
        return
    for host in (0, 64 * 1024 * 1024):
        events = []
        tight = Engine(
            EngineConfig(num_blocks=30, block_size=16, host_cache_bytes=host),
            model=model,
            event_sink=events.append,
        )
        for seed in (0, 1, 0):
            turns = replay_conversation(tight, events, turns=6, seed=seed)
            assert [t.cached_tokens for t in turns] == [t.router_cached_tokens for t in turns]
        assert any(e.kind == "removed" for e in events)


def test_disaggregated_prefill_transfer_decode_equals_transformers(family, expected):
    """Prefill on one engine, the prompt's blocks pushed through the in-process transfer
    fabric, decode on another: the reply is the reference's, the next turn reuses the pushed
    blocks there, and every block is back on both sides."""
    from prometheus_client import CollectorRegistry

    from services.kvtransfer.fake import FakeFabric, FakeTransferBackend
    from services.kvtransfer.session import TransferSession
    from services.kvtransfer.types import TransferState

    _, model, reference = family
    block = 4  # small blocks: a sliding family's decode side releases some of them
    prefill = _engine(model, block_size=block, num_blocks=48)
    decode = _engine(model, block_size=block, num_blocks=48)
    fabric, registry = FakeFabric(), CollectorRegistry()
    senders = FakeTransferBackend("prefill", fabric, registry=registry)
    receivers = FakeTransferBackend("decode", fabric, registry=registry)
    sent_meta, recv_meta = senders.register_pool(prefill.pool), receivers.register_pool(decode.pool)
    senders.add_peer("decode", recv_meta)
    receivers.add_peer("prefill", sent_meta)
    prompt = _prompts()[-1]
    rid = prefill.add_request(prompt, GREEDY, request_id="r1", keep_kv=True, max_new_tokens=1)
    first = [t for o in prefill.run_until_done() for t in o.new_token_ids]
    table = decode.reserve_blocks(len(prompt))
    assert table is not None and len(first) == 1
    recv = receivers.prepare_receive(rid, table.block_ids, 6.0)
    src = list(prefill.sequences[rid].table.block_ids)
    sent = senders.send(rid, src, recv.descriptors, 5.0)
    send_session = TransferSession(senders, sent, lambda _s: prefill.release(rid))
    recv_session = TransferSession(receivers, recv, lambda _s: None)
    assert send_session.wait() is TransferState.DONE
    assert recv_session.wait() is TransferState.DONE
    decode.add_prefilled(rid, prompt, first[0], table, GREEDY)
    rest = [t for o in decode.run_until_done() for t in o.new_token_ids]
    assert first + rest == expected[-1]
    turn2 = prompt + expected[-1] + [7, 8, 9]
    rid2 = decode.add_request(turn2, GREEDY)
    outs = [o for o in decode.run_until_done() if o.request_id == rid2]
    assert outs[0].num_cached_tokens >= len(prompt) // block * block
    assert [t for o in outs for t in o.new_token_ids] == reference_greedy(reference, turn2, 8)
    for engine in (prefill, decode):
        engine.blocks.check_integrity()
        assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
    senders.close()
    receivers.close()


@pytest.mark.parametrize("name", ["gemma3", "mixtral"])
def test_auto_format_chooser_measures_the_family(tmp_path, name):
    """`weights: auto` times torch formats only (the native step is Llama's alone)."""
    from engine.model.formats import measure

    save_family(name, tmp_path)
    choice = measure(read_checkpoint(tmp_path), ["fp32", "native"])
    assert choice.prefill == choice.decode == "fp32"
    assert "Llama's layout only" in choice.skipped["native"]
