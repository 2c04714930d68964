"""Turns a scheduled step into tensors, runs the model, samples: the only code touching both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata
from shared.engine.scheduler import ScheduledSeq
from shared.kvcache.pool import KVPool
from shared.model.llama import LlamaModel
from shared.sampling.batch import SamplingBatch
from shared.sampling.sampler import SampleOutput, Sampler


@dataclass
class StepResult:
    sampled: list[ScheduledSeq]  # the sequences that got a new token, in row order
    samples: SampleOutput | None
    # Per scheduled sequence that asked for prompt logprobs: logprob of each computed token
    # given the ones before it (positions whose successor was in this step).
    prompt_logprobs: dict[int, list[float]]


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, block_size: int, seed: int = 0):
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.sampler = Sampler(seed=seed)
        self.device = model.device

    def run(self, scheduled: list[ScheduledSeq], want_prompt_logprobs: set[int]) -> StepResult:
        ids: list[int] = []
        for item in scheduled:
            start = item.seq.num_computed_tokens
            ids.extend(item.seq.token_ids[start : start + item.num_tokens])
        meta = AttentionMetadata(
            query_lens=[s.num_tokens for s in scheduled],
            context_lens=[s.seq.num_computed_tokens + s.num_tokens for s in scheduled],
            block_tables=[s.seq.table.block_ids for s in scheduled],
            block_size=self.block_size,
            device=self.device,
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=self.device), meta, self.pool
        )
        ends = meta.last_token_indices().tolist()
        sampled = [s for s in scheduled if s.completes_prompt]
        rows = [end for s, end in zip(scheduled, ends, strict=True) if s.completes_prompt]
        samples = None
        if sampled:
            logits = self.model.logits(hidden[rows])
            batch = SamplingBatch.build(
                params=[s.seq.params for s in sampled],
                generators=[s.seq.generator for s in sampled],
                output_token_ids=[s.seq.output_token_ids for s in sampled],
                prompt_token_ids=[s.seq.prompt_token_ids for s in sampled],
                device=self.device,
            )
            samples = self.sampler.sample(logits, batch)
        prompt_logprobs: dict[int, list[float]] = {}
        for index, (item, end) in enumerate(zip(scheduled, ends, strict=True)):
            if index in want_prompt_logprobs:
                prompt_logprobs[index] = self._chunk_logprobs(item, hidden, end)
        return StepResult(sampled=sampled, samples=samples, prompt_logprobs=prompt_logprobs)

    def _chunk_logprobs(self, item: ScheduledSeq, hidden: torch.Tensor, end: int) -> list[float]:
        """log p(token[i+1] | tokens[..i]) for chunk positions i whose successor is known."""
        seq = item.seq
        start = seq.num_computed_tokens
        positions = [
            p for p in range(start, start + item.num_tokens) if p + 1 < seq.num_prompt_tokens
        ]
        if not positions:
            return []
        first_row = end - item.num_tokens + 1
        rows = torch.tensor([first_row + (p - start) for p in positions], device=self.device)
        logits = self.model.logits(hidden[rows]).float()
        targets = torch.tensor([seq.prompt_token_ids[p + 1] for p in positions], device=self.device)
        logprobs = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        return logprobs.tolist()
