"""`splitserve bench engine`: decode and prefill speed of one engine, against the machine's
read bandwidth and against llama.cpp on the same GGUF and thread count (when installed)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from dataclasses import dataclass

import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.model_setup import load_serving_model
from engine.kvcache.kv_dtype import resolve_kv_dtype
from engine.model.llama import LlamaModel
from shared.modelfile.default import default_model_path
from shared.sampling.params import SamplingParams
from tools.bench.hardware import measure_read_bandwidth_gb_s
from tools.process_defaults import OURS_MARKER

CONTEXT = 512
PREFILL_TOKENS = 1024
PREFIX_TOKENS = 2048
# Below this the decode context, the prompts and the cached prefix would be a handful of
# blocks each: the figures would measure the engine's fixed costs, not its speed.
MIN_WINDOW = 128


@dataclass(frozen=True)
class BenchShape:
    """The run's lengths, fitted to the model's context window.

    The defaults (512 tokens of decode context, a 1,024-token prompt, a 2,048-token prompt
    with 1,920 cached) are kept when the window holds them; a smaller window (a tiny test
    model's 1,024, say) shrinks each to what fits, and the JSON says which lengths ran.
    """

    context: int
    prefill_tokens: int
    prefix_tokens: int
    prefix_cached_tokens: int

    @classmethod
    def for_window(cls, window: int, block_size: int) -> BenchShape:
        if window < MIN_WINDOW:
            raise ValueError(
                f"it needs a context window of at least {MIN_WINDOW} tokens; "
                f"this model's is {window}"
            )
        # A prompt must leave room for its one sampled token (and a decode run for its
        # steps), so every length stays a margin below the window.
        margin = max(16, window // 16)
        context = min(CONTEXT, window // 2)
        prefill = min(PREFILL_TOKENS, window - margin)
        prefix = min(PREFIX_TOKENS, window - margin)
        cached = prefix * 15 // 16 // block_size * block_size  # 1,920 of 2,048 by default
        return cls(context, prefill, prefix, cached)


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    # Away from the ids a tokenizer keeps for specials at either end, where the vocab has room.
    edge = min(100, vocab // 4)
    return [rng.randrange(edge, vocab - edge) for _ in range(length)]


def _engine(model: LlamaModel, kv_cache_dtype: str = "auto", **overrides) -> Engine:
    cfg = {"kv_cache_bytes": 1 << 30, "max_num_seqs": 64, "kv_cache_dtype": kv_cache_dtype}
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), model=model)


def decode_rate(
    model: LlamaModel,
    batch: int,
    steps: int,
    kv_cache_dtype: str = "auto",
    context: int | None = None,
) -> float:
    """Steady-state tokens/s with `batch` sequences decoding at ~`context` tokens of context
    (CONTEXT unless given)."""
    context = context or CONTEXT
    # Every prompt is in before the first decode (no chunk cap while decoding): otherwise the
    # early sequences finish while the late ones still prefill, and fewer than `batch` decode.
    engine = _engine(model, kv_cache_dtype, chunk_tokens_while_decoding=None)
    # The first sequences decode while the later prompts are prefilled (a step's budget holds
    # about one prompt): their budget covers those steps too, so all `batch` decode throughout.
    prefill_steps = batch * -(-context // engine.config.max_num_batched_tokens)
    params = SamplingParams(
        temperature=0.0, max_tokens=steps + 16 + 2 * prefill_steps, ignore_eos=True
    )
    vocab = model.config.vocab_size
    for i in range(batch):
        engine.add_request(_prompt(context, 1000 + i, vocab), params)
    seqs = list(engine.sequences.values())
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    for _ in range(2):  # settle: every sequence is now decoding
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    decoding = sum(1 for s in seqs if not s.is_finished)
    if decoding != batch:
        raise RuntimeError(f"only {decoding} of {batch} sequences decoded to the end of the run")
    return batch * steps / elapsed


def time_to_first_token(engine: Engine, prompt: list[int]) -> float:
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    for _ in engine.run_until_done():
        pass
    return time.perf_counter() - start


def prefill_rate(
    model: LlamaModel, length: int = 1024, repeats: int = 2, kv_cache_dtype: str = "auto"
) -> float:
    vocab = model.config.vocab_size
    best = min(
        time_to_first_token(_engine(model, kv_cache_dtype), _prompt(length, 2000 + r, vocab))
        for r in range(repeats)
    )
    return length / best


def prefix_ttft_ratio(
    model: LlamaModel, length: int = 2048, cached: int = 1920, kv_cache_dtype: str = "auto"
) -> dict:
    """TTFT of a prompt whose first `cached` tokens are in the prefix cache, vs uncached."""
    vocab = model.config.vocab_size
    engine = _engine(model, kv_cache_dtype)
    prompt = _prompt(length, 3000, vocab)
    # Same head, different tail.
    warm = prompt[:cached] + _prompt(min(64, length - cached), 3001, vocab)
    time_to_first_token(engine, warm)
    cached_s = time_to_first_token(engine, prompt)
    cold_s = time_to_first_token(_engine(model, kv_cache_dtype), _prompt(length, 3002, vocab))
    return {
        "ttft_cached_ms": cached_s * 1e3,
        "ttft_uncached_ms": cold_s * 1e3,
        "ratio": cached_s / cold_s,
    }


def kv_bytes_read_per_step(model: LlamaModel, context: int, dtype: torch.dtype) -> int:
    c = model.config
    itemsize = torch.empty((), dtype=dtype).element_size()
    return context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize


def llamacpp_peer(model_path: str, threads: int, shape: BenchShape) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=model_path, n_threads=threads, n_ctx=4096, n_batch=512, verbose=False)
    vocab = llm.n_vocab()
    prompt = _prompt(shape.prefill_tokens, 4000, vocab)
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill = shape.prefill_tokens / (time.perf_counter() - start)
    llm.reset()
    llm.eval(_prompt(shape.context, 4001, vocab))
    steps = 64
    start = time.perf_counter()
    token = 200
    for _ in range(steps):
        llm.eval([token])
        token = (token + 7) % vocab
    decode = steps / (time.perf_counter() - start)
    return {"decode_tok_s_b1": decode, "prefill_tok_s_1k": prefill}


def llama_bench_peer(binary: str, model_path: str, threads: int, shape: BenchShape) -> dict:
    """llama.cpp's own benchmark on the same GGUF and threads: the same prompt length as
    ours (pp1024 by default) and tg128, at t/s."""
    pp = str(shape.prefill_tokens)
    cmd = [binary, "-m", model_path, "-t", str(threads), "-p", pp, "-n", "128", "-o", "json"]
    env = dict(os.environ)
    if env.pop(OURS_MARKER, None):
        # Our processes sleep OpenMP threads between ops; llama.cpp's decode (also OpenMP)
        # measured 5x slower that way. The peer gets the environment the user gave us.
        env.pop("OMP_WAIT_POLICY", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
    rows = json.loads(done.stdout)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"decode_tok_s_b1": decode, "prefill_tok_s_1k": prefill, "source": binary}


def run(
    weights: str,
    model_path: str | None,
    threads: int,
    quick: bool = False,
    llama_bench: str | None = None,
    kv_cache_dtype: str = "auto",
) -> dict:
    torch.set_num_threads(threads)
    kv_dtype, kv_why = resolve_kv_dtype(kv_cache_dtype)
    model, choice = load_serving_model(model_path, weights, threads=threads, kv_dtype=kv_dtype)
    checkpoint_source = model_path or default_model_path()
    shape = BenchShape.for_window(model.config.max_position, EngineConfig().block_size)
    mem = measure_read_bandwidth_gb_s()
    steps = {1: 48, 8: 24, 32: 12} if not quick else {1: 6, 8: 3, 32: 2}
    result: dict = {
        "weights": weights,
        "prefill_format": model.weights,
        "decode_format": model.decode_weights,
        "threads": threads,
        "context": shape.context,
        "prefill_prompt_tokens": shape.prefill_tokens,
        "prefix_prompt_tokens": shape.prefix_tokens,
        "prefix_cached_tokens": shape.prefix_cached_tokens,
        "model_context_window": model.config.max_position,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_cache_dtype_reason": kv_why,
    }
    if choice is not None:
        result["format_choice"] = choice.to_json() | {"cached": choice.cached}
    for batch, n in steps.items():
        result[f"decode_tok_s_b{batch}"] = decode_rate(
            model, batch, n, kv_cache_dtype, context=shape.context
        )
    # The key keeps its name for comparisons across runs; `prefill_prompt_tokens` says the
    # length, which is 1,024 unless the model's window is smaller.
    result["prefill_tok_s_1k"] = prefill_rate(
        model, shape.prefill_tokens, repeats=1 if quick else 2, kv_cache_dtype=kv_cache_dtype
    )
    prefix = prefix_ttft_ratio(
        model, shape.prefix_tokens, shape.prefix_cached_tokens, kv_cache_dtype=kv_cache_dtype
    )
    result["prefix_ttft_ratio"] = prefix["ratio"]
    result["prefix_ttft_cached_ms"] = prefix["ttft_cached_ms"]
    result["prefix_ttft_uncached_ms"] = prefix["ttft_uncached_ms"]
    result["mem_read_gb_s"] = mem
    step_bytes = model.weight_bytes_per_token_step + kv_bytes_read_per_step(
        model, shape.context, kv_dtype
    )
    result["decode_bytes_per_step_b1"] = step_bytes
    result["decode_bw_efficiency"] = step_bytes * result["decode_tok_s_b1"] / (mem * 1e9)
    gguf = checkpoint_source.endswith(".gguf")
    if llama_bench and gguf:
        peer = llama_bench_peer(llama_bench, checkpoint_source, threads, shape)
    else:
        peer = llamacpp_peer(checkpoint_source, threads, shape) if gguf else None
    if peer is not None:
        result["peer_llamacpp_decode_tok_s_b1"] = peer["decode_tok_s_b1"]
        result["peer_llamacpp_prefill_tok_s_1k"] = peer["prefill_tok_s_1k"]
        result["decode_b1_vs_llamacpp"] = result["decode_tok_s_b1"] / peer["decode_tok_s_b1"]
        result["prefill_vs_llamacpp"] = result["prefill_tok_s_1k"] / peer["prefill_tok_s_1k"]
        result["decode_b8_vs_llamacpp_b1"] = result["decode_tok_s_b8"] / peer["decode_tok_s_b1"]
        result["decode_b32_vs_llamacpp_b1"] = result["decode_tok_s_b32"] / peer["decode_tok_s_b1"]
        result["peer_source"] = peer.get("source", "llama-cpp-python")
    else:
        result["peer_llamacpp"] = "not installed (pip install '.[peer]')"
    return result


def table_rows(r: dict) -> list[tuple[str, object, object, object]]:
    peer_d = r.get("peer_llamacpp_decode_tok_s_b1")
    peer_p = r.get("peer_llamacpp_prefill_tok_s_1k")
    return [
        ("decode tok/s b1", r["decode_tok_s_b1"], peer_d, r.get("decode_b1_vs_llamacpp")),
        ("decode tok/s b8", r["decode_tok_s_b8"], peer_d, r.get("decode_b8_vs_llamacpp_b1")),
        ("decode tok/s b32", r["decode_tok_s_b32"], peer_d, r.get("decode_b32_vs_llamacpp_b1")),
        (
            f"prefill tok/s ({r['prefill_prompt_tokens']}-token prompt)",
            r["prefill_tok_s_1k"],
            peer_p,
            r.get("prefill_vs_llamacpp"),
        ),
        (
            "decode GB/s b1 vs read bandwidth",
            r["decode_bw_efficiency"] * r["mem_read_gb_s"],
            r["mem_read_gb_s"],
            r["decode_bw_efficiency"],
        ),
        (
            f"TTFT {r['prefix_prompt_tokens']}-token prompt, "
            f"{r['prefix_cached_tokens']} cached (ms)",
            r["prefix_ttft_cached_ms"],
            r["prefix_ttft_uncached_ms"],
            r["prefix_ttft_ratio"],
        ),
    ]
