"""`splitserve profile --analytic --gpu NAME`: a replica of N GPUs, from their datasheets.

No GPU measurement of this engine exists yet, so the efficiency factors are stated, not
fitted: decode at 75% of peak bandwidth (the 70-85% band well-optimized CUDA engines such as
vLLM and TensorRT-LLM are reported to reach: open-source-ai.tech glossary, "model bandwidth
utilization"), prefill at 50% of peak tensor FLOP/s, 0.5 ms of scheduling per step. They are
in the profile's `meta.analytic` and change with `--compute-efficiency` / `--memory-efficiency`.
"""

from __future__ import annotations

from services.planner.replica_profile import ProfileError, ReplicaProfile, TransferModel
from tools.profiler.analytic import GPU_GRID, AnalyticModel, Efficiency, Machine, build_profile
from tools.profiler.hardware_specs import GPUS, LINKS, link_gb_s
from tools.profiler.model_shape import ModelShape
from tools.profiler.roofline import Precision, kv_bytes_per_token, model_params
from tools.profiler.signature import HardwareSignature

# Bytes per weight, and tensor FLOP/s relative to bf16: fp8 tensor cores run at twice the
# bf16 rate (every datasheet in hardware_specs); 4-bit weights are dequantized into bf16 GEMMs.
WEIGHT_FORMATS: dict[str, tuple[float, float]] = {
    "bf16": (2.0, 1.0),
    "fp8": (1.0, 2.0),
    "int4": (0.5, 1.0),
}
NO_FP8 = ("a100",)  # Ampere has no fp8 tensor cores (A100 datasheet)
DEFAULT_COMPUTE = 0.5
DEFAULT_MEMORY = 0.75
STEP_MS = 0.5
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default `gpu_memory_utilization`: weights + KV share
ALLREDUCE_LATENCY_MS = 0.01  # per all-reduce on NVLink at decode sizes (assumed)
CHUNK_TOKENS = 8192  # a GPU engine's prefill token budget per step (vLLM's default for serving)
EFFICIENCY_SOURCE = (
    "assumed (no GPU measurement of this engine yet): memory 0.75 from the 70-85% MBU band "
    "of vLLM/TensorRT-LLM (open-source-ai.tech glossary), compute 0.5, 0.5 ms per step"
)


def weight_bytes(shape: ModelShape, precision: Precision) -> float:
    return model_params(shape) * precision.weight_bytes


def gpu_profile(
    shape: ModelShape,
    gpu_key: str,
    weights: str = "bf16",
    tp: int = 1,
    link: str = "ib400",
    compute_efficiency: float = DEFAULT_COMPUTE,
    memory_efficiency: float = DEFAULT_MEMORY,
    chunk_tokens: int = CHUNK_TOKENS,
) -> ReplicaProfile:
    if gpu_key not in GPUS:
        raise ProfileError(f"unknown GPU {gpu_key!r}; known: {', '.join(GPUS)}")
    if weights not in WEIGHT_FORMATS:
        raise ProfileError(f"--weights {weights!r}: choose from {', '.join(WEIGHT_FORMATS)}")
    if weights == "fp8" and gpu_key in NO_FP8:
        raise ProfileError(f"{gpu_key} has no fp8 tensor cores; use bf16 or int4")
    if link not in LINKS:
        raise ProfileError(f"unknown interconnect {link!r}; known: {', '.join(LINKS)}")
    if tp < 1 or shape.num_heads % tp:
        raise ProfileError(f"--tp {tp} must divide the model's {shape.num_heads} heads")
    gpu = GPUS[gpu_key]
    per_weight, speedup = WEIGHT_FORMATS[weights]
    precision = Precision(weight_bytes=per_weight, kv_bytes=2.0)
    machine = Machine(
        name=f"{gpu.name} x{tp}" if tp > 1 else gpu.name,
        device="gpu",
        flops_per_ms=gpu.flops_per_ms * speedup * tp,
        bytes_per_ms=gpu.bytes_per_ms * tp,
        overlap=True,
        tp=tp,
        allreduce_bytes_per_ms=gpu.nvlink_gb_s * 1e6,
        allreduce_latency_ms=ALLREDUCE_LATENCY_MS,
    )
    eff = Efficiency(
        compute_efficiency, memory_efficiency, memory_efficiency, STEP_MS, EFFICIENCY_SOURCE
    )
    model = AnalyticModel(shape, machine, precision, precision, eff, eff, chunk_tokens)
    room = tp * gpu.memory_gb * 1e9 * GPU_MEMORY_UTILIZATION - weight_bytes(shape, precision)
    kvpt = kv_bytes_per_token(shape, precision)
    if room < kvpt * shape.max_position / 8:
        raise ProfileError(
            f"{shape.name} in {weights} does not leave room for KV on {tp} x {gpu.name} "
            f"({weight_bytes(shape, precision) / 1e9:.0f} GB of weights); raise --tp"
        )
    spec = LINKS[link]
    transfer = TransferModel(spec.latency_ms, link_gb_s(spec, gpu, tp))
    signature = HardwareSignature(
        device="gpu",
        processor=gpu.name,
        flags="",
        cores=tp,
        threads=1,
        weights=weights,
        model=shape.name,
        config_hash=shape.config_hash,
    )
    meta = {
        "signature": signature.to_dict(),
        "weights": weights,
        "gpu": gpu_key,
        "gpus_per_replica": tp,
        "interconnect": link,
        "sources": {"gpu": gpu.source, "interconnect": spec.source},
    }
    return build_profile(model, GPU_GRID, transfer, int(room // kvpt), meta)
