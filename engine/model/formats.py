"""Which format each path runs in on this machine, chosen by measuring, not by rule.

A format's speed depends on the CPU: without native bf16, torch's bf16 GEMMs run several times
slower than fp32; the native step wins decode where bytes bound the step, and MKL's fp32 GEMM
wins long prompt chunks. So `weights: auto` times every eligible format (those with a passing
quality report) for the shapes each path runs — a prompt chunk for prefill, batch-1 and
batch-8 decode steps for decode — and picks the fastest per path. Timings are taken on a
two-layer slice of the real model and scaled to its depth; the choice is cached per hardware
signature, thread count and model, so a restart does not measure again, and a new machine does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.kvcache.pool import KVPool
from engine.model.gguf_file import Checkpoint
from engine.model.llama import NATIVE_FORMATS, LlamaModel, ModelFormat, NativeUnavailable
from kernels.attention_metadata import AttentionMetadata
from kernels.native.build import cache_dir as native_cache_dir
from kernels.native.build import cpu_signature
from kernels.native.build import source_digest as native_source_digest

log = logging.getLogger(__name__)

# What a replica config may ask for: one format for both paths, or `auto` (measured).
SERVING_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "native", "native-a8", "auto")
CHOOSER_VERSION = 4  # bump when what is measured changes, so old cached choices are redone
# Prompt chunks timed: a conversation turn's new tokens (the prefix is cached) and a fresh
# prompt's chunk. The prompt path's figure is the mean per-token cost of the two, so a format
# fast only for long chunks does not win the short turns a person mostly waits on.
PREFILL_CHUNKS = (32, 128)
DECODE_CONTEXT = 256
DECODE_BATCHES = (1, 8)
SLICE_LAYERS = 2
# The prompt path takes the decode path's native build when that is at most this much slower
# than the fastest prompt format: a second copy of the weights is not worth a few percent.
ONE_COPY_MARGIN = 1.10


@dataclass(frozen=True)
class FormatChoice:
    prefill: ModelFormat
    decode: ModelFormat
    # format -> {"prefill_ms_per_token", "decode_b1_ms", "decode_b8_ms"} for the whole model
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    cached: bool = False
    skipped: dict[str, str] = field(default_factory=dict)  # format -> why it was not timed

    def describe(self) -> str:
        rows = ", ".join(
            f"{fmt}: prefill {t['prefill_ms_per_token']:.2f} ms/token, decode b1 "
            f"{t['decode_b1_ms']:.1f} ms, b8 {t['decode_b8_ms']:.1f} ms"
            for fmt, t in sorted(self.timings.items())
        )
        skipped = "; ".join(f"{f} skipped ({why})" for f, why in self.skipped.items())
        source = "cached measurement" if self.cached else "measured now"
        return f"prefill={self.prefill} decode={self.decode} ({source}: {rows})" + (
            f"; {skipped}" if skipped else ""
        )

    def to_json(self) -> dict:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "timings": self.timings,
            "skipped": self.skipped,
        }


def _slice(checkpoint: Checkpoint) -> Checkpoint:
    cfg = checkpoint.config
    layers = min(SLICE_LAYERS, cfg.num_layers)
    # Per-layer switches are cut with the layers (a slice of Gemma keeps a sliding layer).
    moe = cfg.moe and dataclasses.replace(cfg.moe, sparse_layers=cfg.moe.sparse_layers[:layers])
    # The timed calls run to DECODE_CONTEXT + a chunk whatever the model's window: a model
    # with a shorter one is timed on rotary tables long enough for them (the cost per token
    # does not depend on the position).
    positions = max(cfg.max_position, max(PREFILL_CHUNKS) + DECODE_CONTEXT + 1)
    config = dataclasses.replace(
        cfg,
        num_layers=layers,
        layer_windows=cfg.layer_windows[:layers],
        moe=moe,
        max_position=positions,
    )
    return dataclasses.replace(checkpoint, config=config)


def best_seconds(fn, repeats: int = 3) -> float:
    fn()  # warm: first calls allocate and (for the native step) start threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# Every format is timed once per round, rounds after each other, and keeps its best: a burst
# of other work on a shared machine then slows one round of every format, not every call of
# one format (a choice measured while a neighbour compiled picked int8 over native-a8 once).
ROUNDS = 3


class _FormatTimer:
    """One format's model on the slice, and the calls whose durations decide the choice."""

    def __init__(
        self, checkpoint: Checkpoint, fmt: ModelFormat, scale: float, kv_dtype: torch.dtype
    ):
        model = LlamaModel(checkpoint, weights=fmt)
        self.scale = scale
        cfg = checkpoint.config
        blocks = (max(PREFILL_CHUNKS) + DECODE_CONTEXT) // 16 + 2
        pool = KVPool(model.kv_layout(16, kv_dtype), blocks * max(DECODE_BATCHES))
        rng = np.random.default_rng(0)
        table = list(range(blocks))

        def prefill(chunk: int):
            def run() -> None:
                ids = torch.from_numpy(rng.integers(100, cfg.vocab_size - 100, chunk))
                if model.native is not None and model.prefill_native:
                    model.native.forward(
                        ids.numpy().astype(np.int64),
                        np.arange(chunk, dtype=np.int32),
                        np.asarray([table] * chunk, dtype=np.int32),
                        pool.tensor,
                        16,
                    )
                else:
                    meta = AttentionMetadata([chunk], [chunk], [table], 16)
                    model.forward(ids, meta, pool)

            return run

        def decode(batch: int):
            tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]

            def step() -> None:
                ids = torch.full((batch,), 200, dtype=torch.long)
                if model.decode_native:
                    assert model.native is not None
                    model.native.forward(
                        ids.numpy(),
                        np.full(batch, DECODE_CONTEXT, dtype=np.int32),
                        np.asarray(tables, dtype=np.int32),
                        pool.tensor,
                        16,
                    )
                else:
                    meta = AttentionMetadata([1] * batch, [DECODE_CONTEXT + 1] * batch, tables, 16)
                    model.forward(ids, meta, pool)

            return step

        head_in = torch.randn(max(DECODE_BATCHES), cfg.hidden_size)
        # name -> (call, seconds scaled to the whole model's depth per unit)
        self.calls: dict[str, tuple] = {}
        for chunk in PREFILL_CHUNKS:
            self.calls[f"prefill_{chunk}"] = (prefill(chunk), scale / chunk)
        for batch in DECODE_BATCHES:
            self.calls[f"body_b{batch}"] = (decode(batch), scale)
            self.calls[f"head_b{batch}"] = (
                lambda b=batch: model.logits(head_in[:b], decode=True),
                1.0,
            )
        for fn, _ in self.calls.values():
            fn()  # warm: first calls allocate and (for the native step) start threads
        self.best = {name: float("inf") for name in self.calls}

    def time_round(self) -> None:
        for name, (fn, _) in self.calls.items():
            start = time.perf_counter()
            fn()
            self.best[name] = min(self.best[name], time.perf_counter() - start)

    def result(self) -> dict[str, float]:
        ms = {name: self.best[name] * unit * 1e3 for name, (_, unit) in self.calls.items()}
        out = {f"prefill_{c}_ms_per_token": ms[f"prefill_{c}"] for c in PREFILL_CHUNKS}
        out["prefill_ms_per_token"] = sum(out.values()) / len(PREFILL_CHUNKS)
        for batch in DECODE_BATCHES:
            out[f"decode_b{batch}_ms"] = ms[f"body_b{batch}"] + ms[f"head_b{batch}"]
        return out


def measure(
    checkpoint: Checkpoint, eligible: Sequence[str], kv_dtype: torch.dtype = torch.float32
) -> FormatChoice:
    small = _slice(checkpoint)
    scale = checkpoint.config.num_layers / small.config.num_layers
    timers: dict[str, _FormatTimer] = {}
    skipped: dict[str, str] = {}
    for fmt in eligible:
        try:
            timers[fmt] = _FormatTimer(small, fmt, scale, kv_dtype)  # type: ignore[arg-type]
        except NativeUnavailable as exc:
            skipped[fmt] = str(exc)
    if not timers:
        raise RuntimeError(f"no weight format could be measured: {skipped}")
    for _ in range(ROUNDS):
        for timer in timers.values():
            timer.time_round()
    timings = {fmt: timer.result() for fmt, timer in timers.items()}
    prefill, decode = pick(timings)
    return FormatChoice(prefill, decode, timings, False, skipped)


def pick(timings: dict[str, dict[str, float]]) -> tuple[ModelFormat, ModelFormat]:
    """The fastest format per path; ties go to the earlier name, so the choice is a function
    of the timings alone."""
    names = sorted(timings)
    prefill = min(names, key=lambda f: timings[f]["prefill_ms_per_token"])
    # One decode format for every batch size (switching by batch would make a sequence's
    # numerics depend on its batch-mates): the best mean of per-token costs over the buckets.
    decode = min(
        names, key=lambda f: sum(timings[f][f"decode_b{b}_ms"] / b for b in DECODE_BATCHES)
    )
    if (
        decode in NATIVE_FORMATS
        and prefill != decode
        and timings[decode]["prefill_ms_per_token"]
        <= ONE_COPY_MARGIN * timings[prefill]["prefill_ms_per_token"]
    ):
        # Nearly as fast for prompts: one copy of the weights serves both paths (the other
        # copy is most of a worker's memory, which sets how many replicas a machine holds).
        prefill = decode
    if prefill in NATIVE_FORMATS and decode in NATIVE_FORMATS and prefill != decode:
        # A model holds one native build: the prompt path takes the fastest of the others.
        prefill = min(
            (f for f in names if f not in NATIVE_FORMATS or f == decode),
            key=lambda f: timings[f]["prefill_ms_per_token"],
        )
    return prefill, decode  # type: ignore[return-value]


def _cache_path(
    model_key: str, eligible: Sequence[str], threads: int, kv_dtype: torch.dtype
) -> Path:
    import hashlib

    # The kernel's source is part of the key: a faster native step must be measured anew.
    kernel = native_source_digest()
    # So is how OpenMP threads wait between torch ops: bf16 prompt chunks measured 1.5x faster
    # with spinning threads than with the PASSIVE policy the serving processes use.
    omp = f"{os.environ.get('OMP_WAIT_POLICY', '')},{os.environ.get('GOMP_SPINCOUNT', '')}"
    # And the native build's flags where they are forced (e.g. the AVX2 build on an AVX-512
    # machine): its kernels are other kernels, timed apart.
    native_flags = os.environ.get("SPLITSERVE_NATIVE_CFLAGS", "")
    key = "|".join(
        [
            str(CHOOSER_VERSION),
            cpu_signature(),
            str(threads),
            model_key,
            ",".join(eligible),
            kernel,
            omp,
            native_flags,
            str(kv_dtype),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return native_cache_dir().parent / "formats" / f"choice-{digest}.json"


def choose(
    checkpoint: Checkpoint,
    eligible: Sequence[str],
    model_key: str,
    threads: int | None = None,
    kv_dtype: torch.dtype = torch.float32,
) -> FormatChoice:
    """The cached choice for this machine, threads, model and KV element type (the cache it
    serves from, as attention reads it), or a fresh measurement."""
    threads = threads or torch.get_num_threads()
    path = _cache_path(model_key, eligible, threads, kv_dtype)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            return FormatChoice(
                data["prefill"], data["decode"], data["timings"], True, data.get("skipped", {})
            )
        except (OSError, ValueError, KeyError) as exc:
            log.warning("ignoring unreadable format choice %s: %s", path, exc)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        choice = measure(checkpoint, eligible, kv_dtype)
    finally:
        torch.set_num_threads(previous)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choice.to_json(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home still serves; it measures again next start
        log.warning("cannot cache the format choice at %s: %s", path, exc)
    return choice
