"""`splitserve tune` end to end: load, scale, search, print, optionally validate, write."""

from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from services.planner.replica_profile import ReplicaProfile, load_profile
from tools.tuner.basis import fleet_cost, profile_basis
from tools.tuner.colocation import Colocation
from tools.tuner.fleet import TIER_PRIORITY, FleetConfig, RouterPolicy, assign_priorities
from tools.tuner.report import print_report, tune_json
from tools.tuner.search import Evaluator, tune
from tools.tuner.slo import SLO
from tools.tuner.trace import Trace, load_trace

# Tiers whose latency is a promise by default; flex and batch trade latency for price.
LATENCY_TIERS = ("priority", "default")


def default_profile_path() -> Path:
    return Path(str(importlib.resources.files("tools.tuner") / "data" / "default_profile.json"))


def load_profile_or_default(path: str | None) -> tuple[ReplicaProfile, str]:
    chosen = Path(path) if path else default_profile_path()
    return load_profile(chosen), str(chosen)


def profile_summary(profile: ReplicaProfile, path: str) -> dict:
    meta = profile.meta
    return {
        "path": path,
        "measured_at": meta.get("machine", {}).get("measured_at"),
        "kind": meta.get("kind", "measured"),
        "signature": meta.get("signature"),
        "weights": meta.get("weights"),
        "threads": meta.get("threads"),
        "prefill_ms_1k_tokens": profile.prefill_ms(1024),
        "decode_step_ms_b8_ctx1k": profile.decode.step(8, 8 * 1024),
        "fit_max_rel_error": meta.get("fit_max_rel_error"),
    }


@dataclass(frozen=True)
class TuneOptions:
    trace: str
    profile: str | None
    slo: SLO
    tier_mix: dict[str, float] | None
    slo_tiers: list[str] | None
    max_replicas: int
    time_scale: float
    length_scale: float
    router: RouterPolicy
    cache_tokens: int | None
    decode_max_batch: int
    model_id: str | None
    validate: bool
    validate_requests: int
    json: str | None
    fleet_hardware: str | None = None
    gpu_hour_usd: float | None = None
    colocation: Colocation | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TuneOptions:
        slo_tiers = None
        if args.slo_tiers:
            slo_tiers = [t.strip() for t in args.slo_tiers.split(",") if t.strip()]
            bad = [t for t in slo_tiers if t not in TIER_PRIORITY]
            if bad:
                raise ValueError(
                    f"--slo-tiers: unknown tier {bad[0]!r}; valid: {', '.join(TIER_PRIORITY)}"
                )
        return cls(
            trace=args.trace,
            profile=args.profile,
            slo=args.slo,
            tier_mix=args.tier,
            slo_tiers=slo_tiers,
            max_replicas=args.max_replicas,
            time_scale=args.time_scale,
            length_scale=args.length_scale,
            router=args.router,
            cache_tokens=args.cache_tokens,
            decode_max_batch=args.decode_max_batch,
            model_id=args.model_id,
            validate=args.validate,
            validate_requests=args.validate_requests,
            json=args.json,
            fleet_hardware=args.fleet_hardware,
            gpu_hour_usd=args.gpu_hour_usd,
            colocation=args.colocated,
        )


def prepare_trace(path: str, profile: ReplicaProfile, time_scale: float, length_scale: float):
    trace = load_trace(path)
    return trace, trace.scaled(time_scale, length_scale, profile.max_context)


def slo_priorities(options: TuneOptions) -> list[int] | None:
    """The engine priorities the SLO is judged on (None: every request)."""
    if options.slo_tiers:
        return [TIER_PRIORITY[t] for t in options.slo_tiers]
    if options.tier_mix is None:
        return None
    return [TIER_PRIORITY[t] for t in LATENCY_TIERS]


DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# A GGUF file's quantisation suffix: the pool serves the model, whatever file a profile read.
_QUANT_SUFFIX = re.compile(r"(?:\.(?:I?Q\d\w*|F16|F32|BF16))?(?:\.gguf)?$", re.IGNORECASE)


def pool_model_id(meta: dict) -> str:
    """The Helm values' pool key for the profile's model: its name without the organisation
    (the chart's model ids are bare names) or a GGUF quantisation suffix."""
    model = str(meta.get("model") or "").rsplit("/", 1)[-1]
    return _QUANT_SUFFIX.sub("", model) or DEFAULT_MODEL_ID


def run_tune(options: TuneOptions) -> int:
    from tools.bench.report import write_json

    profile, profile_path = load_profile_or_default(options.profile)
    basis = profile_basis(profile, options.fleet_hardware)
    original, trace = prepare_trace(
        options.trace, profile, options.time_scale, options.length_scale
    )
    print(
        f"[tune] {trace.name}: {len(trace):,} requests over {trace.duration_s:,.0f} s "
        f"(time x{options.time_scale:g}, lengths x{options.length_scale:g}; "
        f"{trace.clipped} cut to the {profile.max_context}-token context)",
        file=sys.stderr,
    )
    priorities = assign_priorities(len(trace), options.tier_mix)
    fleet = FleetConfig(
        1,
        1,
        router=options.router,
        cache_tokens=options.cache_tokens,
        decode_max_batch=options.decode_max_batch,
    )
    evaluator = Evaluator(
        trace,
        profile,
        options.slo,
        fleet,
        priorities,
        slo_priorities(options),
        options.colocation,
    )
    result = tune(evaluator, options.max_replicas)
    cost = fleet_cost(trace, profile, result.best.replicas, options.gpu_hour_usd)
    model_id = options.model_id or pool_model_id(profile.meta)
    print_report(result, model_id, basis, cost)
    report = tune_json(result, model_id)
    report.update(
        basis=basis,
        cost=cost,
        trace=trace.summary(),
        scaling={
            "time_scale": options.time_scale,
            "length_scale": options.length_scale,
            "original_requests_per_s": original.requests_per_s,
            "original_mean_input_tokens": float(original.input_tokens.mean()),
        },
        router=options.router,
        tiers=options.tier_mix or {"default": 1.0},
        profile=profile_summary(profile, profile_path),
    )
    if options.validate:
        report["validation"] = validate_on_live(
            original, profile, options.length_scale, options.validate_requests
        )
        print(
            "[tune] sim vs live: TTFT p50 error "
            f"{_pct(report['validation']['sim_vs_live_ttft_p50_error'])}, ITL p50 error "
            f"{_pct(report['validation']['sim_vs_live_itl_p50_error'])}",
            file=sys.stderr,
        )
    write_json(options.json, report)
    return 0


def validate_on_live(
    trace: Trace, profile: ReplicaProfile, length_scale: float, count: int
) -> dict:
    from shared.modelfile.default import default_model_path
    from shared.tokenizer import Tokenizer
    from tools.tuner.validate import make_slice, run_validation

    vocab = Tokenizer.from_gguf(default_model_path()).vocab_size
    sl = make_slice(trace.name, trace, profile, vocab, count=count, length_scale=length_scale)
    return run_validation([sl], profile, vocab)[trace.name]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
