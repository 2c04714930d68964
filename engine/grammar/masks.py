"""The token masks of one engine step, computed on a helper thread while the model runs.

A mask depends only on the tokens a request has already emitted, all known when the step is
scheduled, so the runner starts the masks before the forward pass and collects them before
sampling: the grammar costs the step only what the forward pass did not hide. llguidance
drops the GIL while it computes, and spreads the rows over its own threads.

For a row with a speculative draft the masks at every drafted position are computed too
(position j assumes drafts 0..j-1 were emitted); the matcher walks the draft and is rolled
back to where it started, so a rejected draft never reaches the grammar state.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import torch

from engine.grammar.state import GrammarState
from engine.sampling.token_mask import TokenMask

# Steps whose mask timings are kept for the stats (p50 over a window, not the whole life).
TIMING_WINDOW = 1024


@dataclass
class MaskRow:
    state: GrammarState
    row: int  # logits row of the next token's position
    draft: list[int] = field(default_factory=list)  # drafted tokens; one more mask each


class PendingMasks:
    def __init__(self, future: Future[TokenMask], timings: MaskTimings):
        self._future = future
        self._timings = timings

    def result(self) -> TokenMask:
        start = time.perf_counter()
        mask = self._future.result()
        self._timings.waited_ms.append((time.perf_counter() - start) * 1e3)
        return mask


@dataclass
class MaskTimings:
    computed_ms: deque[float] = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))
    # How long sampling waited for the masks: the part the forward pass did not hide.
    waited_ms: deque[float] = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))

    def as_dict(self) -> dict[str, float | int]:
        return {
            "mask_steps": len(self.computed_ms),
            "mask_ms_p50": _p50(self.computed_ms),
            "mask_wait_ms_p50": _p50(self.waited_ms),
        }


class MaskComputer:
    def __init__(self, vocab_size: int, threads: int = 2):
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads=max(1, threads))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self.timings = MaskTimings()

    def submit(self, rows: list[MaskRow]) -> PendingMasks:
        """Start computing; the states must not change until `result()` returned."""
        return PendingMasks(self._thread.submit(self.compute, rows), self.timings)

    def compute(self, rows: list[MaskRow]) -> TokenMask:
        total = sum(len(r.draft) + 1 for r in rows)
        # All-ones to start: a position the matcher never reached (past a draft's end of
        # grammar, whose tokens are never emitted) stays finite rather than all -inf.
        bits = torch.full((total, self.words), -1, dtype=torch.int32)
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        logits_rows: list[int] = []
        offset = 0
        for r in rows:
            if r.draft:
                drafted.append((r.state.matcher, offset, r.draft))
            else:
                plain.append((r.state.matcher, offset))
            logits_rows.extend(range(r.row, r.row + len(r.draft) + 1))
            offset += len(r.draft) + 1
        start = time.perf_counter()
        pointer, word_bytes = bits.data_ptr(), self.words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, pointer, word_bytes, total)
        if drafted:  # llguidance refuses an empty draft here, hence two calls
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, pointer, word_bytes, total
            )
        self.timings.computed_ms.append((time.perf_counter() - start) * 1e3)
        return TokenMask(torch.tensor(logits_rows, dtype=torch.long), bits)

    def close(self) -> None:
        self._thread.shutdown(wait=False)


def _p50(values: deque[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 4)
