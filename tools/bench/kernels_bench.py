"""`splitserve bench kernels`: each Triton kernel's GB/s and TFLOP/s beside the device's limits,
the split-KV verify speedup over the unsplit kernel, and a decode step with either attention kernel.

On a CUDA device: Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16,
16-token blocks in a block-major pool with shuffled block tables). Every kernel is first checked
against the torch reference on the same inputs, so no figure comes from a wrong kernel. Limits:
the spec-sheet HBM bandwidth and dense bf16 rate of the named device, and a device-to-device
copy measured in the same run. Without CUDA it says so and times the torch reference path on
small versions of the same shapes, so the command runs (and is tested) anywhere.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention_kernel import write_kv
from kernels.attention_metadata import AttentionMetadata
from kernels.torch_attention import TorchPagedAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
VERIFY_QUERIES = 8
SPLIT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
SPLIT_BATCHES = (1, 8)

# Spec-sheet HBM GB/s and dense bf16 TFLOP/s; first substring match of the device name wins.
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("B200", 8000.0, 2250.0),
    ("H200", 4800.0, 989.0),
    ("GH200", 4000.0, 989.0),
    ("H100 NVL", 3900.0, 835.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.0),
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100 80GB PCIe", 1935.0, 312.0),
    ("A100", 1555.0, 312.0),
    ("L40S", 864.0, 362.0),
    ("L4", 300.0, 121.0),
    ("A10", 600.0, 125.0),
    ("RTX 4090", 1008.0, 165.0),
)


def device_peaks(name: str) -> tuple[float | None, float | None]:
    for key, gb_s, tflops in DEVICE_PEAKS:
        if key in name:
            return gb_s, tflops
    return None, None


@dataclass
class Case:
    """One attention workload on a block-major pool, with what it must read and compute."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pool: torch.Tensor  # [blocks, layers=2, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata

    @property
    def key_cache(self) -> torch.Tensor:
        return self.pool[:, 1, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[:, 1, 1]

    @property
    def bytes_moved(self) -> int:
        kv = sum(self.meta.context_lens) * 2 * KV_HEADS * HEAD_DIM * self.pool.element_size()
        return kv + 2 * self.q.numel() * self.q.element_size()  # + queries in, output out

    @property
    def flops(self) -> int:
        visible = sum(
            (ctx - q_len + 1 + ctx) * q_len // 2
            for q_len, ctx in zip(self.meta.query_lens, self.meta.context_lens, strict=True)
        )
        return 4 * HEADS * HEAD_DIM * visible  # QK^T and PV, a multiply-add each


def make_case(
    query_lens: list[int], context_lens: list[int], device: torch.device, dtype: torch.dtype
) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(0)
    per_seq = [(ctx + BLOCK_SIZE - 1) // BLOCK_SIZE for ctx in context_lens]
    order = torch.randperm(sum(per_seq), generator=gen).tolist()
    tables, used = [], 0
    for n in per_seq:
        tables.append(order[used : used + n])
        used += n
    pool = torch.randn((sum(per_seq), 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM), device=device)
    pool = pool.to(dtype)
    meta = AttentionMetadata(query_lens, context_lens, tables, BLOCK_SIZE, device=device)
    # The step's "new" K/V are the values already in their slots: writing them is a no-op, so
    # every timed repetition (and the torch check) sees the same cache.
    k = pool[:, 1, 0][meta.slot_blocks, meta.slot_offsets].contiguous()
    v = pool[:, 1, 1][meta.slot_blocks, meta.slot_offsets].contiguous()
    q = torch.randn((sum(query_lens), HEADS, HEAD_DIM), device=device).to(dtype)
    return Case(q=q, k=k, v=v, pool=pool, meta=meta)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_copy_gb_s(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written (what a kernel moves)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup=2, reps=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _figures(case: Case, ms: float, nbytes: int | None = None) -> dict:
    moved = case.bytes_moved if nbytes is None else nbytes
    return {
        "ms": ms,
        "gb_s": moved / (ms * 1e-3) / 1e9,
        "tflops": case.flops / (ms * 1e-3) / 1e12,
    }


def _workloads() -> dict[str, tuple[list[int], list[int]]]:
    return {
        "decode_b32_ctx4k": ([1] * 32, [4096] * 32),
        "verify_b8_q8_ctx4k": ([VERIFY_QUERIES] * 8, [4096] * 8),
        "prefill_chunk2k_after6k": ([2048], [8192]),
        "write_kv_4k_tokens": ([512] * 8, [512] * 8),
    }


def _run_gpu(device: torch.device, quick: bool) -> dict:
    from kernels.triton_split_kv import device_sm_count

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    peak_gb_s, peak_tflops = device_peaks(name)
    sms = device_sm_count(device)
    reps = 5 if quick else 20
    return {
        "device": name,
        "sms": sms,
        "spec_hbm_gb_s": peak_gb_s,
        "spec_bf16_tflops": peak_tflops,
        "measured_copy_gb_s": measure_copy_gb_s(device),
        "kernels": _kernel_figures(device, sms, reps),
        "split_kv_verify": _split_speedups(device, sms, reps, quick),
        "decode_step": _decode_step(device, quick),
    }


def _kernel_figures(device: torch.device, sms: int, reps: int) -> dict:
    """Each kernel alone on its workload, after checking its output against the torch path."""
    from kernels.triton_attention import plan_step
    from kernels.triton_kv_write import write_kv_slots
    from kernels.triton_prefill import chunked_prefill_attention
    from kernels.triton_split_kv import choose_num_splits, split_kv_attention

    scale = HEAD_DIM**-0.5
    figures = {}
    for label, (query_lens, contexts) in _workloads().items():
        case = make_case(query_lens, contexts, device, torch.bfloat16)
        caches = (case.key_cache, case.value_cache)
        if label.startswith("write_kv"):
            slots = (case.meta.slot_blocks, case.meta.slot_offsets)
            kernel = functools.partial(write_kv_slots, case.k, case.v, *caches, *slots)
            ms = median_ms(kernel, device, 3, reps)
            # K and V, each read from the step's tensor and written to the pool.
            figures[label] = _figures(case, ms, 4 * case.k.numel() * case.k.element_size())
            continue
        step = plan_step(case.meta)
        out = torch.empty_like(case.q)
        if step.prefill is not None:
            kernel = functools.partial(
                chunked_prefill_attention, case.q, *caches, out, step.prefill, scale
            )
        else:
            paged = step.decode or step.verify
            splits = choose_num_splits(paged.num_seqs, KV_HEADS, paged.max_context_len, sms)
            kernel = functools.partial(
                split_kv_attention, case.q, *caches, out, paged, scale, splits
            )
        kernel()
        # The torch path attends in fp32 (it upcasts the gathered K/V), so its queries are too.
        expected = TorchPagedAttention().forward(
            case.q.float(), case.k, case.v, *caches, case.meta, scale
        )
        figures[label] = _figures(case, median_ms(kernel, device, 3, reps))
        figures[label]["max_abs_err_vs_torch"] = (out.float() - expected).abs().max().item()
    return figures


def _split_speedups(device: torch.device, sms: int, reps: int, quick: bool) -> dict:
    """Verify at VERIFY_QUERIES queries: the split-KV path against the unsplit kernel."""
    from kernels.triton_attention import plan_step
    from kernels.triton_split_kv import choose_num_splits, split_kv_attention

    speedups = {}
    for batch in SPLIT_BATCHES:
        for ctx in SPLIT_CONTEXTS[:3] if quick else SPLIT_CONTEXTS:
            case = make_case([VERIFY_QUERIES] * batch, [ctx] * batch, device, torch.bfloat16)
            out = torch.empty_like(case.q)
            paged = plan_step(case.meta).verify
            splits = choose_num_splits(batch, KV_HEADS, ctx, sms)
            run = functools.partial(
                split_kv_attention, case.q, case.key_cache, case.value_cache, out, paged,
                HEAD_DIM**-0.5,
            )  # fmt: skip
            unsplit_ms = median_ms(functools.partial(run, 1), device, 3, reps)
            split_ms = median_ms(functools.partial(run, splits), device, 3, reps)
            speedups[f"b{batch}_ctx{ctx}"] = {
                "num_splits": splits,
                "unsplit_ms": unsplit_ms,
                "split_ms": split_ms,
                "speedup": unsplit_ms / split_ms,
                "split_gb_s": _figures(case, split_ms)["gb_s"],
                "unsplit_gb_s": _figures(case, unsplit_ms)["gb_s"],
            }
    return speedups


def _decode_step(device: torch.device, quick: bool, batch: int = 8, ctx: int = 2048) -> dict:
    """One SmolLM2 decode step (the engine's fp32 KV pool), torch vs Triton attention kernel."""
    try:
        from engine.kvcache.pool import KVPool
        from engine.model.llama import LlamaModel
        from engine.model.loader import read_checkpoint
        from kernels.triton_attention import TritonPagedAttention

        checkpoint = read_checkpoint()
        per_seq = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        ids = torch.randint(0, checkpoint.config.vocab_size, (batch,), device=device)
        timings = {}
        for name, kernel in (("torch", TorchPagedAttention()), ("triton", TritonPagedAttention())):
            model = LlamaModel(checkpoint, weights="bf16", device=device, attention=kernel)
            pool = KVPool(model.kv_layout(BLOCK_SIZE), batch * per_seq, device=device)
            pool.tensor.normal_()
            meta = AttentionMetadata([1] * batch, [ctx] * batch, tables, BLOCK_SIZE, device=device)
            step = functools.partial(model.forward, ids, meta, pool)
            timings[f"{name}_ms"] = median_ms(step, device, 3, 5 if quick else 20)
        timings["speedup"] = timings["torch_ms"] / timings["triton_ms"]
        return timings
    except Exception as exc:  # the kernel figures above stand on their own
        return {"error": f"{type(exc).__name__}: {exc}"}


def _run_cpu_reference(quick: bool) -> dict:
    """The torch path's timings on small versions of the same workloads (no Triton on CPU)."""
    from tools.bench.hardware import measure_read_bandwidth_gb_s

    small = {
        "decode_b4_ctx1k": ([1] * 4, [1024] * 4),
        "verify_b4_q8_ctx1k": ([VERIFY_QUERIES] * 4, [1024] * 4),
        "prefill_chunk256_after256": ([256], [512]),
        "write_kv_256_tokens": ([64] * 4, [64] * 4),
    }
    cpu = torch.device("cpu")
    kernel = TorchPagedAttention()
    timings = {}
    reps = 3 if quick else 10
    for label, (query_lens, contexts) in small.items():
        case = make_case(query_lens, contexts, cpu, torch.float32)
        args = (case.k, case.v, case.key_cache, case.value_cache, case.meta)
        if label.startswith("write_kv"):
            ms = median_ms(functools.partial(write_kv, *args), cpu, 1, reps)
            timings[label] = _figures(case, ms, 4 * case.k.numel() * case.k.element_size())
            continue
        kernel.prepare(case.meta)
        run = functools.partial(kernel.forward, case.q, *args, HEAD_DIM**-0.5)
        timings[label] = _figures(case, median_ms(run, cpu, 1, reps))
    read_gb_s = measure_read_bandwidth_gb_s((64 if quick else 256) << 20)
    return {"read_gb_s": read_gb_s, "torch_reference": timings}


def run(quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        return {"cuda": False, "cpu": _run_cpu_reference(quick)}
    return {"cuda": True, **_run_gpu(torch.device("cuda"), quick)}


def table_rows(result: dict) -> list[tuple[str, object, object, object]]:
    if not result["cuda"]:
        limit = result["cpu"]["read_gb_s"]
        return [
            (f"{label} GB/s", f["gb_s"], limit, f["gb_s"] / limit)
            for label, f in result["cpu"]["torch_reference"].items()
        ]
    hbm, tflops = result["spec_hbm_gb_s"], result["spec_bf16_tflops"]
    copy = result["measured_copy_gb_s"]
    rows: list[tuple[str, object, object, object]] = [
        ("d2d copy GB/s", copy, hbm, _ratio(copy, hbm))
    ]
    for label, f in result["kernels"].items():
        rows.append((f"{label} GB/s", f["gb_s"], hbm, _ratio(f["gb_s"], hbm)))
        rows.append((f"{label} TFLOP/s", f["tflops"], tflops, _ratio(f["tflops"], tflops)))
    for label, f in result["split_kv_verify"].items():
        rows.append((f"verify {label} split x{f['num_splits']} ms", f["split_ms"],
                     f["unsplit_ms"], f["speedup"]))  # fmt: skip
    step = result["decode_step"]
    if "error" in step:
        rows.append(("decode step", step["error"], None, None))
    else:
        rows.append(("decode step triton ms", step["triton_ms"], step["torch_ms"], step["speedup"]))
    return rows


def _ratio(ours: float, limit: float | None) -> float | None:
    return ours / limit if limit else None
