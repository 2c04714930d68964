"""Environment defaults every splitserve process sets before torch or gRPC load.

Called first by the `splitserve` entry point (tools/cli.py), and by the test suite's
conftest, so in-process engines under test run as served ones do. An operator's own setting
of either variable wins.
"""

from __future__ import annotations

import os

# Marks OMP_WAIT_POLICY as ours, so a peer we benchmark runs with the user's own environment.
OURS_MARKER = "SPLITSERVE_OMP_WAIT_POLICY"


def apply_process_defaults() -> None:
    # OpenMP: by default its threads spin for a while after each parallel op, and on a small
    # box that spinning takes the very core the native decode step's second thread needs
    # next (measured: a 512-context decode step 14.0 ms spinning vs 10.0 ms passive on
    # 2 cores; the speculative tests' file 76 s vs 56 s). Only effective before torch loads.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ[OURS_MARKER] = "set"
    # gRPC: the launcher starts (and restarts) services with a preexec_fn, so Python forks
    # rather than spawns, and gRPC's fork handlers then run in the child before its exec.
    # With gRPC's threads busy (health checks, registrations) they aborted the child: 9 of
    # 60 starts died of SIGABRT in a measured loop, 0 of 60 with fork support off. Nothing
    # here uses gRPC in a forked child (multiprocessing spawns). Only effective before gRPC
    # loads.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
