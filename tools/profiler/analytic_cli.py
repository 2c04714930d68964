"""`splitserve profile --analytic`: write a roofline-derived profile and say what it rests on."""

from __future__ import annotations

import argparse
import json

from services.planner.replica_profile import ProfileError, ReplicaProfile, load_profile
from tools.profiler.model_shape import read_model_shape


def run_analytic(args: argparse.Namespace) -> int:
    if bool(args.gpu) == bool(args.cpu):
        raise ProfileError("--analytic needs exactly one of --gpu NAME or --cpu")
    from shared.modelfile.default import default_model_path

    shape = read_model_shape(args.model or default_model_path())
    if args.gpu:
        profile = _gpu(args, shape)
    else:
        profile = _cpu(args, shape)
    profile.save(args.json)
    a = profile.meta["analytic"]
    print(f"analytic profile of {shape.name} [{shape.config_hash}] on {a['machine']['name']}")
    print(f"prefill 1k tokens alone: {profile.prefill_ms(1024):.1f} ms")
    print(f"decode step, batch 8 at 1k context: {profile.decode.step(8, 8 * 1024):.2f} ms")
    print(f"KV capacity: {profile.kv_capacity_tokens:,} tokens")
    print(f"fit max relative error: {json.dumps(profile.meta['fit_max_rel_error'])}")
    if "calibration" in profile.meta:
        c = profile.meta["calibration"]
        print(
            "calibrated against the measured profile: leave-one-out error prefill "
            f"{c['prefill_mean_error']:.1%} mean / {c['prefill_max_error']:.1%} max, decode "
            f"{c['decode_mean_error']:.1%} mean / {c['decode_max_error']:.1%} max"
        )
    print(f"profile written to {args.json}")
    return 0


def _gpu(args: argparse.Namespace, shape) -> ReplicaProfile:
    from tools.profiler import analytic_gpu

    options = {}
    if args.compute_efficiency is not None:
        options["compute_efficiency"] = args.compute_efficiency
    if args.memory_efficiency is not None:
        options["memory_efficiency"] = args.memory_efficiency
    return analytic_gpu.gpu_profile(
        shape,
        args.gpu,
        weights=args.weights or "bf16",
        tp=args.tp,
        link=args.interconnect,
        **options,
    )


def _cpu(args: argparse.Namespace, shape) -> ReplicaProfile:
    from tools.profiler.analytic_cpu import cpu_profile, measure_peaks

    if args.measured:
        measured = load_profile(args.measured)
    else:
        from tools.profiler.local import profile_of_this_machine

        measured, _, _ = profile_of_this_machine(
            args.weights or "auto", args.threads, quick=True, model_path=args.model
        )
    profile, _ = cpu_profile(shape, measured, measure_peaks(args.threads))
    return profile
