"""A draft head's serving knobs as command-line options.

`splitserve bench spec` and `splitserve draft gate`/`adapt` replay drafting as a pool would:
a head's speed depends on its tree and cutoffs as much as on its weights, so a measurement
must run with the pool's values (unset: the engine's defaults, engine_defaults.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class _Knob:
    flag: str
    field: str  # the speculative section's (and EngineConfig's) name
    kind: type
    low: float
    high: float | None  # None: no upper bound
    help: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def problem(self, value: float) -> str | None:
        if self.high is None:
            return (
                None if value >= self.low else f"{self.flag} must be >= {self.low:g}, got {value}"
            )
        if self.low <= value <= self.high:
            return None
        span = (
            f"{self.low:g}..{self.high:g}" if self.kind is int else f"[{self.low:g}, {self.high:g}]"
        )
        return f"{self.flag} must be in {span}, got {value}"


KNOBS = (
    _Knob("--tree-width", "draft_tree_width", int, 1, 4, "the head's tree width (1 = chains)"),
    _Knob("--min-confidence", "draft_min_confidence", float, 0.0, 1.0, "a chain's cutoff"),
    _Knob("--tree-min-confidence", "draft_tree_min_confidence", float, 0.0, 1.0, "a tree's"),
    _Knob(
        "--tree-max-batch",
        "draft_tree_max_batch",
        int,
        1,
        None,
        "method draft: most decoding sequences a step drafts trees for (chains beyond; "
        "adaptive drafts trees at any batch)",
    ),
)


def add_head_tuning(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    for knob in KNOBS:
        parser.add_argument(
            knob.flag,
            type=knob.kind,
            default=None,
            help=f"{knob.help}: the pool's speculative.{knob.field} (default: the engine's)",
        )


def head_tuning(args: argparse.Namespace) -> dict[str, float] | str:
    """The given knobs by EngineConfig field, or what is wrong with one."""
    tuning: dict[str, float] = {}
    for knob in KNOBS:
        value = getattr(args, knob.dest)
        if value is None:
            continue
        problem = knob.problem(value)
        if problem is not None:
            return problem
        tuning[knob.field] = value
    return tuning
