"""PIQA scored by log-likelihood, as lm-evaluation-harness scores it.

Each item is a question with two solutions; a model picks the solution whose tokens it finds
more likely after `Question: {goal}\\nAnswer:`. Tokenisation follows the harness: the context
and context+continuation are encoded separately and the continuation is the tail of the
latter, so the numbers are comparable with published harness figures (the harness's `acc`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources

import torch

from engine.model.llama import LlamaModel
from engine.quality.forward import BranchedSequence, forward_hidden, head_logits, length_batches
from engine.quality.text_encoder import TextEncoder

PIQA_FILE = "piqa_valid_labeled.jsonl"
# Rows per padded forward batch: on 2 cores, 512-1024 rows ran ~1.5x faster than 64 (larger
# matmuls, and the lm_head matrix is read once per batch).
BATCH_ROWS = 1024

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PiqaItem:
    goal: str
    sol1: str
    sol2: str
    label: int  # 0 -> sol1 is right, 1 -> sol2

    @property
    def context(self) -> str:
        return f"Question: {self.goal}\nAnswer:"

    @property
    def continuations(self) -> tuple[str, str]:
        return f" {self.sol1}", f" {self.sol2}"


def load_piqa(limit: int | None = None) -> list[PiqaItem]:
    """The PIQA validation items bundled with this package, in file order."""
    text = resources.files("engine.quality").joinpath("data", PIQA_FILE).read_text("utf-8")
    items = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        raw = json.loads(line)
        if raw["label"] not in (0, 1):
            raise ValueError(f"{PIQA_FILE}:{line_no}: label {raw['label']!r} is not 0 or 1")
        items.append(PiqaItem(raw["goal"], raw["sol1"], raw["sol2"], int(raw["label"])))
    return items if limit is None else items[:limit]


def encode_item(encoder: TextEncoder, item: PiqaItem) -> BranchedSequence:
    context = encoder.encode(item.context)
    branches = []
    for continuation in item.continuations:
        whole = encoder.encode(item.context + continuation)
        branches.append(tuple(whole[len(context) :]))
    return BranchedSequence(tuple(context), tuple(branches))


@dataclass(frozen=True)
class PiqaScores:
    loglikelihoods: torch.Tensor  # [items, 2] float64, summed over each solution's tokens
    labels: torch.Tensor  # [items] int64

    @property
    def choices(self) -> torch.Tensor:
        # A tie goes to the first solution, as the harness's argmax does.
        return (self.loglikelihoods[:, 1] > self.loglikelihoods[:, 0]).long()

    @property
    def correct(self) -> torch.Tensor:
        return self.choices == self.labels

    @property
    def accuracy(self) -> float:
        return float(self.correct.double().mean())

    @property
    def items(self) -> int:
        return int(self.labels.shape[0])


def _prediction_rows(seq: BranchedSequence) -> tuple[list[int], list[int], list[int]]:
    """(row, target token, branch index) for every branch token of one sequence."""
    rows: list[int] = []
    targets: list[int] = []
    branch_of: list[int] = []
    for k, branch in enumerate(seq.branches):
        # Branch token i is predicted from the row before it: the trunk's last row for i == 0.
        before = [len(seq.trunk) - 1, *list(seq.branch_rows(k))[:-1]]
        rows += before[: len(branch)]
        targets += branch
        branch_of += [k] * len(branch)
    return rows, targets, branch_of


def _batch_loglikelihoods(
    model: LlamaModel,
    seqs: Sequence[BranchedSequence],
    hidden: list[torch.Tensor],
    max_linear_rows: int | None,
) -> torch.Tensor:
    """[len(seqs), branches] summed log p(branch tokens | trunk)."""
    rows: list[int] = []
    targets: list[int] = []
    segments: list[int] = []
    width = max(len(s.branches) for s in seqs)
    offset = 0
    for i, seq in enumerate(seqs):
        r, t, b = _prediction_rows(seq)
        rows += [offset + x for x in r]
        targets += t
        segments += [i * width + k for k in b]
        offset += seq.num_rows
    # One lm_head call per batch: the 49k-row head matrix is read once, not once per item.
    picked_hidden = torch.cat(hidden)[rows]
    logprobs = head_logits(model, picked_hidden, max_linear_rows).log_softmax(-1)
    token_lp = logprobs[torch.arange(len(rows)), torch.tensor(targets)].double()
    sums = torch.zeros(len(seqs) * width, dtype=torch.float64)
    sums.index_add_(0, torch.tensor(segments, dtype=torch.long), token_lp)
    return sums.view(len(seqs), width)


@torch.inference_mode()
def score_piqa(
    model: LlamaModel,
    encoder: TextEncoder,
    items: Sequence[PiqaItem],
    max_linear_rows: int | None = None,
    progress: Progress | None = None,
) -> PiqaScores:
    seqs = [encode_item(encoder, item) for item in items]
    if any(not s.trunk for s in seqs):
        raise ValueError("a PIQA context encoded to no tokens")
    lls = torch.zeros(len(seqs), 2, dtype=torch.float64)
    done = 0
    for batch in length_batches(seqs, BATCH_ROWS):
        batch_seqs = [seqs[i] for i in batch]
        hidden = forward_hidden(model, batch_seqs, max_linear_rows)
        lls[batch] = _batch_loglikelihoods(model, batch_seqs, hidden, max_linear_rows)
        done += len(batch)
        if progress is not None:
            progress(done, len(seqs))
    labels = torch.tensor([item.label for item in items], dtype=torch.long)
    return PiqaScores(lls, labels)
