"""`splitserve bench ttft`: a disaggregated request's time to first token, part by part."""

from __future__ import annotations

import argparse

from tools.commands.common import WEIGHT_FORMATS, positive_int


def add_bench(kinds) -> None:
    bench = kinds.add_parser(
        "ttft", help="TTFT breakdown of fresh ~300-token prompts on 1 prefill + 1 decode"
    )
    bench.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS)
    bench.add_argument("--requests", type=positive_int, default=30, help="measured requests")
    bench.add_argument("--prompt-tokens", type=positive_int, default=300)
    bench.add_argument("--max-tokens", type=positive_int, default=4)
    bench.add_argument("--json", default=None, metavar="OUT")
    bench.add_argument("--plot", default=None, metavar="DIR", help="TTFT CDF (PNG)")
    bench.set_defaults(handler=run_bench_ttft)


def run_bench_ttft(args: argparse.Namespace) -> int:
    from tools.bench import ttft_bench
    from tools.bench.report import machine_info, print_table, save_outputs

    result = ttft_bench.run(
        weights=args.weights,
        requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=max(2, args.max_tokens),  # a second token, for the gap after the first
    )
    result["machine"] = machine_info()
    print_table(
        f"splitserve bench ttft ({result['requests']} fresh prompts of "
        f"~{result['prompt_tokens_p50']:.0f} tokens, 1 prefill + 1 decode; ratio = share of TTFT)",
        ttft_bench.table_rows(result),
    )
    save_outputs("ttft", result, args.json, args.plot)
    return 0
