"""The training log: finished requests as token ids, for training a draft on real traffic.

Written by the coordinator when the operator turns `capture.training_log` on (it is off by
default); read by `splitserve draft train --from-log`. A fleet's coordinators each append to
their own file (`{host}` in the configured path becomes the host name, a Kubernetes pod's
name), since appends from several machines to one file on a shared volume may interleave; a
reader given the folder merges every file in it by record time. One JSON line per finished choice:
{"v": 1, "time": unix seconds, "model": id, "tier": service tier, "prompt_token_ids": [...],
"completion_token_ids": [...]}. Token ids only: no text, no key, no user, no request id, so
the log says nothing a tokenizer-less reader could join with anything else; the ids still
encode the conversation, which is why it is opt-in (README: consent and retention).

Torch-free on purpose: the coordinator imports it (tests/unit/test_import_contract.py).
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOG_VERSION = 1
# The one placeholder a configured log path may hold: each process's own file.
HOST_PLACEHOLDER = "{host}"
Conversation = tuple[list[int], int]  # (prompt + completion ids, prompt length)


class TrainingLogError(ValueError):
    """The log is missing or has a line that is not a training-log record."""


@dataclass(frozen=True)
class LoggedTurn:
    model: str
    tier: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logged_at: float = 0.0  # unix seconds (the record's "time"; 0 where written by hand)

    @property
    def conversation(self) -> Conversation:
        """(prompt + completion, prompt length): what the head trainer reads."""
        return self.prompt_token_ids + self.completion_token_ids, len(self.prompt_token_ids)


class TrainingLogWriter:
    """Appends sampled finished requests; safe to call from several threads."""

    def __init__(self, path: str | Path, sample_ratio: float, rng: random.Random | None = None):
        if not 0.0 <= sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in [0, 1], got {sample_ratio}")
        self.path = log_file_path(path)
        self.sample_ratio = sample_ratio
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.written = 0

    def sampled(self) -> bool:
        """One draw per request: all of a request's choices are logged, or none."""
        with self._lock:
            return self._rng.random() < self.sample_ratio

    def write(self, turns: list[LoggedTurn]) -> None:
        lines = "".join(
            json.dumps(
                {
                    "v": LOG_VERSION,
                    "time": round(time.time(), 3),
                    "model": t.model,
                    "tier": t.tier,
                    "prompt_token_ids": t.prompt_token_ids,
                    "completion_token_ids": t.completion_token_ids,
                },
                separators=(",", ":"),
            )
            + "\n"
            for t in turns
            if t.completion_token_ids
        )
        if not lines:
            return
        # One write per request, under the lock: lines of concurrent requests never interleave.
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(lines)
            self.written += lines.count("\n")


def log_file_path(path: str | Path, host: str | None = None) -> Path:
    """The file this process appends to: `path` with `{host}` replaced by the host name."""
    text = str(path)
    if HOST_PLACEHOLDER in text:
        text = text.replace(HOST_PLACEHOLDER, host or socket.gethostname())
    return Path(text).expanduser()


def read_training_log(path: str | Path, model: str | None = None) -> list[LoggedTurn]:
    """Every record of the log (of `model` only, when given). `path` is one file, or a folder
    whose `*.jsonl` files (one per coordinator) are merged, oldest record first."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise TrainingLogError(f"{path}: no training log (*.jsonl) in this folder")
        turns = [t for f in files for t in _read_file(f, model)]
        turns.sort(key=lambda t: t.logged_at)  # stable: one file's equal times keep their order
        return turns
    if not path.is_file():
        raise TrainingLogError(f"{path}: training log does not exist")
    return _read_file(path, model)


def _read_file(path: Path, model: str | None) -> list[LoggedTurn]:
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    # The text after the last newline is a record still being appended (a coordinator writes
    # while rounds of `draft adapt` read) or one its writer was killed in: not a record yet.
    complete = lines[:-1]
    turns = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turn = LoggedTurn(
                model=str(row["model"]),
                tier=str(row["tier"]),
                prompt_token_ids=[int(t) for t in row["prompt_token_ids"]],
                completion_token_ids=[int(t) for t in row["completion_token_ids"]],
                logged_at=float(row.get("time", 0.0)),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TrainingLogError(f"{path}:{number}: not a training-log record ({exc})") from None
        if row.get("v") != LOG_VERSION:
            raise TrainingLogError(f"{path}:{number}: log version {row.get('v')!r} unknown")
        if model is None or turn.model == model:
            turns.append(turn)
    return turns


def is_heldout(prompt_token_ids: list[int], fraction: float) -> bool:
    """Whether a chat whose first prompt this is is held out, by a stable hash of the prompt
    (whatever order the log is read in): see split_heldout."""
    digest = zlib.crc32(",".join(map(str, prompt_token_ids)).encode())
    return digest % 10_000 < fraction * 10_000


def group_chats(conversations: Sequence[Conversation]) -> list[list[Conversation]]:
    """The logged turns grouped by chat, each chat's turns in order: a chat's next request
    resends the last one's prompt (and its reply) and adds to it, so a turn whose ids begin
    with the previous turn's prompt, in sorted order, continues that chat. (A client that
    rewrote its history starts a new chat here; nothing is lost, only shared less.)"""
    chats: list[list[Conversation]] = []
    for ids, prompt_len in sorted(conversations, key=lambda c: c[0]):
        if chats:
            last_ids, last_prompt = chats[-1][-1]
            if len(ids) > last_prompt and ids[:last_prompt] == last_ids[:last_prompt]:
                chats[-1].append((ids, prompt_len))
                continue
        chats.append([(ids, prompt_len)])
    return chats


def split_heldout(
    conversations: Sequence[Conversation], fraction: float
) -> tuple[list[list[Conversation]], list[list[Conversation]]]:
    """(held-out chats, training chats), whole chats at a time by their first prompt's hash:
    a later turn resends the earlier ones, so splitting turn by turn would train on a
    held-out reply as part of a later prompt. The trainer never trains on the held-out chats
    and `splitserve draft gate` replays exactly their turns."""
    held: list[list[Conversation]] = []
    train: list[list[Conversation]] = []
    for chat in group_chats(conversations):
        first_ids, first_prompt = chat[0]
        (held if is_heldout(first_ids[:first_prompt], fraction) else train).append(chat)
    return held, train
