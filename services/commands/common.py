"""Arguments and error reporting every subcommand shares."""

from __future__ import annotations

import argparse
import sys

# Not imported from shared.model.linear: that pulls in torch (seconds) for every command.
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "auto")


def add_model_args(parser: argparse.ArgumentParser, default_weights: str = "fp32") -> None:
    parser.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2)"
    )
    parser.add_argument("--weights", default=default_weights, choices=WEIGHT_FORMATS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def fail(message: str, code: int = 2) -> int:
    print(f"splitserve: error: {message}", file=sys.stderr)
    return code
