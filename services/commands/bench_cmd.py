"""`splitserve bench …`: every benchmark prints ours beside the limit or the peer, and JSON."""

from __future__ import annotations

import argparse

from services.commands.common import add_model_args


def add_command(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    eng = kinds.add_parser("engine", help="decode/prefill speed of one engine vs llama.cpp")
    add_model_args(eng, default_weights="auto")
    eng.add_argument("--json", default=None, help="write the results here")
    eng.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    eng.set_defaults(handler=run_engine)


def run_engine(args: argparse.Namespace) -> int:
    from services.bench import engine_bench
    from services.bench.report import machine_info, print_table, write_json

    threads = args.threads or 2
    result = engine_bench.run(args.weights, args.model, threads, quick=args.quick)
    result["machine"] = machine_info()
    print_table(
        f"splitserve bench engine (weights={args.weights}, threads={threads})",
        engine_bench.table_rows(result),
    )
    write_json(args.json, result)
    return 0
