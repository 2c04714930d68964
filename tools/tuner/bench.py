"""`splitserve bench tune`: the tuner on the two traces in `traces/`, how fast it simulates,
and how far its predictions are from a live local run of a short slice of each.

The traces come from fleets of large models on GPUs; the profile is a 135M model on one CPU
thread. So each trace is mapped onto this hardware by a length scale (fewer tokens per
request, same arrival pattern and length mix) chosen so the recommended fleet is a few to a
few tens of replicas, and the SLO is set from the profile: TTFT p99 within
`TTFT_SLO_FACTOR` of the trace's p99 *unloaded* TTFT (each prompt alone on a replica: the
floor no fleet size can beat) and ITL p99 within `ITL_SLO_FACTOR` of a lone sequence's step.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.planner.replica_profile import ReplicaProfile
from tools.tuner.basis import profile_basis
from tools.tuner.cli_run import load_profile_or_default, profile_summary
from tools.tuner.fleet import FleetConfig
from tools.tuner.report import tune_json
from tools.tuner.search import Evaluator, tune
from tools.tuner.slo import SLO
from tools.tuner.trace import Trace, load_trace

TRACES_DIR = Path(__file__).resolve().parents[2] / "traces"
TTFT_SLO_FACTOR = 2.0
ITL_SLO_FACTOR = 4.0
MAX_REPLICAS = 48
RPS_TARGET = 1700.0
ERROR_TARGET = 0.2
ANALYTIC_ERROR_TARGET = 0.25


@dataclass(frozen=True)
class BenchTrace:
    key: str
    file: str
    length_scale: float
    live_length_scale: float  # for the live slice (capped again at 1500 / 64 tokens)


BENCH_TRACES = (
    BenchTrace("mooncake_conversation", "mooncake_conversation_trace.jsonl", 1 / 32, 1 / 32),
    BenchTrace("azure_conv", "AzureLLMInferenceTrace_conv.csv", 1 / 8, 1 / 8),
)


def bench_slo(trace: Trace, profile: ReplicaProfile) -> SLO:
    unloaded = np.array([profile.lone_ttft_ms(int(n)) for n in trace.input_tokens])
    context = float(np.median(trace.input_tokens + trace.output_tokens // 2))
    lone_step = profile.decode.step(1, context)
    return SLO(
        {
            "ttft_p99_ms": round(TTFT_SLO_FACTOR * float(np.percentile(unloaded, 99))),
            "itl_p99_ms": round(ITL_SLO_FACTOR * lone_step),
        }
    )


def run_bench(
    profile_path: str | None,
    live: bool,
    live_requests: int,
    json_path: str | None,
    plot_dir: str | None = None,
) -> int:
    from tools.bench.report import machine_info, print_table, save_outputs

    profile, used_path, source = _bench_profile(profile_path, live)
    load_before = os.getloadavg()
    report: dict = {
        "profile": profile_summary(profile, used_path) | {"source": source},
        "profile_check": profile_basis(profile, None)["check"],
        "targets": {"requests_per_s_simulated": RPS_TARGET, "sim_vs_live_p50_error": ERROR_TARGET},
        "traces": {},
    }
    originals = {}
    for bt in BENCH_TRACES:
        original = load_trace(TRACES_DIR / bt.file)
        originals[bt.key] = original
        trace = original.scaled(1.0, bt.length_scale, profile.max_context)
        slo = bench_slo(trace, profile)
        print(f"[bench tune] {bt.key}: SLO {slo.describe()}", file=sys.stderr)
        evaluator = Evaluator(trace, profile, slo, FleetConfig(1, 1))
        result = tune(evaluator, MAX_REPLICAS)
        summary = tune_json(result, "SmolLM2-135M-Instruct")
        report["traces"][bt.key] = {
            "requests_per_s_simulated": result.requests_per_s_simulated,
            "requests_simulated": result.requests_simulated,
            "recommended_ratio": summary["recommended_ratio"],
            "replicas": summary["replicas"],
            "prefill_replicas": summary["prefill_replicas"],
            "decode_replicas": summary["decode_replicas"],
            "meets_slo": summary["meets_slo"],
            "slo": slo.targets,
            "predicted": summary["predicted"],
            "length_scale": bt.length_scale,
            "time_scale": 1.0,
            "trace": trace.summary(),
            "evaluations": summary["evaluations"],
            "sim_vs_live_ttft_p50_error": None,
            "sim_vs_live_itl_p50_error": None,
        }
    if live:
        _live(report, originals, profile, live_requests)
    report.update(_analytic_vs_measured(profile))
    report["machine"] = machine_info()
    report["loadavg_before_after"] = [load_before, os.getloadavg()]
    rows = []
    for key, r in report["traces"].items():
        rows.append(
            (
                f"{key} requests/s simulated",
                r["requests_per_s_simulated"],
                RPS_TARGET,
                r["requests_per_s_simulated"] / RPS_TARGET,
            )
        )
        rows.append((f"{key} recommended", r["recommended_ratio"], r["replicas"], None))
        for k in ("ttft", "itl"):
            err = r[f"sim_vs_live_{k}_p50_error"]
            rows.append((f"{key} sim vs live {k} p50 err", err, ERROR_TARGET, None))
    err = report.get("analytic_vs_measured_error")
    rows.append(("analytic vs measured step time err", err, ANALYTIC_ERROR_TARGET, None))
    print_table("splitserve bench tune (ours vs target)", rows)
    save_outputs("tune", report, json_path, plot_dir)
    return 0


def _bench_profile(path: str | None, live: bool) -> tuple[ReplicaProfile, str, str]:
    """The profile to simulate: the one asked for; for a live check without one, a profile
    of this machine (cached per signature, else measured now: the check is about this
    machine, so a foreign profile would make it about another); else the shipped one."""
    if path is None and live:
        from tools.profiler.local import profile_of_this_machine

        profile, stored, cached = profile_of_this_machine("auto", threads=1, quick=True)
        return profile, stored, "this machine, " + ("cached" if cached else "measured now")
    profile, used = load_profile_or_default(path)
    return profile, used, "given" if path else "shipped"


def _analytic_vs_measured(profile: ReplicaProfile) -> dict:
    """The calibrated analytic CPU model's leave-one-out error on the profile's own points."""
    from shared.modelfile.default import default_model_path
    from tools.profiler.analytic_cpu import calibrate, measure_peaks
    from tools.profiler.model_shape import read_model_shape

    if profile.meta.get("kind", "measured") != "measured" or not profile.measurements:
        return {"analytic_vs_measured_error": None}
    model = profile.meta.get("model")
    shape = read_model_shape(model if model and Path(model).exists() else default_model_path())
    calibration = calibrate(shape, profile, measure_peaks(int(profile.meta.get("threads", 1))))
    return {
        "analytic_vs_measured_error": calibration.error,
        "analytic_vs_measured": calibration.report(),
    }


def _live(report: dict, originals: dict, profile: ReplicaProfile, count: int) -> None:
    from shared.modelfile.default import default_model_path
    from shared.tokenizer import Tokenizer
    from tools.tuner.validate import make_slice, run_validation

    vocab = Tokenizer.from_gguf(default_model_path()).vocab_size
    slices = [
        make_slice(bt.key, originals[bt.key], profile, vocab, count, 0, bt.live_length_scale)
        for bt in BENCH_TRACES
    ]
    print(
        f"[bench tune] live: {len(slices)} slices of {count} requests, one stack", file=sys.stderr
    )
    results = run_validation(slices, profile, vocab)
    report["live_check_note"] = (
        f"one local stack (1 prefill + 1 decode replica, 1 thread each), one {count}-request "
        "slice per trace replayed on it in turn; the simulator runs on the profile anchored "
        "to the stack's speed by isolated probes before and after each slice (see "
        "tools/tuner/calibrate.py); errors with the profile as measured are under "
        "live_check.as_profiled"
    )
    for key, result in results.items():
        entry = report["traces"][key]
        entry["sim_vs_live_ttft_p50_error"] = result["sim_vs_live_ttft_p50_error"]
        entry["sim_vs_live_itl_p50_error"] = result["sim_vs_live_itl_p50_error"]
        entry["live_check"] = result
