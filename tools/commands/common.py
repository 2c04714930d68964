"""Arguments and error reporting every subcommand shares."""

from __future__ import annotations

import argparse
import sys

# Not imported from engine.model.linear: that pulls in torch (seconds) for every command.
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "native", "native-a8", "auto")


def add_model_args(parser: argparse.ArgumentParser, default_weights: str = "fp32") -> None:
    parser.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2)"
    )
    parser.add_argument("--weights", default=default_weights, choices=WEIGHT_FORMATS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def fail(message: str, code: int = 2) -> int:
    print(f"splitserve: error: {message}", file=sys.stderr)
    return code


def _parse(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = _parse(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return int(value)


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    value = _parse(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return float(value)
