"""`splitserve bench kernels`: the Triton attention kernels against the GPU's limits."""

from __future__ import annotations

import argparse


def add_bench(kinds) -> None:
    """Register `kernels` on the `splitserve bench` subparsers object."""
    ker = kinds.add_parser(
        "kernels", help="Triton attention kernels: GB/s, TFLOP/s, split-KV verify speedup (GPU)"
    )
    ker.add_argument("--json", default=None, help="write the results here")
    ker.add_argument("--quick", action="store_true", help="fewer contexts and repetitions")
    ker.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures here")
    ker.set_defaults(handler=run_kernels)


def run_kernels(args: argparse.Namespace) -> int:
    from tools.bench import kernels_bench
    from tools.bench.report import machine_info, print_table, save_outputs

    result = kernels_bench.run(quick=args.quick)
    result["machine"] = machine_info()
    if result["cuda"]:
        title = f"splitserve bench kernels on {result['device']} (ours vs spec limit / unsplit)"
    else:
        print("splitserve bench kernels: the Triton kernels need a CUDA GPU; none is visible.")
        title = "torch reference path on this CPU, small shapes (GB/s vs measured read rate)"
    print_table(title, kernels_bench.table_rows(result))
    save_outputs("kernels", result, args.json, args.plot)
    return 0
