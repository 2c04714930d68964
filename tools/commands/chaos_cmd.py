"""`splitserve bench chaos`: streams through a supervised local stack while workers die."""

from __future__ import annotations

import argparse

from tools.commands.common import WEIGHT_FORMATS, fail, positive_float, positive_int


def add_bench(kinds) -> None:
    from tools.bench.chaos_bench import SCENARIOS, WORKER_SCENARIOS

    bench = kinds.add_parser(
        "chaos", help="kill, drain and restart workers under concurrent greedy streams"
    )
    bench.add_argument("--streams", type=positive_int, default=16, help="concurrent streams")
    bench.add_argument("--max-tokens", type=positive_int, default=48, help="per stream")
    bench.add_argument("--prefill", type=positive_int, default=2, help="prefill replicas")
    bench.add_argument("--decode", type=positive_int, default=2, help="decode replicas (>= 2)")
    bench.add_argument(
        "--coordinators",
        type=positive_int,
        default=1,
        help="coordinators sharing the workers; 2 or more adds kill_coordinator",
    )
    bench.add_argument("--weights", default="fp32", choices=WEIGHT_FORMATS)
    bench.add_argument(
        "--drain-grace-s",
        type=positive_float,
        default=1.0,
        help="every worker's drain grace; shorter than the streams (the default), "
        "drain_decode hands them over to the other decode replica",
    )
    bench.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated, from {', '.join(SCENARIOS)} (default: "
        f"{', '.join(WORKER_SCENARIOS)}, and kill_coordinator with --coordinators 2+)",
    )
    bench.add_argument("--json", default=None, metavar="OUT")
    bench.set_defaults(handler=run_bench_chaos)


def run_bench_chaos(args: argparse.Namespace) -> int:
    from tools.bench import chaos_bench
    from tools.bench.report import machine_info, print_table, save_outputs

    if args.scenarios is None:
        several = args.coordinators > 1
        scenarios = chaos_bench.SCENARIOS if several else chaos_bench.WORKER_SCENARIOS
    else:
        scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = sorted(set(scenarios) - set(chaos_bench.SCENARIOS))
    if unknown:
        return fail(
            f"--scenarios: unknown {unknown}; choose from {', '.join(chaos_bench.SCENARIOS)}"
        )
    if "kill_coordinator" in scenarios and args.coordinators < 2:
        return fail("--scenarios kill_coordinator: needs --coordinators 2 or more")
    if args.decode < 2:
        return fail("--decode: at least 2, so that streams have a replica to migrate to")
    plan = chaos_bench.ChaosBenchPlan(
        streams=args.streams,
        max_tokens=args.max_tokens,
        prefill=args.prefill,
        decode=args.decode,
        coordinators=args.coordinators,
        weights=args.weights,
        drain_grace_s=args.drain_grace_s,
        scenarios=scenarios,
    )
    result = chaos_bench.run(plan)
    result["machine"] = machine_info()
    print_table(
        f"splitserve bench chaos ({plan.streams} greedy streams; {plan.coordinators} "
        f"coordinator(s), {plan.prefill} prefill + {plan.decode} decode; reference = 0 or "
        "the calm run)",
        chaos_bench.table_rows(result),
    )
    save_outputs("chaos", result, args.json, args.plot)
    return 0 if result["targets_met"] else 1
