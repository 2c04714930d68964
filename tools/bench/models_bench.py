"""`splitserve bench models`: every served family, on its tiny random-weight model.

Per family: prefill and decode tokens/s of one engine, and the prefix-cache hit rate of a
12-turn conversation replayed through it — a system prompt, then per turn a user message and
the model's own reply, each turn resending the whole conversation (what a chat app does).
`prefix_hit_rate` is cached prompt tokens / prompt tokens over turns 2..12 (turn 1 has
nothing to reuse). Beside each turn's hit, the router's prediction from the engine's own KV
events (services/router/index.py): the two must agree, or routing scores a replica on
blocks it cannot reuse.

How the window bounds reuse: a block is reused only if every block before it is cached too
(chained hashes; the router's rule as well). In models whose every layer slides, a decoding
sequence keeps only the blocks its window reaches (ceil(window / block) + 1) and releases
the rest early — into the prefix cache, still registered — so the window bounds what a
live sequence holds, not what a later turn reuses, until memory pressure evicts them.
Hybrid models (Gemma 3's global layers) keep every block.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model.formats import best_seconds
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.model.tiny_families import FAMILIES, VOCAB, save_family
from services.router.index import KVIndex
from shared.kvblocks.events import KVEvent
from shared.kvblocks.hashing import hash_prompt_blocks
from shared.sampling.params import SamplingParams
from tools.bench.engine_bench import decode_rate, prefill_rate

SYSTEM_TOKENS = 200
USER_TOKENS = 12
REPLY_TOKENS = 8
TURNS = 12
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int  # what the engine reused
    router_cached_tokens: int  # what the router's index said this replica held


def replay_conversation(
    engine: Engine, events: list[KVEvent], turns: int = TURNS, seed: int = 0
) -> list[Turn]:
    """Replay a conversation through `engine`, whose KV events are appended to `events`."""
    rng = random.Random(seed)
    index = KVIndex()
    fed = 0
    size = engine.blocks.block_size
    history = [rng.randrange(3, VOCAB) for _ in range(SYSTEM_TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=REPLY_TOKENS, ignore_eos=True)
    out: list[Turn] = []
    for _ in range(turns):
        history += [rng.randrange(3, VOCAB) for _ in range(USER_TOKENS)]
        index.apply("replica", events[fed:])
        fed = len(events)
        # The engine never reuses the block holding the last prompt token (it needs its
        # logits): the router's question is about the blocks before it.
        reusable = (len(history) - 1) // size * size
        hashes = hash_prompt_blocks(history[:reusable], size, engine.blocks.salt)
        predicted = index.prefix("replica", hashes).blocks * size
        rid = engine.add_request(list(history), params)
        reply: list[int] = []
        cached = None
        while engine.has_work:
            for o in engine.step():
                if o.request_id == rid:
                    cached = o.num_cached_tokens if cached is None else cached
                    reply += o.new_token_ids
        engine.blocks.check_integrity()
        out.append(Turn(len(history), cached or 0, predicted))
        history += reply
    return out


def hit_rate(turns: list[Turn]) -> float:
    later = turns[1:]
    return sum(t.cached_tokens for t in later) / sum(t.prompt_tokens for t in later)


def _engine(model: LlamaModel, events: list[KVEvent]) -> Engine:
    config = EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=256)
    return Engine(config, model=model, event_sink=events.append)


def transformers_rates(reference, prompt_len: int, steps: int) -> tuple[float, float]:
    """The peer: the same weights in transformers (fp32, eager, its own KV cache), prefill
    tok/s of one prompt and decode tok/s of one sequence."""
    import torch

    ids = torch.tensor([[3 + i % (VOCAB - 3) for i in range(prompt_len)]])

    def generate(n: int):
        def go() -> None:
            with torch.inference_mode():
                reference.generate(
                    ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
                )

        return go

    with torch.inference_mode():
        prefill_s = best_seconds(lambda: reference(ids))
    decode_s = best_seconds(generate(steps + 1)) - best_seconds(generate(1))
    return prompt_len / prefill_s, steps / max(decode_s, 1e-9)


def bench_family(family: str, folder: Path, quick: bool) -> dict:
    reference = save_family(family, folder)
    model = LlamaModel(read_checkpoint(folder), weights="fp32")
    events: list[KVEvent] = []
    start = time.perf_counter()
    turns = replay_conversation(_engine(model, events), events)
    replay_s = time.perf_counter() - start
    cfg = model.config
    prompt_len, steps = (128, 8) if quick else (256, 32)
    peer_prefill, peer_decode = transformers_rates(reference, prompt_len, steps)
    return {
        "architecture": cfg.architecture,
        "layer_windows": list(cfg.layer_windows) or None,
        "releases_behind_window": cfg.max_window is not None,
        # fp32 KV, as the transformers peer keeps it.
        "prefill_tok_s": prefill_rate(model, prompt_len, 2, kv_cache_dtype="float32"),
        "decode_tok_s": decode_rate(model, 1, steps, kv_cache_dtype="float32"),
        "transformers_prefill_tok_s": peer_prefill,
        "transformers_decode_tok_s": peer_decode,
        "prefix_hit_rate": hit_rate(turns),
        "router_agrees": all(t.cached_tokens == t.router_cached_tokens for t in turns),
        "replay_s": replay_s,
        "turns": [t.__dict__ for t in turns],
    }


def run(families: list[str] | None = None, quick: bool = False) -> dict:
    chosen = families or list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown} (known: {', '.join(FAMILIES)})")
    with tempfile.TemporaryDirectory() as tmp:
        results = {f: bench_family(f, Path(tmp) / f, quick) for f in chosen}
    return {
        "conversation": {
            "system_tokens": SYSTEM_TOKENS,
            "user_tokens_per_turn": USER_TOKENS,
            "reply_tokens_per_turn": REPLY_TOKENS,
            "turns": TURNS,
            "block_size": BLOCK_SIZE,
        },
        "required_prefix_hit_rate": 0.9,
        "families": results,
    }


def table_rows(result: dict) -> list[tuple[str, object, object, object]]:
    """Per family: ours beside transformers' speed, and the hit rate beside its 0.9 bar."""
    rows: list[tuple[str, object, object, object]] = []
    need = result["required_prefix_hit_rate"]
    for family, r in result["families"].items():
        for kind in ("prefill", "decode"):
            ours, peer = r[f"{kind}_tok_s"], r[f"transformers_{kind}_tok_s"]
            rows.append((f"{family} {kind} tok/s", ours, peer, ours / peer))
        rate = r["prefix_hit_rate"]
        rows.append((f"{family} prefix_hit_rate", rate, need, rate / need))
        rows.append((f"{family} router agrees", r["router_agrees"], True, None))
    return rows
