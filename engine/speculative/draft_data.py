"""Distillation data: the target's own continuations of chat prompts, with its distributions.

The target generates (greedy and sampled) replies with the dense batched decoder of
draft_model.py built with every target layer. Each step's logits are already at hand, so the
teacher's top-k next-token distribution at every output position is recorded for free: no second
teacher-forced pass, and sampled replies still carry the target's own (not the sampled) labels.
Only output positions are labelled, because the draft is only ever asked to continue replies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.speculative.draft_model import BatchKV, DraftModel

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "draft_prompts.jsonl"


class PromptFileError(ValueError):
    """The prompt file is missing or has a line we cannot use."""


@dataclass
class TeacherSample:
    token_ids: list[int]  # prompt + output
    prompt_len: int
    # For output token j: the target's top-k next-token ids / log-probabilities at the position
    # before it, [num_output, k].
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


def load_prompts(path: str | Path, tokenizer=None) -> list[list[int]]:
    """Token-id prompts from a JSONL file: each line {"messages": [...]} (rendered with the
    target's chat template, so needs `tokenizer`) or {"token_ids": [...]}."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("token_ids"), list) and row["token_ids"]:
            prompts.append([int(t) for t in row["token_ids"]])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            if tokenizer is None:
                raise PromptFileError(
                    f"{path}:{number}: chat messages need the model's tokenizer (a GGUF model); "
                    'use {"token_ids": [...]} lines instead'
                )
            prompts.append(tokenizer.encode(tokenizer.apply_chat_template(row["messages"])))
        else:
            raise PromptFileError(
                f'{path}:{number}: expected {{"messages": [...]}} or {{"token_ids": [...]}}'
            )
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


@torch.inference_mode()
def generate_teacher_data(
    teacher: DraftModel,
    prompts: Sequence[list[int]],
    temperatures: Sequence[float],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    deadline: float,
    batch_size: int = 16,
    top_k: int = 8,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[TeacherSample]:
    """One reply per (prompt, temperature) pair, generated batch by batch until `clock()`
    reaches `deadline`; a batch cut short by the deadline keeps what it produced."""
    # Pass r gives prompt i temperature r+i (mod n): a deadline that cuts the run short still
    # leaves a mix of greedy and sampled replies over every kind of prompt.
    n = len(temperatures)
    jobs = [(p, temperatures[(r + i) % n]) for r in range(n) for i, p in enumerate(prompts)]
    gen = torch.Generator().manual_seed(seed)
    samples: list[TeacherSample] = []
    tokens = 0
    for first in range(0, len(jobs), batch_size):
        if clock() >= deadline:
            break
        batch = jobs[first : first + batch_size]

        def tick(batch_tokens: int, done: int = tokens) -> None:
            if progress is not None:
                progress(len(samples), done + batch_tokens)

        for sample in _generate_batch(
            teacher, batch, max_new_tokens, stop_ids, deadline, top_k, gen, clock, tick
        ):
            if sample.num_output > 0:
                samples.append(sample)
                tokens += sample.num_output
        if progress is not None:
            progress(len(samples), tokens)
    return samples


def _generate_batch(
    teacher: DraftModel,
    jobs: list[tuple[list[int], float]],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    deadline: float,
    top_k: int,
    gen: torch.Generator,
    clock: Callable[[], float],
    tick: Callable[[int], None],
) -> list[TeacherSample]:
    b = len(jobs)
    lens = torch.tensor([len(p) for p, _ in jobs])
    ids = torch.zeros(b, int(lens.max()), dtype=torch.long)
    for row, (prompt, _) in enumerate(jobs):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    temps = torch.tensor([t for _, t in jobs])
    kv = BatchKV.empty(teacher.config, b, int(lens.max()) + max_new_tokens)
    hidden = teacher(ids, torch.zeros(b, dtype=torch.long), kv)
    last = hidden[torch.arange(b), lens - 1]
    outputs: list[list[int]] = [[] for _ in range(b)]
    tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    cur = lens.clone()
    for step in range(max_new_tokens):
        if step % 32 == 31:
            tick(sum(len(o) for o in outputs))
        logprobs = torch.log_softmax(teacher.logits(last).float(), dim=-1)
        top_lp, top_ids = logprobs.topk(top_k, dim=-1)
        sampled = torch.multinomial(
            torch.softmax(logprobs / temps.clamp(min=1e-3)[:, None], -1), 1, generator=gen
        )[:, 0]
        token = torch.where(temps > 0, sampled, top_ids[:, 0])
        for row in range(b):
            if not done[row]:
                outputs[row].append(int(token[row]))
                tops[row].append((top_ids[row], top_lp[row]))
                if int(token[row]) in stop_ids:
                    done[row] = True
        if bool(done.all()) or clock() >= deadline:
            break
        last = teacher(token[:, None], cur, kv)[:, 0]
        cur += 1
    return [
        TeacherSample(
            token_ids=list(prompt) + outputs[row],
            prompt_len=len(prompt),
            top_ids=torch.stack([i for i, _ in tops[row]]) if tops[row] else torch.empty(0, top_k),
            top_logprobs=(
                torch.stack([lp for _, lp in tops[row]]) if tops[row] else torch.empty(0, top_k)
            ),
        )
        for row, (prompt, _) in enumerate(jobs)
    ]


def save_samples(path: str | Path, samples: Sequence[TeacherSample], fingerprint: str) -> None:
    """Keep the target's replies: generating them is most of a training run's cost, and a
    second run (other layers, vocabulary, budget) can reuse them."""
    rows = [
        {
            "token_ids": torch.tensor(s.token_ids, dtype=torch.int32),
            "prompt_len": s.prompt_len,
            "top_ids": s.top_ids.to(torch.int32),
            "top_logprobs": s.top_logprobs.to(torch.float16),
        }
        for s in samples
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": "splitserve-draft-data", "version": 1, "fingerprint": fingerprint}
    torch.save(payload | {"samples": rows}, path)


def load_samples(path: str | Path, fingerprint: str) -> list[TeacherSample]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        rows = payload["samples"] if payload.get("format") == "splitserve-draft-data" else None
        if rows is None:
            raise KeyError("format")
        found = str(payload.get("fingerprint"))
        samples = [
            TeacherSample(
                token_ids=r["token_ids"].tolist(),
                prompt_len=int(r["prompt_len"]),
                top_ids=r["top_ids"].long(),
                top_logprobs=r["top_logprobs"].float(),
            )
            for r in rows
        ]
    except Exception as exc:  # any unreadable file means the same thing to the user
        raise PromptFileError(f"{path}: not a draft data file ({type(exc).__name__})") from None
    if found != fingerprint:
        raise PromptFileError(
            f"{path}: replies of a target with tokenizer {found[:16]}, not {fingerprint[:16]}"
        )
    return samples


def build_vocab(
    samples: Sequence[TeacherSample], size: int, always: Sequence[int] = ()
) -> torch.Tensor:
    """The draft vocabulary: `always` (e.g. stop tokens) plus the target ids most often seen in
    replies or as the target's top choice, most frequent first, at most `size` ids."""
    counts: dict[int, int] = {}
    for s in samples:
        for t in s.token_ids[s.prompt_len :]:
            counts[t] = counts.get(t, 0) + 2  # what the target actually emitted weighs more
        for t in s.top_ids[:, :2].flatten().tolist():
            counts[t] = counts.get(t, 0) + 1
    chosen = list(dict.fromkeys(int(t) for t in always))
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    return torch.tensor(chosen[:size], dtype=torch.long)


def target_to_draft_map(vocab_ids: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """[target_vocab] -> draft id; ids outside the draft vocabulary map to the unknown row."""
    mapping = torch.full((target_vocab_size,), len(vocab_ids), dtype=torch.long)
    mapping[vocab_ids] = torch.arange(len(vocab_ids))
    return mapping
