"""`splitserve bench router`: routing policies on a Mooncake trace in the fleet simulator,
and with `--live` on a local stack of real replicas."""

from __future__ import annotations

import argparse
import sys

from tools.commands.common import fail, positive_float, positive_int


def add_bench(kinds) -> None:
    bench = kinds.add_parser(
        "router", help="routing policies on a Mooncake-format trace (simulated; --live: real)"
    )
    bench.add_argument("--trace", required=True, help="Mooncake JSONL trace (with hash_ids)")
    bench.add_argument("--replicas", type=positive_int, default=8, help="prefill replicas")
    bench.add_argument("--json", default=None, metavar="OUT")
    bench.add_argument("--plot", default=None, metavar="DIR", help="TTFT CDF per policy (PNG)")
    bench.add_argument("--config", default=None, help="deployment config: caches, router weights")
    bench.add_argument("--profile", default=None, help="default: the shipped calibration")
    bench.add_argument(
        "--length-scale",
        type=positive_float,
        default=1 / 32,
        help="multiply prompt lengths (default 1/32, as bench tune maps Mooncake)",
    )
    bench.add_argument(
        "--utilization",
        type=positive_float,
        default=0.65,
        help="compress or stretch arrivals to this prefill load of the fleet (no cache)",
    )
    bench.add_argument(
        "--native-rate", action="store_true", help="keep the trace's own arrival times"
    )
    bench.add_argument("--requests", type=positive_int, default=None, help="first N only")
    bench.add_argument("--live", action="store_true", help="also replay a slice on real replicas")
    bench.add_argument("--live-requests", type=positive_int, default=40)
    bench.set_defaults(handler=run_router_bench)


def run_router_bench(args: argparse.Namespace) -> int:
    from shared.config.schema import ConfigError, load_config
    from tools.bench.report import print_table, write_json
    from tools.tuner import router_bench
    from tools.tuner.cli_run import load_profile_or_default
    from tools.tuner.trace import load_trace

    try:
        config = load_config(args.config)
        profile, _ = load_profile_or_default(args.profile)
        trace = load_trace(args.trace)
        if args.requests:
            trace = trace.window(0, args.requests)
        result, samples = router_bench.run(
            trace,
            profile,
            args.replicas,
            config,
            length_scale=args.length_scale,
            utilization=None if args.native_rate else args.utilization,
        )
    except (ValueError, ConfigError) as exc:  # TraceError, ProfileError: the message says where
        return fail(str(exc))
    m = result["mapping"]
    print_table(
        f"splitserve bench router ({result['requests']} requests, {args.replicas} prefill "
        f"replicas, lengths x{m['length_scale']:.4g}, prefill load {m['utilization']:.2f})",
        router_bench.table_rows(result),
    )
    if args.live:
        from tools.tuner import router_live

        result["live"] = router_live.run(trace, config, args.live_requests)
        print_table("live (local stack)", router_live.table_rows(result["live"]))
    write_json(args.json, result)
    if args.plot:
        from tools.bench.plots import write_plots

        for path in write_plots("router", {"samples": samples}, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0
