"""`splitserve bench spec`: speculative decoding (ngram, draft, adaptive) against plain decoding."""

from __future__ import annotations

import argparse
import sys

from tools.bench.spec_methods import HEAD_MINUTES, METHODS, SETS
from tools.commands.common import add_model_args, fail
from tools.commands.head_tuning import add_head_tuning, head_tuning


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
    spec.add_argument(
        "--head",
        default=None,
        help="draft head for method `head` (default: train one on the bench's replayed chat "
        "traffic, --head-minutes of CPU)",
    )
    spec.add_argument(
        "--head-minutes", type=float, default=HEAD_MINUTES, help="CPU minutes to train it"
    )
    spec.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {','.join(METHODS)} (none always runs)",
    )
    spec.add_argument("--sets", default=",".join(SETS), help=f"subset of {','.join(SETS)}")
    add_head_tuning(spec)
    spec.set_defaults(handler=run_spec)


def run_spec(args: argparse.Namespace) -> int:
    from tools.bench import spec_bench
    from tools.bench.report import machine_info, print_table, write_json

    threads = args.threads or 2
    methods = tuple(m for m in args.methods.split(",") if m)
    sets = tuple(s for s in args.sets.split(",") if s)
    if not set(methods) <= set(METHODS) or not set(sets) <= set(SETS) or not sets:
        return fail(f"--methods must name {', '.join(METHODS)}; --sets {', '.join(SETS)}")
    if not args.head_minutes > 0:
        return fail(f"--head-minutes must be > 0, got {args.head_minutes}")
    tuning = head_tuning(args)
    if isinstance(tuning, str):
        return fail(tuning)
    result = spec_bench.run(
        args.weights,
        args.model,
        threads,
        quick=args.quick,
        k=args.k,
        draft_path=args.draft,
        head_path=args.head,
        head_minutes=args.head_minutes,
        methods=methods,
        sets_wanted=sets,
        log=_stderr,
        head_tuning=tuning,
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


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
