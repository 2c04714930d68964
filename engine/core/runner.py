"""Turns a scheduled step into tensors, runs the model, samples: the only code touching both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.scheduler import ScheduledSeq
from engine.grammar.masks import MaskComputer, MaskRow, PendingMasks
from engine.kvcache.pool import KVPool
from engine.model.llama import LlamaModel
from engine.sampling.batch import SamplingBatch
from engine.sampling.sampler import SampleOutput, Sampler
from engine.sampling.token_mask import TokenMask
from engine.speculative.proposer import Draft
from engine.speculative.verify import Verified, VerifyInput, verify, verify_greedy
from kernels.attention_metadata import AttentionMetadata
from shared.sampling.logprob import TokenLogprob


@dataclass
class StepResult:
    sampled: list[ScheduledSeq]  # the sequences that got a new token, in row order
    samples: SampleOutput | None
    # Per scheduled sequence that asked for prompt logprobs: for each computed position whose
    # successor is a prompt token, that token's logprob (and alternatives) given the ones before.
    prompt_logprobs: dict[int, list[TokenLogprob]]
    # Set instead of `samples` when the step verified drafts: per row of `sampled`, the
    # accepted drafts plus one target token.
    verified: list[Verified] | None = None
    # With `verified`: row -> logprobs of its one token, for rows that asked (never drafted).
    verified_logprobs: dict[int, TokenLogprob] | None = None
    # The final-normed hidden states of every computed row [sum(num_tokens), hidden], and
    # where each scheduled sequence's rows start: what a draft head drafts from.
    hidden: torch.Tensor | None = None
    row_starts: list[int] | None = None


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, block_size: int, seed: int = 0):
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.sampler = Sampler(seed=seed)
        self.device = model.device
        self._masks: MaskComputer | None = None  # made for the first structured request

    def run(self, scheduled: list[ScheduledSeq], want_prompt_logprobs: set[int]) -> StepResult:
        # Rows of output positions (decode, verify) run on the model's decode path, prompt
        # rows on its prefill path: a row's numerics depend on its kind, never on what else
        # shares its step, so greedy output is the same alone, batched or chunked.
        sampled_index = [i for i, s in enumerate(scheduled) if s.completes_prompt]
        sampled = [scheduled[i] for i in sampled_index]
        # Grammar masks need only tokens already emitted: computed while the model runs.
        pending = self._start_masks(sampled)
        decode_items = [i for i, s in enumerate(scheduled) if self._is_decode(s)]
        prompt_items = [i for i in range(len(scheduled)) if i not in set(decode_items)]
        starts: list[int] = []
        total = 0
        for item in scheduled:
            starts.append(total)
            total += item.num_tokens
        hidden = torch.empty((total, self.model.config.hidden_size), dtype=torch.float32)
        for group, decode in ((prompt_items, False), (decode_items, True)):
            if not group:
                continue
            part = self._forward([scheduled[i] for i in group], decode)
            if len(group) == len(scheduled):
                hidden = part
                break
            offset = 0
            for i in group:
                n = scheduled[i].num_tokens
                hidden[starts[i] : starts[i] + n] = part[offset : offset + n]
                offset += n
        decode_rows = {i for i in decode_items}
        ends = [starts[i] + s.num_tokens - 1 for i, s in enumerate(scheduled)]
        rows = [ends[i] for i in sampled_index]
        samples = None
        verified = None
        verified_logprobs = None
        mask = pending.result() if pending is not None else None
        if sampled and any(s.num_draft for s in sampled):
            kinds = [i in decode_rows for i in sampled_index]
            verified, verified_logprobs = self._verify(sampled, hidden, rows, kinds, mask)
        elif sampled and (tokens := self._greedy(sampled, hidden, rows, mask)) is not None:
            samples = SampleOutput(token_ids=tokens, logprobs=None, top_logprobs=None)
        elif sampled:
            logits = self._logits(hidden, rows, [i in decode_rows for i in sampled_index])
            batch = SamplingBatch.build(
                params=[s.seq.params for s in sampled],
                generators=[s.seq.generator for s in sampled],
                output_token_ids=[s.seq.output_token_ids for s in sampled],
                prompt_token_ids=[s.seq.prompt_token_ids for s in sampled],
                device=self.device,
                mask=mask,
            )
            samples = self.sampler.sample(logits, batch)
        prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        for index, (item, end) in enumerate(zip(scheduled, ends, strict=True)):
            if index in want_prompt_logprobs:
                prompt_logprobs[index] = self._chunk_logprobs(item, hidden, end)
        return StepResult(
            sampled, samples, prompt_logprobs, verified, verified_logprobs, hidden, starts
        )

    def _start_masks(self, sampled: list[ScheduledSeq]) -> PendingMasks | None:
        """Masks for the constrained rows among `sampled`, in the logits rows they will
        have: one per row, or one per drafted position plus one when verifying."""
        rows: list[MaskRow] = []
        offset = 0
        for item in sampled:
            seq = item.seq
            if seq.grammar is not None:
                draft = (
                    seq.draft.token_ids[: item.num_draft] if item.num_draft and seq.draft else []
                )
                rows.append(MaskRow(seq.grammar, offset, draft))
            offset += item.num_draft + 1
        if not rows:
            return None
        if self._masks is None:
            self._masks = MaskComputer(self.model.config.vocab_size)
        return self._masks.submit(rows)

    def mask_stats(self) -> dict:
        return self._masks.timings.as_dict() if self._masks is not None else {}

    @staticmethod
    def _is_decode(item: ScheduledSeq) -> bool:
        return item.seq.num_computed_tokens >= item.seq.num_prompt_tokens

    @staticmethod
    def _new_token_ids(item: ScheduledSeq) -> list[int]:
        """The tokens this step computes, sliced from prompt or output without rebuilding
        prompt + output (a per-step cost that would grow with the conversation)."""
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_tokens - item.num_draft
        prompt_len = seq.num_prompt_tokens
        if start >= prompt_len:
            ids = seq.output_token_ids[start - prompt_len : end - prompt_len]
        elif end <= prompt_len:
            ids = seq.prompt_token_ids[start:end]
        else:
            ids = seq.prompt_token_ids[start:] + seq.output_token_ids[: end - prompt_len]
        if item.num_draft:
            assert seq.draft is not None
            ids = ids + list(seq.draft.token_ids)
        return ids

    def _forward(self, items: list[ScheduledSeq], decode: bool) -> torch.Tensor:
        ids: list[int] = []
        for item in items:
            ids.extend(self._new_token_ids(item))
        trees = [_tree_of(s) for s in items]
        meta = AttentionMetadata(
            query_lens=[s.num_tokens for s in items],
            context_lens=[s.seq.num_computed_tokens + s.num_tokens for s in items],
            block_tables=[s.seq.table.attention_block_ids() for s in items],
            block_size=self.block_size,
            device=self.device,
            trees=trees if any(t is not None for t in trees) else None,
        )
        ids_tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model.forward_path(ids_tensor, meta, self.pool, decode)

    def _logits(self, hidden: torch.Tensor, rows: list[int], decode: list[bool]) -> torch.Tensor:
        """Logits of `rows`, each with the head of the path its row ran on."""
        if all(decode) or not any(decode):
            return self.model.logits(hidden[rows], decode=bool(decode and decode[0]))
        out = torch.empty((len(rows), self.model.config.vocab_size), dtype=torch.float32)
        for kind in (False, True):
            picked = [i for i, d in enumerate(decode) if d is kind]
            if picked:
                out[picked] = self.model.logits(
                    hidden[[rows[i] for i in picked]], decode=kind
                ).float()
        return out

    def _greedy(
        self,
        sampled: list[ScheduledSeq],
        hidden: torch.Tensor,
        rows: list[int],
        mask: TokenMask | None,
    ) -> torch.Tensor | None:
        """The tokens of `rows` where every one is a decode row that reads nothing but the
        argmax (LlamaModel.greedy_tokens: the same tokens, without the full logits); None
        where any row needs its logits."""
        if mask is not None or not all(
            s.seq.params.argmax_only and self._is_decode(s) for s in sampled
        ):
            return None
        return self.model.greedy_tokens(hidden[rows], decode=True)

    def _verify(
        self,
        sampled: list[ScheduledSeq],
        hidden: torch.Tensor,
        ends: list[int],
        decode: list[bool],
        mask: TokenMask | None,
    ) -> tuple[list[Verified], dict[int, TokenLogprob]]:
        """Logits at every drafted position of every row, verified in one batch."""
        rows: list[int] = []
        logprob_rows: dict[int, int] = {}  # sampled row -> its logits row
        items: list[VerifyInput] = []
        row_kinds: list[bool] = []
        for item, end, kind in zip(sampled, ends, decode, strict=True):
            seq = item.seq
            if seq.params.logprobs is not None and not item.num_draft:
                logprob_rows[len(items)] = len(rows)
            rows.extend(range(end - item.num_draft, end + 1))
            row_kinds.extend([kind] * (item.num_draft + 1))
            draft = seq.draft if item.num_draft else None
            items.append(
                VerifyInput(
                    seq.params,
                    seq.generator,
                    seq.prompt_token_ids,
                    seq.output_token_ids,
                    draft if draft is not None else Draft([]),
                )
            )
        if not logprob_rows:
            targets = self._greedy(sampled, hidden, rows, mask)
            if targets is not None:
                return verify_greedy(items, targets.tolist()), {}
        logits = self._logits(hidden, rows, row_kinds)
        shared = self.sampler.shared_generator(self.device)
        verified = verify(logits, items, self.sampler, shared, mask)
        logprobs: dict[int, TokenLogprob] = {}
        for row, logits_row in logprob_rows.items():
            raw = logits[logits_row].float().log_softmax(-1)
            token = verified[row].token_ids[0]
            n = min(items[row].params.logprobs or 0, raw.shape[-1])
            values, ids = raw.topk(n) if n else (raw[:0], raw[:0].long())
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs[row] = TokenLogprob(token, float(raw[token]), top)
        return verified, logprobs

    def _chunk_logprobs(
        self, item: ScheduledSeq, hidden: torch.Tensor, end: int
    ) -> list[TokenLogprob]:
        """For chunk positions i whose successor is known: log p(token[i+1] | tokens[..i]) and
        the sequence's `logprobs` top alternatives there."""
        seq = item.seq
        start = seq.num_computed_tokens
        positions = [
            p for p in range(start, start + item.num_tokens) if p + 1 < seq.num_prompt_tokens
        ]
        if not positions:
            return []
        first_row = end - item.num_tokens + 1
        rows = torch.tensor([first_row + (p - start) for p in positions], device=self.device)
        logprobs = self.model.logits(hidden[rows], decode=False).float().log_softmax(-1)
        targets = [seq.prompt_token_ids[p + 1] for p in positions]
        chosen = logprobs.gather(-1, torch.tensor(targets, device=self.device)[:, None])
        k = min(seq.params.logprobs or 0, logprobs.shape[-1])
        if k:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            tops = [
                list(zip(ids, values, strict=True))
                for ids, values in zip(top_ids.tolist(), top_values.tolist(), strict=True)
            ]
        else:
            tops = [[] for _ in positions]
        return [
            TokenLogprob(token, value, top)
            for token, value, top in zip(targets, chosen.squeeze(-1).tolist(), tops, strict=True)
        ]


def _tree_of(item: ScheduledSeq) -> tuple[int, ...] | None:
    """The parents of the draft tree this row verifies, or None (a chain, or no draft)."""
    draft = item.seq.draft
    if not item.num_draft or draft is None or not draft.is_tree:
        return None
    return draft.parents
