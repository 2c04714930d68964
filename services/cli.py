"""The `splitserve` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys

# Before anything loads torch (and with it OpenMP): by default OpenMP's threads spin for a
# while after each parallel op, and on a small box that spinning takes the very core the
# native decode step's second thread needs next (measured: a 512-context decode step 14.0 ms
# spinning vs 10.0 ms passive on 2 cores). An operator's own setting wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    # Marks the setting as ours, so a peer we benchmark runs with the user's own environment.
    os.environ["SPLITSERVE_OMP_WAIT_POLICY"] = "set"

from services.commands import bench_cmd, generate_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated prefill/decode LLM serving for realtime consumer chat.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    generate_cmd.add_command(sub)
    bench_cmd.add_command(sub)
    for module, func in _LATER_COMMANDS:
        _add_optional(sub, module, func)
    return parser


# Commands whose modules are imported lazily so `splitserve generate` starts fast.
_LATER_COMMANDS: list[tuple[str, str]] = [
    ("shared.quality.cli", "add_eval_command"),
    ("services.commands.serve_cmd", "add_commands"),
    ("services.commands.planner_cmd", "add_commands"),
    ("services.commands.trace_cmd", "add_commands"),
    ("services.commands.tune_cmd", "add_commands"),
    ("services.commands.draft_cmd", "add_command"),
]


def _add_optional(sub, module: str, func: str) -> None:
    import importlib

    getattr(importlib.import_module(module), func)(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
