"""`splitserve bench tiers`: priority TTFT while batch traffic saturates the local stack."""

from __future__ import annotations

import argparse

from tools.commands.common import WEIGHT_FORMATS, positive_float, positive_int


def add_bench(kinds) -> None:
    bench = kinds.add_parser(
        "tiers", help="priority TTFT under saturating batch traffic; default-tier 429s"
    )
    bench.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS)
    bench.add_argument("--duration", type=positive_float, default=40.0, help="s of saturation")
    bench.add_argument("--batch-clients", type=positive_int, default=8)
    bench.add_argument("--max-in-flight", type=positive_int, default=2, help="per model")
    bench.add_argument("--priority-every", type=positive_float, default=1.5, help="seconds")
    bench.add_argument("--default-every", type=positive_float, default=2.0, help="seconds")
    bench.add_argument("--json", default=None, metavar="OUT")
    bench.add_argument("--plot", default=None, metavar="DIR", help="TTFT CDFs per tier (PNG)")
    bench.set_defaults(handler=run_bench_tiers)


def run_bench_tiers(args: argparse.Namespace) -> int:
    from tools.bench import tiers_bench
    from tools.bench.report import machine_info, print_table, save_outputs

    plan = tiers_bench.TiersBenchPlan(
        weights=args.weights,
        duration_s=args.duration,
        batch_clients=args.batch_clients,
        max_in_flight=args.max_in_flight,
        priority_every_s=args.priority_every,
        default_every_s=args.default_every,
    )
    result = tiers_bench.run(plan)
    result["machine"] = machine_info()
    print_table(
        f"splitserve bench tiers ({plan.batch_clients} batch clients, "
        f"max_in_flight={plan.max_in_flight}; reference = priority alone)",
        tiers_bench.table_rows(result),
    )
    save_outputs("tiers", result, args.json, args.plot)
    return 0
