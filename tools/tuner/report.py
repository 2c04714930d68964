"""What `splitserve tune` prints and writes: the recommendation, the chart values to paste,
and every configuration it simulated."""

from __future__ import annotations

from tools.tuner.search import Evaluation, TuneResult

PREDICTED_KEYS = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p90_ms",
    "itl_p99_ms",
    "itl_mean_ms",
)


def values_snippet(model_id: str, best: Evaluation) -> str:
    """The Helm values for this model's pools (helm/splitserve values.yaml `pools`)."""
    return f'pools:\n  {model_id}:\n    total: {best.replicas}\n    ratio: "{best.ratio}"\n'


def tune_json(result: TuneResult, model_id: str) -> dict:
    best = result.best
    return {
        "model": model_id,
        "recommended_ratio": best.ratio,
        "prefill_replicas": best.prefill,
        "decode_replicas": best.decode,
        "replicas": best.replicas,
        "meets_slo": result.meets_slo,
        "message": result.message,
        "slo": result.slo.targets,
        "max_replicas": result.max_replicas,
        "predicted": {k: best.latency.get(k) for k in PREDICTED_KEYS},
        "predicted_all_requests": best.summary,
        "requests_per_s_simulated": result.requests_per_s_simulated,
        "requests_simulated": result.requests_simulated,
        "sim_wall_s": result.sim_wall_s,
        "evaluations": [
            {
                "ratio": e.ratio,
                "prefill_replicas": e.prefill,
                "decode_replicas": e.decode,
                "ttft_p99_ms": e.latency.get("ttft_p99_ms"),
                "itl_p99_ms": e.latency.get("itl_p99_ms"),
                "violation": e.violation,
                "meets_slo": e.meets,
            }
            for e in result.evaluations
        ],
        "values_snippet": values_snippet(model_id, best),
    }


def print_report(
    result: TuneResult, model_id: str, basis: dict | None = None, cost: dict | None = None
) -> None:
    best = result.best
    print(f"\nsplitserve tune: SLO {result.slo.describe()}")
    if basis is not None:
        print(f"rests on: {basis['description']}")
        if not basis["check"]["matches"]:
            print(f"  (differs from {basis['check']['against']}: see the warning above)")
    print(f"{'prefill:decode':>15} {'ttft_p99_ms':>12} {'itl_p99_ms':>11} {'vs SLO':>7}")
    for e in result.evaluations:
        mark = "  <- recommended" if e is best and result.meets_slo else ""
        if e is best and not result.meets_slo:
            mark = "  <- closest"
        print(
            f"{e.ratio:>15} {_fmt(e.latency.get('ttft_p99_ms')):>12} "
            f"{_fmt(e.latency.get('itl_p99_ms')):>11} {e.violation:>6.2f}x{mark}"
        )
    print(f"\n{result.message}")
    if cost is not None:
        print(
            f"cost: {cost['gpus']} GPUs at ${cost['usd_per_gpu_hour']:.2f}/GPU-hour "
            f"({cost['price_source']}): ${cost['usd_per_million_tokens']:.4f} per million "
            f"tokens, ${cost['usd_per_million_output_tokens']:.4f} per million output tokens"
        )
    print(
        f"simulated {result.requests_simulated:,} requests in {result.sim_wall_s:.1f} s "
        f"({result.requests_per_s_simulated:,.0f} requests/s)"
    )
    if result.meets_slo:
        print("\nPaste into the chart's values:\n")
    else:
        print("\nClosest configuration (does NOT meet the SLO):\n")
    print(values_snippet(model_id, best))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
