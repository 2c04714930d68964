"""Continuous batching with chunked prefill, priorities and preemption.

Each step spends a token budget: running sequences first (a decode costs one token, a prompt
in the middle of its prefill costs a chunk), then waiting ones in priority order. A long prompt
is cut into chunks so it never stalls the decodes sharing its steps. When blocks run out the
least important running sequence is preempted — swapped to host memory, or freed so that its
committed blocks stay in the prefix cache and it resumes by recomputing only what was lost.
The scheduler decides; it never touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.config import BACKGROUND_PRIORITY, EngineConfig
from engine.core.sequence import SeqStatus, Sequence
from engine.kvcache.block_manager import BlockManager


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed for this sequence in this step (drafts included)
    num_draft: int = 0  # of which speculative drafts, placed after the sequence's tokens

    @property
    def completes_prompt(self) -> bool:
        """After this step the sequence's KV covers every token: its next token is sampled."""
        return (
            self.seq.num_computed_tokens + self.num_tokens - self.num_draft == self.seq.num_tokens
        )


@dataclass
class StepBatch:
    """What one engine step computes (the scheduler's decision), and whom it preempted."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def admit_running(self, seq: Sequence) -> None:
        """A sequence that arrives with its KV in place (pushed by a prefill replica)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give back its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.swapped is not None:
            self.blocks.discard_swapped(seq.swapped)
            seq.swapped = None
        if seq.table is not None and not seq.keep_kv:
            self.release_kv(seq)

    def release_kv(self, seq: Sequence) -> None:
        if seq.table is not None:
            self.blocks.free(seq.table)
            seq.table = None

    def schedule(self) -> StepBatch:
        out = StepBatch()
        budget = self.config.max_num_batched_tokens
        queue = sorted(self.running, key=Sequence.sort_key)
        # A prompt of the most urgent tier with prefill pending gets the step to itself (with
        # the decodes): a lower tier's prompt chunk in the same step would lengthen the step,
        # and so the higher tier's time to first token, by its whole size.
        # (Waiting prompts count only while the batch has room to admit them.)
        can_admit = len(self.running) < self.config.max_num_seqs
        candidates = [*self.running, *(self.waiting if can_admit else ())]
        urgent = min((s.priority for s in candidates if s.num_pending_tokens > 1), default=None)
        # Prompt tokens this step may still take (chunk_tokens_while_decoding).
        prompt_left = budget
        cap = self.config.chunk_tokens_while_decoding
        if cap is not None and any(s.num_pending_tokens == 1 for s in self.running):
            prompt_left = min(budget, cap)
        while queue and budget > 0:
            seq = queue.pop(0)
            drafted = self._fit_draft(seq, budget)
            if drafted:
                out.scheduled.append(ScheduledSeq(seq, 1 + drafted, drafted))
                budget -= 1 + drafted
                continue
            n = min(seq.num_pending_tokens, budget, self._chunk_cap(seq))
            prompt = seq.num_pending_tokens > 1
            if prompt:
                n = min(n, prompt_left)
                if n < 1:
                    continue
            if n > 1 and urgent is not None and seq.priority > urgent:
                continue
            if self._grow(seq, n, queue, out):
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                prompt_left -= n if prompt else 0
        if out.preempted:
            return out  # under memory pressure, admit nobody new this step
        for seq in sorted(self.waiting, key=Sequence.sort_key):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.num_pending_tokens > 1 and urgent is not None and seq.priority > urgent:
                break  # waits for the more urgent tier's prompts (see above)
            if seq.num_pending_tokens > 1 and prompt_left < 1:
                break  # this step's prompt tokens are spent (chunk_tokens_while_decoding)
            if not self._admit(seq, out):
                break  # strict priority order: nobody overtakes a blocked sequence
            n = min(seq.num_pending_tokens, budget, self._chunk_cap(seq))
            if seq.num_pending_tokens > 1:
                n = min(n, prompt_left)
            target = max(seq.table.num_tokens, seq.num_computed_tokens + n)
            if not self.blocks.append_slots(seq.table, target):
                break  # admitted (its KV is back) but no room to grow yet: next step's _grow
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prompt_left -= n if seq.num_pending_tokens > 1 else 0
        return out

    # -- internals -----------------------------------------------------------------------

    def _chunk_cap(self, seq: Sequence) -> int:
        """The most prompt tokens `seq` may compute this step (see background_chunk_tokens)."""
        cap = self.config.background_chunk_tokens
        if cap is None or seq.priority < BACKGROUND_PRIORITY:
            return self.config.max_num_batched_tokens
        return cap

    def _fit_draft(self, seq: Sequence, budget: int) -> int:
        """Reserve slots for the sequence's drafts if budget and free blocks allow: drafts
        are optional, so they never preempt anyone (they are dropped instead)."""
        k = min(seq.num_draft_tokens, budget - 1)
        if k <= 0 or seq.num_pending_tokens != 1:
            seq.draft = None
            return 0
        assert seq.table is not None and seq.draft is not None
        target = max(seq.table.num_tokens, seq.num_tokens + k)
        if not self.blocks.append_slots(seq.table, target):
            seq.draft = None
            return 0
        if k < len(seq.draft.token_ids):
            seq.draft = seq.draft.prefix(k)
        return k

    def _grow(self, seq: Sequence, n: int, queue: list[Sequence], out: StepBatch) -> bool:
        """Make room for n more tokens, preempting the least important others if needed."""
        assert seq.table is not None, f"running sequence {seq.request_id} has no blocks"
        target = max(seq.table.num_tokens, seq.num_computed_tokens + n)
        while not self.blocks.append_slots(seq.table, target):
            if queue:
                self._preempt(queue.pop(), out)
            else:
                self._preempt(seq, out)
                return False
        return True

    def _admit(self, seq: Sequence, out: StepBatch) -> bool:
        while True:
            if self._try_allocate(seq):
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SeqStatus.RUNNING
                return True
            victim = self._lower_priority_victim(seq)
            if victim is None:
                return False
            self._unschedule(victim, out)
            self._preempt(victim, out)

    def _try_allocate(self, seq: Sequence) -> bool:
        if seq.swapped is not None:
            table = self.blocks.swap_in(seq.swapped)
            if table is None:
                return False
            seq.table, seq.swapped = table, None
            return True
        allocation = self.blocks.allocate(seq.token_ids, max_reused_tokens=seq.max_reused_tokens)
        if allocation is None:
            return False
        seq.table = allocation.table
        seq.num_computed_tokens = allocation.num_cached_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(allocation.num_cached_tokens, seq.num_prompt_tokens)
        return True

    def _lower_priority_victim(self, seq: Sequence) -> Sequence | None:
        candidates = [r for r in self.running if r.priority > seq.priority]
        return max(candidates, key=Sequence.sort_key) if candidates else None

    def _unschedule(self, victim: Sequence, out: StepBatch) -> None:
        out.scheduled = [s for s in out.scheduled if s.seq is not victim]

    def _preempt(self, seq: Sequence, out: StepBatch) -> None:
        assert seq.table is not None
        seq.num_preemptions += 1
        swapped = None
        if self.config.preemption_mode == "swap":
            swapped = self.blocks.swap_out(seq.table)
        if swapped is not None:
            seq.swapped = swapped  # KV kept whole: resumes exactly where it was
        else:
            self.blocks.free(seq.table)  # committed blocks stay cached; the rest is recomputed
            seq.num_computed_tokens = 0
        seq.table = None
        self.running.remove(seq)
        self.waiting.append(seq)
        seq.status = SeqStatus.WAITING
        out.preempted.append(seq)
