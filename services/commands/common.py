"""Arguments and error reporting every subcommand shares."""

from __future__ import annotations

import argparse
import sys

from shared.model.linear import WEIGHT_FORMATS


def add_model_args(parser: argparse.ArgumentParser, default_weights: str = "fp32") -> None:
    parser.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2)"
    )
    parser.add_argument("--weights", default=default_weights, choices=WEIGHT_FORMATS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def fail(message: str, code: int = 2) -> int:
    print(f"splitserve: error: {message}", file=sys.stderr)
    return code
