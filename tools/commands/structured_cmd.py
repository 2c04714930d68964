"""`splitserve bench structured`: JSON-schema outputs beside the same prompts unconstrained."""

from __future__ import annotations

import argparse

from tools.commands.common import add_model_args


def add_bench(kinds) -> None:
    """Register `structured` on the `splitserve bench` subparsers object."""
    bench = kinds.add_parser(
        "structured",
        help="structured outputs: validity, throughput vs free text, mask cost, TTFT delta",
    )
    add_model_args(bench, default_weights="fp32")
    bench.add_argument("--json", default=None, help="write the results here")
    bench.set_defaults(handler=run_structured)


def run_structured(args: argparse.Namespace) -> int:
    from tools.bench import structured_bench
    from tools.bench.report import machine_info, print_table, write_json

    threads = args.threads or 2
    result = structured_bench.run(args.weights, args.model, threads)
    result["machine"] = machine_info()
    print_table(
        f"splitserve bench structured ({result['requests']} requests at concurrency "
        f"{result['concurrency']}, weights={args.weights}, threads={threads}): "
        "ours beside the target or the unconstrained run",
        structured_bench.table_rows(result),
    )
    write_json(args.json, result)
    return 0
