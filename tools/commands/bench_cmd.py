"""`splitserve bench …`: every benchmark prints ours beside the limit or the peer, and JSON."""

from __future__ import annotations

import argparse
import importlib
import urllib.parse

from shared.config.engine_defaults import KV_CACHE_DTYPES
from tools.commands.common import (
    WEIGHT_FORMATS,
    add_model_args,
    fail,
    positive_float,
    positive_int,
)


def add_command(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    eng = kinds.add_parser("engine", help="decode/prefill speed of one engine vs llama.cpp")
    add_model_args(eng, default_weights="auto")
    eng.add_argument("--json", default=None, help="write the results here")
    eng.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    eng.add_argument(
        "--llama-bench",
        default=None,
        help="a llama.cpp llama-bench binary: the peer's figures (else llama-cpp-python)",
    )
    eng.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV pool element type (auto: what a serving replica takes on this machine)",
    )
    eng.set_defaults(handler=run_engine)

    mod = kinds.add_parser(
        "models", help="every served family's tiny model: speed and conversation cache hits"
    )
    mod.add_argument("--families", default=None, help="comma-separated (default: all)")
    mod.add_argument("--json", default=None, help="write the results here")
    mod.add_argument("--quick", action="store_true", help="shorter timings (smoke run)")
    mod.set_defaults(handler=run_models)

    dis = kinds.add_parser("disagg", help="colocated vs disaggregated replicas under chat load")
    dis.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS)
    dis.add_argument("--duration", type=float, default=60.0, help="seconds of load per mode")
    dis.add_argument("--short-every", type=float, default=1.0, help="seconds between chat turns")
    dis.add_argument("--long-every", type=float, default=12.0, help="seconds between long prompts")
    dis.add_argument("--json", default=None)
    dis.set_defaults(handler=run_disagg)

    tra = kinds.add_parser("transfer", help="KV-transfer backends between two processes")
    tra.add_argument("--backends", default="shm,tcp,nixl")
    tra.add_argument("--repeats", type=int, default=3)
    tra.add_argument("--json", default=None)
    tra.set_defaults(handler=run_transfer)

    srv = kinds.add_parser(
        "serve", help="the local stack beside any OpenAI-compatible server (e.g. llama-server)"
    )
    srv.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    srv.add_argument(
        "--peer", type=_http_url, default=None, metavar="URL", help="e.g. http://127.0.0.1:8088"
    )
    srv.add_argument("--peer-pid", type=positive_int, default=None, help="to read its RSS")
    srv.add_argument(
        "--peer-kv-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="its KV capacity (default: llama-server's /props n_ctx x slots)",
    )
    srv.add_argument(
        "--requests",
        type=_request_scale,
        default="full",
        metavar="SCALE",
        help="full (20 short, 10 first turns, 2 conversations, 32 at concurrency 8), small "
        "(a smoke run) or a factor on full's counts",
    )
    srv.add_argument(
        "--weights", default=None, choices=WEIGHT_FORMATS, help="default: the config's (auto)"
    )
    srv.add_argument("--threads", type=positive_int, default=None, help="torch threads per worker")
    srv.add_argument("--config", default=None, help="stack config YAML (default: built-in)")
    srv.add_argument(
        "--plot", default=None, metavar="DIR", help="TTFT and ITL CDFs per workload (PNG)"
    )
    srv.set_defaults(handler=run_serve)

    for module in _BENCH_MODULES:
        importlib.import_module(module).add_bench(kinds)
    # Every benchmark draws its figures on request; those that register --plot themselves
    # keep their own help text.
    for parser in kinds.choices.values():
        if not any("--plot" in action.option_strings for action in parser._actions):
            parser.add_argument(
                "--plot", default=None, metavar="DIR", help="write PNG figures here"
            )


# Benchmarks that live with their subsystem; each module has add_bench(kinds).
_BENCH_MODULES = [
    "tools.commands.chaos_cmd",
    "tools.commands.kernels_cmd",
    "tools.commands.router_cmd",
    "tools.commands.spec_cmd",
    "tools.commands.structured_cmd",
    "tools.commands.tiers_cmd",
    "tools.commands.trace_cmd",
    "tools.commands.ttft_cmd",
    "tools.commands.tune_cmd",
]


def run_engine(args: argparse.Namespace) -> int:
    from tools.bench import engine_bench
    from tools.bench.report import machine_info, print_table, save_outputs

    threads = args.threads or 2
    try:
        result = engine_bench.run(
            args.weights,
            args.model,
            threads,
            quick=args.quick,
            llama_bench=args.llama_bench,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    except ValueError as exc:  # a model file, a window too small, a refused request
        return fail(f"bench engine: {exc}")
    result["machine"] = machine_info()
    print_table(
        f"splitserve bench engine (weights={args.weights}, threads={threads}, "
        f"KV {result['kv_cache_dtype']})",
        engine_bench.table_rows(result),
    )
    save_outputs("engine", result, args.json, args.plot)
    return 0


def run_models(args: argparse.Namespace) -> int:
    from tools.bench import models_bench
    from tools.bench.report import machine_info, print_table, write_json

    families = args.families.split(",") if args.families else None
    try:
        result = models_bench.run(families, quick=args.quick)
    except ImportError as exc:  # transformers builds the tiny models: a dev dependency
        print(f"splitserve bench models needs the dev extras ({exc}): pip install -e '.[dev]'")
        return 2
    result["machine"] = machine_info()
    print_table(
        "splitserve bench models (tiny random-weight models, fp32)", models_bench.table_rows(result)
    )
    write_json(args.json, result)
    below = [f for f, r in result["families"].items() if r["prefix_hit_rate"] < 0.9]
    return 1 if below else 0


def run_disagg(args: argparse.Namespace) -> int:
    from tools.bench import disagg_bench
    from tools.bench.report import machine_info, print_table, save_outputs

    result = disagg_bench.run(
        weights=args.weights,
        duration_s=args.duration,
        short_every_s=args.short_every,
        long_every_s=args.long_every,
    )
    result["machine"] = machine_info()
    print_table(
        "splitserve bench disagg (disagg vs colocated, same 2 worker processes)",
        disagg_bench.table_rows(result),
    )
    print(f"itl_p99_ratio = {result['itl_p99_ratio']}")
    save_outputs("disagg", result, args.json, args.plot)
    return 0


def run_transfer(args: argparse.Namespace) -> int:
    from tools.bench.report import machine_info, print_table, save_outputs
    from tools.bench.transfer_bench import run_transfer_bench

    backends = tuple(b for b in args.backends.split(",") if b)
    result = run_transfer_bench(backends=backends, repeats=args.repeats)
    result["machine"] = machine_info()
    rows = []
    memcpy = result["memcpy_gb_s"]
    for name, figures in result["backends"].items():
        if not isinstance(figures, dict) or "gb_s_64mib" not in figures:
            rows.append((f"{name}", str(figures), None, None))
            continue
        for key in ("gb_s_1mib", "gb_s_16mib", "gb_s_64mib", "gb_s_256mib"):
            rows.append((f"{name} {key}", figures[key], memcpy, figures[key] / memcpy))
    print_table("splitserve bench transfer (GB/s vs memcpy in the same run)", rows)
    save_outputs("transfer", result, args.json, args.plot)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from shared.config.schema import ConfigError
    from tools.bench import serve_bench
    from tools.bench.report import machine_info, print_table, write_json

    if args.peer is None and (args.peer_pid is not None or args.peer_kv_tokens is not None):
        return fail("--peer-pid and --peer-kv-tokens describe a peer: give --peer URL too")
    options = serve_bench.ServeBenchOptions(
        plan=serve_bench.plan_for(args.requests),
        config_path=args.config,
        weights=args.weights,
        threads=args.threads,
        peer=args.peer,
        peer_pid=args.peer_pid,
        peer_kv_tokens=args.peer_kv_tokens,
    )
    try:
        result = serve_bench.run(options)
    except ConfigError as exc:
        return fail(str(exc))
    except serve_bench.PeerUnavailable as exc:
        return fail(str(exc))
    result["machine"] = machine_info()
    peer = f" vs {result['peer']['url']} ({result['peer']['model']})" if "peer" in result else ""
    print_table(
        f"splitserve bench serve: ours{peer}; ratio = ours / peer", serve_bench.table_rows(result)
    )
    for line in serve_bench.notes(result):
        print(line)
    write_json(args.json, result)
    if args.plot:  # one figure per workload: their latency scales differ too much for one
        for path in serve_bench.write_figures(result, args.plot):
            print(f"wrote {path}")
    return 0


def _request_scale(text: str) -> str | float:
    """`--requests`: full, small, or a positive factor on full's request counts."""
    if text in ("full", "small"):
        return text
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not full, small or a positive number"
        ) from None


def _http_url(text: str) -> str:
    parts = urllib.parse.urlparse(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return text
