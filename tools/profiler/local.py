"""A measured profile of this machine, measured once per signature and cached.

`bench tune --live` compares the simulator with a stack on this machine, so it must simulate
this machine: a profile measured elsewhere (the shipped one included) would make the check
about the other machine. The cache is keyed by what the signature holds before measuring
(CPU model and flags, cores, threads, the weights asked for, the model's shape, the KV type),
the native kernels' source and the format chooser's version (what `auto` resolves to and how
fast it runs) plus the grid, so a new machine, model, thread count or kernel measures anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from kernels.native.build import cache_dir as native_cache_dir
from kernels.native.build import source_digest as native_source_digest
from services.planner.replica_profile import ProfileError, ReplicaProfile, load_profile
from tools.profiler.model_shape import read_model_shape
from tools.profiler.signature import cpu_here

# Bump when what a profile measures changes. 2: `auto` is chosen for the served KV type (1's
# profiles timed the fp32 pool's choice, not what the replicas ran).
PROFILE_CACHE_VERSION = 2


def cache_path(weights: str, threads: int, quick: bool, model_path: str | None = None) -> Path:
    from engine.kvcache.kv_dtype import resolve_kv_dtype
    from engine.model.formats import CHOOSER_VERSION
    from shared.modelfile.default import default_model_path

    shape = read_model_shape(model_path or default_model_path())
    kv = str(resolve_kv_dtype("auto")[0]).removeprefix("torch.")  # what a replica serves with
    key = cpu_here(threads, weights, shape, kv).to_dict() | {
        "quick": quick,
        "version": PROFILE_CACHE_VERSION,
        "kernels": native_source_digest(),
        # A forced native build (the AVX2 path on an AVX-512 machine) runs other kernels.
        "native_flags": os.environ.get("SPLITSERVE_NATIVE_CFLAGS", ""),
        "chooser": CHOOSER_VERSION,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return native_cache_dir().parent / "profiles" / f"profile-{digest}.json"


def profile_of_this_machine(
    weights: str = "auto", threads: int = 1, quick: bool = True, model_path: str | None = None
) -> tuple[ReplicaProfile, str, bool]:
    """(profile, where it is stored, whether it came from the cache). A full-grid profile in
    the cache is preferred over measuring a quick one."""
    grids = (False, True) if quick else (False,)
    for q in grids:
        path = cache_path(weights, threads, q, model_path)
        if path.is_file():
            try:
                return load_profile(path), str(path), True
            except ProfileError as exc:
                print(f"[profile] ignoring unreadable cached profile: {exc}", file=sys.stderr)
    from tools.profiler.run import run_profile

    print(
        "[profile] no profile of this machine cached: measuring one "
        f"({'quick grid, about a minute' if quick else 'full grid'})",
        file=sys.stderr,
    )
    profile = run_profile(weights=weights, model_path=model_path, threads=threads, quick=quick)
    path = cache_path(weights, threads, quick, model_path)
    profile.save(path)
    return profile, str(path), False
