"""The `splitserve` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Before anything loads torch (and with it OpenMP): by default OpenMP's threads spin for a
# while after each parallel op, and on a small box that spinning takes the very core the
# native decode step's second thread needs next (measured: a 512-context decode step 14.0 ms
# spinning vs 10.0 ms passive on 2 cores). An operator's own setting wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    # Marks the setting as ours, so a peer we benchmark runs with the user's own environment.
    os.environ["SPLITSERVE_OMP_WAIT_POLICY"] = "set"

# Before anything loads gRPC: the launcher starts (and restarts) services with a preexec_fn,
# so Python forks rather than spawns, and gRPC's fork handlers then run in the child before
# its exec. With gRPC's threads busy (health checks, registrations) they aborted the child:
# 9 of 60 starts died of SIGABRT in a measured loop, 0 of 60 with fork support off. Nothing
# here uses gRPC in a forked child (multiprocessing spawns). An operator's setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# Command -> (module defining its parser, the function that adds it). Only the module of the
# command being run is imported (every one for `--help` or an unknown command): `eval`'s
# module loads torch at import, and processes such as `splitserve serve coordinator` must
# start without it.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("services.commands.generate_cmd", "add_command"),
    "bench": ("services.commands.bench_cmd", "add_command"),
    "eval": ("shared.quality.cli", "add_eval_command"),
    "up": ("services.commands.serve_cmd", "add_commands"),
    "serve": ("services.commands.serve_cmd", "add_commands"),
    "planner": ("services.commands.planner_cmd", "add_commands"),
    "trace": ("services.commands.trace_cmd", "add_commands"),
    "profile": ("services.commands.tune_cmd", "add_commands"),
    "tune": ("services.commands.tune_cmd", "add_commands"),
    "draft": ("services.commands.draft_cmd", "add_command"),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (default: this process's arguments)."""
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated prefill/decode LLM serving for realtime consumer chat.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module, func in _registrars(sys.argv[1:] if argv is None else argv):
        getattr(importlib.import_module(module), func)(sub)
    return parser


def _registrars(argv: Sequence[str]) -> list[tuple[str, str]]:
    # The top-level parser takes no option but -h, so a command, if any, is the first word.
    if argv and argv[0] in COMMANDS:
        return [COMMANDS[argv[0]]]
    return list(dict.fromkeys(COMMANDS.values()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
