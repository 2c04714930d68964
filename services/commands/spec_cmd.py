"""`splitserve bench spec`: speculative decoding (ngram, draft, adaptive) against plain decoding."""

from __future__ import annotations

import argparse

from services.commands.common import add_model_args


def add_bench(kinds) -> None:
    """Register `spec` on the `splitserve bench` subparsers object."""
    spec = kinds.add_parser(
        "spec", help="speculative decoding: tok/s, acceptance and speedup per method and batch"
    )
    add_model_args(spec, default_weights="fp32")
    spec.add_argument("--json", default=None, help="write the results here")
    spec.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures here")
    spec.add_argument("--quick", action="store_true", help="4 prompts per set, 32 tokens")
    spec.add_argument("-k", "--num-speculative-tokens", type=int, default=8, dest="k")
    spec.add_argument(
        "--draft", default=None, help="draft file (default: the one beside the model)"
    )
    spec.set_defaults(handler=run_spec)


def run_spec(args: argparse.Namespace) -> int:
    from services.bench import spec_bench
    from services.bench.report import machine_info, print_table, write_json

    threads = args.threads or 2
    result = spec_bench.run(
        args.weights, args.model, threads, quick=args.quick, k=args.k, draft_path=args.draft
    )
    result["machine"] = machine_info()
    print_table(
        f"splitserve bench spec (weights={args.weights}, threads={threads}, k={args.k}): "
        "decode tok/s, plain = method none",
        spec_bench.table_rows(result),
    )
    write_json(args.json, result)
    if args.plot:
        for path in spec_bench.write_plots(result, args.plot):
            print(f"wrote {path}")
    return 0
