"""`splitserve profile`: measure one replica on this machine and fit the simulator's models."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from services.planner.replica_profile import ReplicaProfile
from shared.config import engine_defaults as defaults
from tools.profiler.fit import fit_decode, fit_prefill, fit_transfer
from tools.profiler.measure import measure_decode, measure_prefill, measure_transfer
from tools.profiler.model_shape import ModelShape
from tools.profiler.signature import cpu_here


@dataclass(frozen=True)
class Grid:
    prefill_lengths: tuple[int, ...]
    cached_fractions: tuple[float, ...]
    prefill_repeats: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int
    transfer_mib: tuple[int, ...]
    transfer_repeats: int


FULL = Grid(
    prefill_lengths=(128, 256, 512, 1024, 2048),
    cached_fractions=(0.0, 0.5, 0.9),
    prefill_repeats=3,
    decode_batches=(1, 4, 8, 16, 32),
    decode_contexts=(256, 1024, 2048),
    decode_steps=5,
    transfer_mib=(1, 4, 16, 64),
    transfer_repeats=3,
)
# Under a minute with the model load: fewer points, each measured once.
QUICK = Grid(
    prefill_lengths=(128, 512, 1024),
    cached_fractions=(0.0, 0.5, 0.9),
    prefill_repeats=1,
    decode_batches=(1, 8, 32),
    decode_contexts=(256, 1024),
    decode_steps=3,
    # 64 MiB, not 16: a 16 MiB shm push takes about as long as the control plane's noise on
    # a busy machine, and a fit through two such points can come out with no bandwidth.
    transfer_mib=(1, 64),
    transfer_repeats=3,
)


def _stderr(message: str) -> None:
    print(f"[profile] {message}", file=sys.stderr, flush=True)


def run_profile(
    weights: str = "bf16",
    model_path: str | None = None,
    threads: int = 1,
    quick: bool = False,
    # What `splitserve up` gives a replica unless configured otherwise.
    kv_cache_bytes: int = defaults.KV_CACHE_BYTES,
    chunk_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS,
    kv_cache_dtype: str = defaults.KV_CACHE_DTYPE,
    progress: Callable[[str], None] = _stderr,
) -> ReplicaProfile:
    import torch

    from engine.core.config import EngineConfig
    from engine.core.engine import Engine
    from engine.core.model_setup import load_serving_model
    from engine.kvcache.kv_dtype import resolve_kv_dtype
    from engine.model.llama import LlamaModel
    from engine.model.loader import read_checkpoint
    from shared.modelfile.default import default_model_path
    from tools.bench.report import machine_info

    grid = QUICK if quick else FULL
    started = time.perf_counter()
    load_before = os.getloadavg()
    torch.set_num_threads(threads)
    source = model_path or default_model_path()
    # The KV element type a replica serves with (`auto`: fp16 where this CPU converts it).
    kv_dtype, _ = resolve_kv_dtype(kv_cache_dtype)
    if weights == "auto":
        # What a replica serves: the formats measured fastest on this machine for each path
        # over the pool it serves from (the choice differs with the KV type: a profile timed
        # on the fp32 pool's choice once measured bf16 prompts the replicas never ran).
        model, _ = load_serving_model(source, "auto", threads=threads, kv_dtype=kv_dtype)
        timed = f"auto: prefill={model.weights} decode={model.decode_weights}"
    else:
        model = LlamaModel(read_checkpoint(source), weights=weights)  # type: ignore[arg-type]
        timed = weights
    shape = ModelShape.from_config(model.config, Path(source).stem)
    progress(f"model {source} loaded ({timed}, {threads} threads)")
    kv_name = str(kv_dtype).removeprefix("torch.")
    layout = model.kv_layout(16, kv_dtype)
    kv_bytes_per_token = layout.block_bytes // layout.block_size
    # One engine for every measurement, sized for the largest decode batch.
    room = max(grid.decode_batches) * (max(grid.decode_contexts) + 64) + 4 * max(
        grid.prefill_lengths
    )
    engine = Engine(
        EngineConfig(
            weights=weights,
            kv_cache_bytes=room * kv_bytes_per_token,
            max_num_seqs=max(64, max(grid.decode_batches)),
            max_num_batched_tokens=chunk_tokens,
            num_threads=threads,
            kv_cache_dtype=kv_name,  # type: ignore[arg-type]
        ),
        model=model,
    )
    prefill_points = measure_prefill(
        engine, grid.prefill_lengths, grid.cached_fractions, grid.prefill_repeats, progress
    )
    decode_points = measure_decode(
        engine, grid.decode_batches, grid.decode_contexts, grid.decode_steps, progress
    )
    transfer_points = measure_transfer(grid.transfer_mib, grid.transfer_repeats, progress)
    prefill, prefill_err = fit_prefill(prefill_points, chunk_tokens)
    decode, decode_err = fit_decode(decode_points)
    transfer, transfer_err = fit_transfer(transfer_points)
    meta = {
        "kind": "measured",
        "signature": cpu_here(threads, timed, shape, kv_name).to_dict(),
        "kv_cache_dtype": kv_name,
        "model": source,
        "weights": weights,
        "threads": threads,
        "quick": quick,
        "machine": machine_info(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "fit_max_rel_error": {
            "prefill": prefill_err,
            "decode": decode_err,
            "transfer": transfer_err,
        },
        "transfer_backend": "shm",
    }
    profile = ReplicaProfile(
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        chunk_tokens=chunk_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        max_context=model.config.max_position,
        kv_capacity_tokens=kv_cache_bytes // kv_bytes_per_token,
        meta=meta,
        measurements={
            "prefill": [asdict(p) for p in prefill_points],
            "decode": [asdict(p) for p in decode_points],
            "transfer": [asdict(p) for p in transfer_points],
        },
    )
    profile.check()
    progress(
        f"done in {meta['seconds']:.0f} s; fit max relative error: prefill {prefill_err:.1%}, "
        f"decode {decode_err:.1%}, transfer {transfer_err:.1%}"
    )
    return profile
