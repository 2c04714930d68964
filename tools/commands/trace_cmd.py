"""`splitserve trace`: a request's waterfall from the local trace file, and
`splitserve bench overhead`: what tracing costs.

`add_commands(sub)` registers `trace` on the top-level subparsers; `add_bench(kinds)`
registers `overhead` on `splitserve bench`'s subparsers.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from tools.commands.common import WEIGHT_FORMATS, fail, positive_int


def add_commands(sub) -> None:
    p = sub.add_parser(
        "trace",
        help="show requests' traces as waterfalls (from the JSON-lines trace file)",
        description="Reads the trace file the services write with `telemetry: {exporter: "
        "file}` and prints each request's spans, durations and unaccounted gaps.",
    )
    p.add_argument(
        "--file",
        default=None,
        help="trace file (default: from --config, or ./splitserve-traces.jsonl)",
    )
    p.add_argument("--config", default=None, help="deployment config naming telemetry.file")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--last", type=int, default=None, metavar="N", help="the last N requests")
    which.add_argument("--trace-id", default=None, help="one trace (a unique prefix will do)")
    p.add_argument("--list", action="store_true", help="one line per trace, no waterfall")
    p.add_argument("-v", "--verbose", action="store_true", help="show span attributes")
    p.add_argument("--width", type=int, default=None, help="output width (default: terminal)")
    p.set_defaults(handler=run_trace)


def add_bench(kinds) -> None:
    p = kinds.add_parser("overhead", help="tracing off vs to a file vs to OTLP: throughput, TTFT")
    p.add_argument("--weights", default="fp32", choices=WEIGHT_FORMATS)
    p.add_argument("--requests", type=positive_int, default=8, help="requests per round and mode")
    p.add_argument("--concurrency", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument(
        "--paired",
        type=positive_int,
        default=150,
        help="prompts sent one at a time to every mode, for the unloaded TTFT",
    )
    p.add_argument(
        "--playground",
        action="store_true",
        help="instead: one stack with and without a fleet-view poller (1/s), tracing off",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures here")
    p.set_defaults(handler=run_overhead)


def _trace_file(args: argparse.Namespace) -> str:
    from shared.config.schema import TelemetryConfig, load_config

    if args.file:
        return args.file
    if args.config:
        return load_config(args.config).telemetry.file
    return TelemetryConfig().file


def run_trace(args: argparse.Namespace) -> int:
    from shared.config.schema import ConfigError
    from shared.telemetry.file_export import read_span_file
    from tools.commands.waterfall import group_traces, latest_traces, render, summarize

    try:
        path = _trace_file(args)
    except ConfigError as exc:
        return fail(str(exc))
    try:
        spans = read_span_file(path)
    except FileNotFoundError:
        return fail(
            f"no trace file at {path}; run the services with `telemetry: {{exporter: file, "
            "file: PATH}}` in the deployment config, or pass --file"
        )
    if not spans:
        return fail(f"{path} holds no spans yet")
    if args.trace_id:
        wanted = args.trace_id.lower()
        matches = [t for tid, t in group_traces(spans).items() if tid.startswith(wanted)]
        if len(matches) != 1:
            found = "no trace" if not matches else f"{len(matches)} traces"
            return fail(f"{found} in {path} with an id starting {args.trace_id!r}")
        traces = matches
    else:
        traces = latest_traces(spans, args.last or (20 if args.list else 1))
    width = args.width or shutil.get_terminal_size((120, 40)).columns
    out = sys.stdout
    for i, trace in enumerate(traces):
        if args.list:
            s = summarize(trace)
            errors = f"  errors={s.errors}" if s.errors else ""
            print(
                f"{s.trace_id}  {s.duration_ms:9.1f} ms  {s.num_spans:3d} spans  "
                f"{s.root_name}  [{', '.join(s.services)}]{errors}",
                file=out,
            )
            continue
        if i:
            print(file=out)
        print(render(trace, width=width, verbose=args.verbose), file=out)
    return 0


def run_overhead(args: argparse.Namespace) -> int:
    from tools.bench import overhead_bench
    from tools.bench.report import machine_info, print_table, save_outputs

    if args.playground:
        return run_playground_overhead(args)

    result = overhead_bench.run(
        weights=args.weights,
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        paired=args.paired,
    )
    result["machine"] = machine_info()
    print_table(
        "splitserve bench overhead (tracing on vs off, same deployment)",
        overhead_bench.table_rows(result),
    )
    print(f"tracing_throughput_ratio = {result['tracing_throughput_ratio']}")
    print(f"tracing_ttft_p50_delta_ms = {result['tracing_ttft_p50_delta_ms']}")
    print(f"tracing_ttft_p50_delta_ms_ci95 = {result.get('tracing_ttft_p50_delta_ms_ci95')}")
    print(f"tracing_cpu_ratio = {result.get('tracing_cpu_ratio')}")
    print(f"tracing_ttft_p50_delta_ms_loaded = {result['tracing_ttft_p50_delta_ms_loaded']}")
    save_outputs("overhead", result, args.json, args.plot)
    return 0


def run_playground_overhead(args: argparse.Namespace) -> int:
    from tools.bench import playground_bench
    from tools.bench.report import machine_info, print_table, write_json

    result = playground_bench.run(
        weights=args.weights,
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
    )
    result["machine"] = machine_info()
    print_table(
        "splitserve bench overhead --playground (fleet view polled every second vs not)",
        playground_bench.table_rows(result),
    )
    print(f"playground_throughput_ratio = {result['playground_throughput_ratio']}")
    write_json(args.json, result)
    return 0
