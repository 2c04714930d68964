"""The `splitserve` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tools.process_defaults import apply_process_defaults

# Before anything loads torch or gRPC (the module says why).
apply_process_defaults()

# Command -> (module defining its parser, the function that adds it). Only the module of the
# command being run is imported (every one for `--help` or an unknown command): `eval`'s
# module loads torch at import, and processes such as `splitserve serve coordinator` must
# start without it.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tools.commands.generate_cmd", "add_command"),
    "bench": ("tools.commands.bench_cmd", "add_command"),
    "eval": ("engine.quality.cli", "add_eval_command"),
    "up": ("tools.commands.serve_cmd", "add_commands"),
    "serve": ("tools.commands.serve_cmd", "add_commands"),
    "planner": ("tools.commands.planner_cmd", "add_commands"),
    "trace": ("tools.commands.trace_cmd", "add_commands"),
    "profile": ("tools.commands.tune_cmd", "add_commands"),
    "tune": ("tools.commands.tune_cmd", "add_commands"),
    "draft": ("tools.commands.draft_cmd", "add_command"),
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
