"""`splitserve planner`: scale one model's prefill and decode pools from the coordinator's
metrics through the Kubernetes scale subresource (what the chart's planner pod runs)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from shared.config import engine_defaults
from tools.commands.common import fail

DEFAULT_MAX_SEQS = engine_defaults.MAX_NUM_SEQS  # what one replica's engine batches at most


def add_commands(sub) -> None:
    p = sub.add_parser(
        "planner",
        help="scale a model's prefill/decode Deployments from the coordinator's metrics",
        description="Every --interval: scrape the coordinator's /metrics, forecast the load "
        "over --horizon, and set the two Deployments' replicas (within bounds, after "
        "cooldowns). With the Kubernetes API unreachable it keeps the current counts.",
    )
    p.add_argument("--coordinator", required=True, metavar="URL", help="coordinator base URL")
    p.add_argument("--namespace", required=True, help="namespace of the two Deployments")
    p.add_argument("--deployment-prefill", required=True, metavar="NAME")
    p.add_argument("--deployment-decode", required=True, metavar="NAME")
    p.add_argument("--model", default=None, help="model id to size for (default: all traffic)")
    p.add_argument("--dry-run", action="store_true", help="log decisions, change nothing")
    p.add_argument("--once", action="store_true", help="one decision, then exit")
    p.add_argument(
        "--kube-api",
        default=None,
        metavar="URL",
        help="API server URL, used "
        "without credentials (e.g. kubectl proxy); default: in-cluster account",
    )
    p.add_argument("--interval", type=_positive, default=15.0, metavar="S")
    p.add_argument(
        "--window",
        type=_positive,
        default=300.0,
        metavar="S",
        help="seconds of samples the forecast looks at",
    )
    p.add_argument(
        "--horizon",
        type=_non_negative,
        default=60.0,
        metavar="S",
        help="how far ahead to size for (about a replica's start-up time)",
    )
    p.add_argument(
        "--cooldown",
        type=_non_negative,
        default=60.0,
        metavar="S",
        help="after a pool changes, no scale-up for S seconds",
    )
    p.add_argument(
        "--scale-down-cooldown",
        type=_non_negative,
        default=300.0,
        metavar="S",
        help="after a pool changes, no scale-down for S seconds",
    )
    for role, hi in (("prefill", 8), ("decode", 16)):
        p.add_argument(f"--min-{role}", type=_at_least_one, default=1, metavar="N")
        p.add_argument(f"--max-{role}", type=_at_least_one, default=hi, metavar="N")
    p.add_argument("--target-utilization", type=_fraction, default=0.7, metavar="F")
    p.add_argument(
        "--prefill-tokens-per-s",
        type=_positive,
        default=None,
        metavar="R",
        help="prompt tokens one prefill replica computes per second (default: from --profile, "
        "else 4000)",
    )
    p.add_argument(
        "--decode-tokens-per-s",
        type=_positive,
        default=None,
        metavar="R",
        help="tokens one decode replica generates per second (default: from --profile, else 600)",
    )
    p.add_argument(
        "--decode-seqs",
        type=_at_least_one,
        default=None,
        metavar="N",
        help="sequences one decode replica runs at once (default: from --profile, else 32)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="JSON",
        help="a replica profile (`splitserve profile`, measured or --analytic): the capacities "
        "above are read from it unless given",
    )
    p.add_argument(
        "--context-tokens",
        type=_at_least_one,
        default=1024,
        metavar="N",
        help="typical prompt + reply length, for the profile's decode capacities",
    )
    p.add_argument(
        "--fleet-hardware",
        default=None,
        metavar="GPU",
        help="the GPU the replicas run on (e.g. h200): the profile is checked against it",
    )
    p.add_argument("--ttft-p99-ms", type=_positive, default=None, metavar="MS")
    p.add_argument("--itl-p99-ms", type=_positive, default=None, metavar="MS")
    p.set_defaults(handler=run_planner)


def run_planner(args: argparse.Namespace) -> int:
    from services.planner.decide import Policy
    from services.planner.kube import KubeScaler, ScaleAPIError
    from services.planner.loop import Planner, PlannerConfig, http_metrics

    try:
        capacity = _capacities(args)
        policy = Policy(
            min_prefill=args.min_prefill,
            max_prefill=args.max_prefill,
            min_decode=args.min_decode,
            max_decode=args.max_decode,
            **capacity,
            target_utilization=args.target_utilization,
            window_s=args.window,
            horizon_s=args.horizon,
            ttft_p99_s=None if args.ttft_p99_ms is None else args.ttft_p99_ms / 1000,
            itl_p99_s=None if args.itl_p99_ms is None else args.itl_p99_ms / 1000,
        )
    except ValueError as exc:
        return fail(str(exc).replace("min_", "--min-").replace("max_", "--max-"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s planner %(levelname)s %(message)s")
    try:
        scaler = KubeScaler(args.namespace, args.kube_api)
    except ScaleAPIError as exc:
        return fail(str(exc))
    planner = Planner(
        PlannerConfig(
            prefill_deployment=args.deployment_prefill,
            decode_deployment=args.deployment_decode,
            policy=policy,
            interval_s=args.interval,
            cooldown_s=args.cooldown,
            scale_down_cooldown_s=args.scale_down_cooldown,
            dry_run=args.dry_run,
        ),
        http_metrics(args.coordinator, args.model),
        scaler,
    )
    if args.once:
        planner.step()
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    planner.run(stop)
    return 0


DEFAULT_CAPACITIES = {
    "prefill_tokens_per_s": 4000.0,
    "decode_tokens_per_s": 600.0,
    "decode_seqs": 32,
}


def _capacities(args: argparse.Namespace) -> dict:
    """Flags first, then the profile, then the old defaults; says what it rests on."""
    given = {k: getattr(args, k) for k in DEFAULT_CAPACITIES if getattr(args, k) is not None}
    if not args.profile:
        return DEFAULT_CAPACITIES | given
    from services.planner.capacity import capacities
    from services.planner.replica_profile import load_profile
    from tools.profiler.signature import mismatch_report, named_gpu

    profile = load_profile(args.profile)
    cap = capacities(profile, args.context_tokens, DEFAULT_MAX_SEQS)
    print(f"planner: {cap.describe()}", file=sys.stderr)
    if args.fleet_hardware:
        tp = int(profile.meta.get("gpus_per_replica", 1))
        check = mismatch_report(
            profile.meta,
            named_gpu(args.fleet_hardware, tp),
            f"the fleet's {args.fleet_hardware}",
            True,
        )
        for warning in check["warnings"]:
            print(f"planner: WARNING: {warning}", file=sys.stderr)
    else:
        print(
            "planner: no --fleet-hardware: the profile is not checked against the hardware the "
            "replicas run on",
            file=sys.stderr,
        )
    from_profile = {
        "prefill_tokens_per_s": cap.prefill_tokens_per_s,
        "decode_tokens_per_s": cap.decode_tokens_per_s,
        "decode_seqs": cap.decode_seqs,
    }
    return from_profile | given


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _positive(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1: a model needs both pools")
    return value
