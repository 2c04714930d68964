"""KV-transfer throughput between two real OS processes on this host, next to memcpy.

For each backend a prefill and a decode agent run in two spawned processes; the prefill
side times ``send`` to DONE (so connection setup, the copy and the completion ack are all
in) for transfers of 1, 16, 64 and 256 MiB of scattered 1 MiB blocks, a few repetitions
each, median taken. ``memcpy_gb_s`` is a 64 MiB torch copy in this process, measured in the
same run: the ceiling any same-host transfer is held against. GB/s is 1e9 bytes moved per
second (bytes of KV delivered, not memory traffic, which is twice that for a copy).

    python -m tools.bench.transfer_bench [--backends shm,tcp,nixl] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence

import torch

from engine.kvcache.pool import KVLayout
from services.kvtransfer.nixl import nixl_import_error
from tools.bench.transfer_peer import PeerPlan, PeerProcess

# 1 MiB blocks: 32 layers x (K, V) x 16 tokens x 4 KV heads x 128 dims x bf16, an 8B-class
# model's block with half its KV heads.
BENCH_LAYOUT = KVLayout(
    num_layers=32, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.bfloat16
)
_MIB = 1 << 20
_DEADLINE_S = 60.0


def memcpy_gb_s(nbytes: int = 64 * _MIB, repeats: int = 5) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages is not part of a copy's cost
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _bench_transfer_backend(kind: str, sizes_mib: Sequence[int], repeats: int) -> dict[str, float]:
    num_blocks = max(sizes_mib) * _MIB // BENCH_LAYOUT.block_bytes
    rng = random.Random(0)
    with (
        PeerProcess(PeerPlan(kind, f"bench-prefill-{kind}", BENCH_LAYOUT, num_blocks)) as pre,
        PeerProcess(PeerPlan(kind, f"bench-decode-{kind}", BENCH_LAYOUT, num_blocks)) as dec,
    ):
        pre_md, dec_md = pre.register(), dec.register()
        pre.add_peer(dec_md)
        dec.add_peer(pre_md)
        all_src = list(range(num_blocks))
        source_digest = pre.fill(all_src, seed=1)
        # Untimed full pass: it pays for connections and first-touch page faults (a serving
        # pool is touched once at startup, not per transfer), and proves the bytes arrive.
        remote = dec.prepare_receive("bench-warmup", all_src, _DEADLINE_S)
        pre.send_and_wait("bench-warmup", all_src, remote, _DEADLINE_S)
        dec.wait("bench-warmup")
        if dec.digest(all_src) != source_digest:
            raise RuntimeError(f"{kind}: decode blocks differ from the prefill blocks")
        results: dict[str, float] = {}
        counter = 0
        for size in sizes_mib:
            n = size * _MIB // BENCH_LAYOUT.block_bytes
            times = []
            for _ in range(repeats):
                src = rng.sample(all_src, n)
                dst = rng.sample(range(num_blocks), n)
                rid = f"bench-{counter}"
                counter += 1
                remote = dec.prepare_receive(rid, dst, _DEADLINE_S)
                sent = pre.send_and_wait(rid, src, remote, _DEADLINE_S)
                received = dec.wait(rid)
                if sent["state"] != "done" or received["state"] != "done":
                    raise RuntimeError(f"{kind} transfer {rid} failed: {sent} / {received}")
                times.append(sent["seconds"])
            results[f"gb_s_{size}mib"] = size * _MIB / statistics.median(times) / 1e9
        return results


def run_transfer_bench(
    sizes_mib: Sequence[int] = (1, 16, 64, 256),
    backends: Sequence[str] = ("shm", "tcp", "nixl"),
    repeats: int = 3,
) -> dict:
    report: dict = {
        "memcpy_gb_s": memcpy_gb_s(),
        "block_bytes": BENCH_LAYOUT.block_bytes,
        "repeats": repeats,
        "backends": {},
    }
    for kind in backends:
        if kind == "nixl" and (why := nixl_import_error()):
            report["backends"][kind] = {"skipped": f"nixl not importable: {why}"}
            continue
        report["backends"][kind] = _bench_transfer_backend(kind, sizes_mib, repeats)
    # Every backend runs on this one host here, so "same host" is all of them.
    at_64 = [r["gb_s_64mib"] for r in report["backends"].values() if "gb_s_64mib" in r]
    if at_64:
        report["ratio_best_same_host_vs_memcpy_64mib"] = max(at_64) / report["memcpy_gb_s"]
    return report


def format_report(report: dict) -> str:
    memcpy = report["memcpy_gb_s"]
    lines = [f"memcpy (64 MiB torch copy): {memcpy:.2f} GB/s"]
    for kind, results in report["backends"].items():
        if "skipped" in results:
            lines.append(f"{kind:>5}: skipped ({results['skipped']})")
            continue
        cells = [
            f"{key.removeprefix('gb_s_')}: {v:6.2f} GB/s ({v / memcpy:4.0%} of memcpy)"
            for key, v in results.items()
        ]
        lines.append(f"{kind:>5}: " + " | ".join(cells))
    if "ratio_best_same_host_vs_memcpy_64mib" in report:
        lines.append(
            f"best backend at 64 MiB / memcpy: {report['ratio_best_same_host_vs_memcpy_64mib']:.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="shm,tcp,nixl")
    parser.add_argument("--sizes-mib", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the raw report as JSON")
    args = parser.parse_args()
    report = run_transfer_bench(
        sizes_mib=[int(s) for s in args.sizes_mib.split(",")],
        backends=args.backends.split(","),
        repeats=args.repeats,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))


if __name__ == "__main__":
    main()
