"""`splitserve profile` (measure one replica), `splitserve tune` (recommend pool sizes for a
trace and an SLO) and `splitserve bench tune`."""

from __future__ import annotations

import argparse

from shared.config import engine_defaults as defaults
from tools.commands.common import WEIGHT_FORMATS, fail, positive_float, positive_int
from tools.profiler.hardware_specs import GPUS, LINKS

ROUTERS = ("least_loaded", "round_robin", "prefix_only", "kv_aware")


def add_commands(sub) -> None:
    prof = sub.add_parser("profile", help="measure one replica here: the tuner's calibration")
    prof.add_argument("--json", required=True, metavar="OUT", help="write the profile here")
    prof.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    prof.add_argument(
        "--weights",
        default=None,
        help=f"measured: one of {', '.join(WEIGHT_FORMATS)} (default: what `splitserve up` "
        "serves); --analytic --gpu: bf16, fp8 or int4 (default bf16)",
    )
    prof.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads (a local replica's: 1)"
    )
    prof.add_argument("--quick", action="store_true", help="fewer points (under a minute)")
    prof.add_argument(
        "--kv-cache-bytes",
        type=positive_int,
        default=defaults.KV_CACHE_BYTES,
        help="a replica's KV cache (its prefix-cache size in the simulator)",
    )
    prof.add_argument(
        "--analytic",
        action="store_true",
        help="derive the profile from a roofline instead of measuring (with --gpu or --cpu)",
    )
    prof.add_argument("--gpu", default=None, choices=sorted(GPUS), help="with --analytic")
    prof.add_argument(
        "--cpu",
        action="store_true",
        help="with --analytic: this CPU's measured peaks, efficiency calibrated against a "
        "measured profile of this machine (--measured, default: this machine's cached one)",
    )
    prof.add_argument("--measured", default=None, metavar="PROFILE", help="with --cpu")
    prof.add_argument("--tp", type=positive_int, default=1, help="GPUs per replica (--gpu)")
    prof.add_argument(
        "--interconnect",
        default="ib400",
        choices=sorted(LINKS),
        help="what a KV push between replicas crosses (--gpu)",
    )
    prof.add_argument("--compute-efficiency", type=_fraction, default=None, metavar="F")
    prof.add_argument("--memory-efficiency", type=_fraction, default=None, metavar="F")
    prof.set_defaults(handler=run_profile_cmd)

    tune = sub.add_parser(
        "tune", help="recommend prefill:decode pool sizes that meet an SLO on a trace"
    )
    tune.add_argument("--trace", required=True, help="Mooncake JSONL or Azure CSV trace")
    tune.add_argument(
        "--profile", default=None, help="from `splitserve profile` (default: the shipped one)"
    )
    tune.add_argument(
        "--slo", required=True, type=_slo, help="e.g. ttft_p99_ms=2000,itl_p99_ms=150"
    )
    tune.add_argument(
        "--tier",
        type=_tier_mix,
        default=None,
        help="tier mix of the requests, e.g. priority=0.2,default=0.6,batch=0.2 (default: all "
        "default); higher tiers go first in every queue",
    )
    tune.add_argument(
        "--slo-tiers",
        default=None,
        help="tiers the SLO must hold for, e.g. priority,default (default: all but flex, batch)",
    )
    tune.add_argument("--max-replicas", type=_at_least_two, default=32)
    tune.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        help="stretch inter-arrival times (2 = half the trace's request rate)",
    )
    tune.add_argument(
        "--length-scale",
        type=positive_float,
        default=1.0,
        help="multiply prompt and output lengths (fit a big model's trace to a small replica)",
    )
    tune.add_argument("--router", default="least_loaded", choices=ROUTERS)
    tune.add_argument(
        "--cache-tokens",
        type=_non_negative_int,
        default=None,
        help="prefix cache per prefill replica (default: the profile's KV capacity)",
    )
    tune.add_argument("--decode-max-batch", type=positive_int, default=64)
    tune.add_argument(
        "--model-id",
        default=None,
        help="the pool's key in the Helm values (default: the profile's model)",
    )
    tune.add_argument(
        "--validate",
        action="store_true",
        help="also replay a short slice on a live local stack and report the sim's error",
    )
    tune.add_argument("--validate-requests", type=positive_int, default=30)
    tune.add_argument(
        "--colocated",
        type=_colocation,
        default=None,
        metavar="P,D",
        help="prefill and decode replicas share hosts: a prefill step runs P times slower "
        "while decode is busy, a decode step D times while prefill is (the live check measures "
        "about 2,1.4 on a 2-core machine); charged over the part of each replica's busy time "
        "that the other kind is busy too",
    )
    tune.add_argument(
        "--fleet-hardware",
        default=None,
        choices=sorted(GPUS),
        help="the GPU the fleet will run on: the profile is checked against it (default: "
        "against this machine)",
    )
    tune.add_argument(
        "--gpu-hour-usd",
        type=positive_float,
        default=None,
        metavar="USD",
        help="price per GPU-hour (per replica-hour for CPU profiles) for cost per million "
        "tokens (default: the shipped list price for the profile's GPU, if any)",
    )
    tune.add_argument("--json", default=None, metavar="OUT")
    tune.set_defaults(handler=run_tune_cmd)


def add_bench(kinds) -> None:
    bench = kinds.add_parser(
        "tune", help="the tuner on the Mooncake and Azure traces, and its error vs a live run"
    )
    bench.add_argument("--profile", default=None, help="default: the shipped profile")
    bench.add_argument("--no-live", action="store_true", help="skip the live comparison")
    bench.add_argument("--live-requests", type=positive_int, default=30)
    bench.add_argument("--json", default=None, metavar="OUT")
    bench.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures here")
    bench.set_defaults(handler=run_bench_cmd)


# -- handlers ----------------------------------------------------------------------------


def run_profile_cmd(args: argparse.Namespace) -> int:
    if args.analytic:
        from tools.profiler.analytic_cli import run_analytic

        try:
            return run_analytic(args)
        except ValueError as exc:  # ProfileError, ModelFileError: the message says where
            return fail(str(exc))
    if args.gpu or args.cpu:
        return fail("--gpu and --cpu describe an analytic profile: add --analytic")
    if args.weights is not None and args.weights not in WEIGHT_FORMATS:
        return fail(f"--weights {args.weights!r}: choose from {', '.join(WEIGHT_FORMATS)}")
    from tools.profiler.run import run_profile

    weights = args.weights
    if weights is None:
        from shared.config.schema import ModelDeployment

        weights = ModelDeployment().weights
    profile = run_profile(
        weights=weights,
        model_path=args.model,
        threads=args.threads,
        quick=args.quick,
        kv_cache_bytes=args.kv_cache_bytes,
    )
    profile.save(args.json)
    d, t = profile.decode, profile.transfer
    print(f"prefill 1k tokens alone: {profile.prefill_ms(1024):.0f} ms")
    print(f"decode step, batch 8 at 1k context: {d.step(8, 8 * 1024):.1f} ms")
    print(f"KV transfer: {t.latency_ms:.2f} ms + {t.gb_s:.2f} GB/s")
    print(f"profile written to {args.json}")
    return 0


def run_tune_cmd(args: argparse.Namespace) -> int:
    from tools.tuner.cli_run import TuneOptions, run_tune

    try:
        return run_tune(TuneOptions.from_args(args))
    except ValueError as exc:  # TraceError, ProfileError, bad options: the message says where
        return fail(str(exc))


def run_bench_cmd(args: argparse.Namespace) -> int:
    from tools.tuner.bench import run_bench

    try:
        return run_bench(
            args.profile,
            live=not args.no_live,
            live_requests=args.live_requests,
            json_path=args.json,
            plot_dir=args.plot,
        )
    except ValueError as exc:
        return fail(str(exc))


# -- argument types ----------------------------------------------------------------------


def _slo(text: str):
    from tools.tuner.slo import parse_slo

    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tier_mix(text: str) -> dict[str, float]:
    from tools.tuner.fleet import parse_tier_mix

    try:
        return parse_tier_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _colocation(text: str):
    from tools.tuner.colocation import Colocation

    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PREFILL,DECODE slowdowns")
    try:
        return Colocation(_number(parts[0], float), _number(parts[1], float))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _at_least_two(text: str) -> int:
    value = _number(text, int)
    if value < 2:
        raise argparse.ArgumentTypeError("needs at least 2 (one prefill and one decode replica)")
    return value
