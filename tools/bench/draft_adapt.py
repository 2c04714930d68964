"""Online adaptation: retrain the draft head from the rolling training log, gate it, install it.

One round: when the log has gained enough turns since the last round, the head in service
(the file the decode pools watch) goes on training on the log's most recent turns (a warm
start, head_train.train_head's `init`: each round adds its CPU budget's steps to what the
rounds before learned, which is how a CPU that trains ~450 steps in half an hour still gets a
head trained for thousands), the candidate is replayed by the same gate as `splitserve draft
gate` on the held-out chats, and only an accepted one is installed (atomically; the pools swap
it in between steps). Every round that ran is one JSON line of the history file beside the
served head: what it trained on, how long, the gate's figures and verdict, what it installed.

The held-out split is by a hash of each chat's first prompt (training_log.split_heldout), the
same in every round, so a chat the gate replays was never trained on in any round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.speculative.head_file import HeadFile
from engine.speculative.head_train import HeadTrainReport
from shared.training_log import Conversation
from tools.bench.draft_gate import GateVerdict, install

# (turns to train on, head to go on from or None, where to write) -> the trained candidate
Trainer = Callable[[Sequence[Conversation], HeadFile | None, Path], HeadTrainReport]
# (candidate, the head in service or None) -> the verdict
Gate = Callable[[Path, Path | None], GateVerdict]
# the head in service, or None and why not (missing, unreadable, another target's)
ServedReader = Callable[[Path], tuple[HeadFile | None, str]]


@dataclass(frozen=True)
class AdaptPolicy:
    # A round needs this many turns logged since the last one: fewer would retrain on
    # nearly the same traffic and spend a round's CPU on a replay's noise.
    min_new_turns: int = 200
    # The rolling window: the most recent turns only, so the head follows what the app's
    # users do now, and a round's state recomputation stays bounded.
    window_turns: int = 20_000
    # Start from the target's last layer instead of the head in service.
    fresh: bool = False

    def __post_init__(self) -> None:
        if self.min_new_turns < 1:
            raise ValueError(f"min_new_turns must be >= 1, got {self.min_new_turns}")
        if self.window_turns < 2:
            raise ValueError(f"window_turns must be >= 2, got {self.window_turns}")


def history_path(served: Path) -> Path:
    return served.with_name(served.name + ".adapt.jsonl")


def read_history(path: Path) -> list[dict]:
    """The rounds recorded so far (a torn last line, from a killed round, is skipped)."""
    if not path.is_file():
        return []
    rounds = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rounds.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rounds


def due(logged_turns: int, history: list[dict], policy: AdaptPolicy) -> tuple[bool, str]:
    """Whether a round should run now, and why (not)."""
    last = history[-1]["log_turns"] if history else 0
    new = logged_turns - last
    if logged_turns < last:  # the log was rotated: whatever it holds is new
        new = logged_turns
    if new < policy.min_new_turns:
        return False, f"{new} turns logged since the last round, {policy.min_new_turns} needed"
    return True, f"{new} turns logged since the last round"


def run_round(
    conversations: Sequence[Conversation],
    served: Path,
    train: Trainer,
    gate: Gate,
    read_served: ServedReader,
    policy: AdaptPolicy,
    log: Callable[[str], None] = print,
) -> dict:
    """Train, gate and (if accepted) install one candidate; returns the history record, which
    is appended to the history file too. `conversations`: the whole log, oldest first."""
    started, wall = time.process_time(), time.monotonic()
    window = list(conversations[-policy.window_turns :])
    init, why = (None, "fresh start asked for") if policy.fresh else read_served(served)
    if init is None:
        log(f"[adapt] training from the target's last layer: {why}")
    else:
        log(f"[adapt] going on from the head in service, version {init.version}")
    candidate = served.with_name(served.name + ".candidate")
    report = train(window, init, candidate)
    train_cpu_s = time.process_time() - started
    verdict = gate(candidate, served if served.is_file() else None)
    record = {
        "time": round(time.time(), 3),
        "log_turns": len(conversations),
        "window_turns": len(window),
        "continued_from": init.version if init else None,
        "steps": report.steps,
        "heldout_agreement": round(report.heldout_agreement, 4),
        "initial_agreement": round(report.initial_agreement, 4),
        "train_cpu_s": round(train_cpu_s, 1),
        "accepted": verdict.accepted,
        "reasons": verdict.reasons,
        "runs": verdict.as_json()["runs"],
        "installed": None,
    }
    if verdict.accepted:
        record["installed"] = str(install(candidate, served))
    candidate.unlink(missing_ok=True)
    record["wall_s"] = round(time.monotonic() - wall, 1)
    path = history_path(served)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
    return record
