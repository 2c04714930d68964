"""The draft head `splitserve bench spec` measures as method `head`: trained on a training log
of chat traffic the bench replays itself, never on the replies it times.

The log holds (1) the earlier turns of the bench's chat conversations with the target's own
replies (the replay load_prompt_sets runs anyway; the timed prompts are the *last* turns,
whose replies are never logged), (2) the bundled persona chat prompts
(engine/speculative/data/draft_prompts.jsonl), each followed by `follow_up_turns` more turns
whose user messages the target writes itself (simulated_users.py), and (3) editing-app requests
(editing_tasks.py: copy-with-edits traffic like the timed grounded set, on other texts), each
with the target's greedy replies: app-like traffic, written through the same
TrainingLogWriter the coordinator uses. Without (3) the head learnt chat only and lost on
grounded (0.91x, session 9); a copying reply is where a head's chains run longest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.core.engine import Engine
from engine.model.gguf_file import Checkpoint
from engine.model.llama import LlamaModel
from engine.speculative.draft_data import DEFAULT_PROMPTS
from engine.speculative.head_train import HeadTrainConfig, HeadTrainReport, train_head
from shared.sampling.params import SamplingParams
from shared.tokenizer import Tokenizer
from shared.training_log import LoggedTurn, TrainingLogWriter, read_training_log
from tools.bench.editing_tasks import editing_conversations
from tools.bench.simulated_users import Message, follow_ups, message_text


@dataclass
class BenchHead:
    path: Path
    log_path: Path
    logged_turns: int
    replay_seconds: float  # wall seconds the target spent writing the logged replies
    report: HeadTrainReport

    def as_json(self) -> dict:
        r = self.report
        return {
            "path": str(self.path),
            "size_bytes": self.path.stat().st_size,
            "log": str(self.log_path),
            "logged_turns": self.logged_turns,
            "replay_s": round(self.replay_seconds, 1),
            "train_cpu_s": round(r.elapsed_s, 1),
            "train_wall_s": round(r.wall_s, 1),
            "train_reply_tokens": r.train_tokens,
            "heldout_reply_tokens": r.heldout_tokens,
            "steps": r.steps,
            "heldout_first_guess_agreement": round(r.heldout_agreement, 4),
            "initial_first_guess_agreement": round(r.initial_agreement, 4),
            # What this machine trained in, and the step times that chose it (machines
            # differ: bf16 wins where the CPU has bf16 arithmetic, loses badly where not).
            "precision": r.extra.get("precision"),
            "step_seconds": r.extra.get("step_seconds"),
        }


def persona_conversations(limit: int | None = None) -> list[list[Message]]:
    """The bundled persona chat prompts as messages (each ends with a user turn)."""
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    return [row["messages"] for row in rows][:limit]


def write_replay_log(
    log_path: Path,
    replay: Engine,
    tokenizer: Tokenizer,
    model_id: str,
    earlier_turns: list[tuple[list[int], list[int]]],
    reply_tokens: int,
    max_prompts: int | None = None,
    editing_tokens: int | None = None,
    follow_up_turns: int = 0,
) -> tuple[int, float]:
    """The training log of replayed traffic; returns (turns logged, replay wall seconds).
    `editing_tokens` caps the editing replies (default `reply_tokens`): they copy a whole
    passage, so they run longer than a chat reply. `follow_up_turns`: turns added to each
    persona conversation, the user's side written by the target (simulated_users.py)."""
    log_path.unlink(missing_ok=True)
    writer = TrainingLogWriter(log_path, 1.0)
    writer.write([LoggedTurn(model_id, "default", p, r) for p, r in earlier_turns])

    def logged(turns: list[tuple[list[int], list[int]]]) -> None:
        writer.write([LoggedTurn(model_id, "default", p, r) for p, r in turns])

    start = time.monotonic()
    chats = persona_conversations(max_prompts)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in chats]
    replies = replay.generate(prompts, SamplingParams(temperature=0.0, max_tokens=reply_tokens))
    logged(list(zip(prompts, replies, strict=True)))
    histories = [
        [*c, {"role": "assistant", "content": message_text(tokenizer, r)}]
        for c, r in zip(chats, replies, strict=True)
    ]
    for turn in range(follow_up_turns):
        added = follow_ups(replay, tokenizer, histories, reply_tokens, seed=turn * len(chats))
        logged([(p, r) for _, p, r in added])
        histories = [h for h, _, _ in added]
    editing = [
        tokenizer.encode(tokenizer.apply_chat_template(c))
        for c in editing_conversations(max_prompts)
    ]
    cap = editing_tokens or reply_tokens
    edits = replay.generate(editing, SamplingParams(temperature=0.0, max_tokens=cap))
    logged(list(zip(editing, edits, strict=True)))
    return writer.written, time.monotonic() - start


def train_bench_head(
    checkpoint: Checkpoint,
    tokenizer: Tokenizer,
    log_path: Path,
    out: Path,
    minutes: float,
    replay: tuple[int, float],
    log: Callable[[str], None],
    serving: LlamaModel | None = None,
) -> BenchHead:
    turns = read_training_log(log_path)
    report = train_head(
        checkpoint,
        [t.conversation for t in turns],
        out,
        tokenizer.fingerprint,
        tokenizer.stop_token_ids,
        HeadTrainConfig(max_minutes=minutes),
        log,
        serving,
    )
    return BenchHead(report.path, log_path, replay[0], replay[1], report)
