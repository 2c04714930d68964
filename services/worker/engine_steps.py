"""What the engine thread saw of each request: when it was first scheduled, each prefill
chunk, how many decode steps and in what company. Read back by the worker's spans.

`StepRecorder` is an engine step observer: it runs on the engine thread after every step,
so it only appends to the timelines of requests someone is watching (a dict lookup per
scheduled sequence) and feeds the step metrics. Decode steps are counted, never listed: a
span per token would cost more than the token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.scheduler import StepBatch
from engine.core.sequence import Sequence

log = logging.getLogger(__name__)

# What one step tells the metrics: its batch, and the step's start and end in wall-clock ns
# (after postprocessing); the metrics object decides what to keep.
StepMetricsSink = Callable[[StepBatch, int, int], None]


@dataclass(frozen=True)
class ChunkRecord:
    start_ns: int
    end_ns: int
    num_tokens: int  # prompt tokens computed for this request in this step
    batch_size: int  # sequences in the step
    batch_tokens: int  # tokens in the step, all sequences


@dataclass
class RequestTimeline:
    watched_ns: int  # when the worker handed the request to the engine
    first_step_ns: int | None = None  # start of the first step that computed anything for it
    chunks: list[ChunkRecord] = field(default_factory=list)
    num_chunks: int = 0  # all prefill chunks; only the first MAX_CHUNKS are kept
    decode_steps: int = 0
    decode_batch_sum: int = 0
    first_decode_ns: int | None = None  # start of its first decode step
    last_decode_ns: int | None = None  # end of its latest decode step
    preemptions: int = 0

    MAX_CHUNKS = 64

    @property
    def mean_decode_batch(self) -> float | None:
        return self.decode_batch_sum / self.decode_steps if self.decode_steps else None


def is_prefill_step(seq: Sequence, num_tokens: int) -> bool:
    """Whether a step that just computed `num_tokens` for `seq` was (part of) its prefill."""
    return seq.num_computed_tokens - num_tokens < seq.num_prompt_tokens


class StepRecorder:
    def __init__(self, metrics: StepMetricsSink | None = None):
        self.metrics = metrics
        self._watched: dict[str, RequestTimeline] = {}
        self._failed = False

    def watch(self, request_id: str) -> RequestTimeline:
        timeline = RequestTimeline(time.time_ns())
        self._watched[request_id] = timeline
        return timeline

    def unwatch(self, request_id: str) -> None:
        self._watched.pop(request_id, None)

    def __call__(self, batch: StepBatch, start_ns: int, end_ns: int) -> None:
        # Runs inside the engine's step: a bug here must cost observability, not requests.
        try:
            self._observe(batch, start_ns, end_ns)
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("step observer failed; later failures are not logged")

    def _observe(self, batch: StepBatch, start_ns: int, end_ns: int) -> None:
        if self.metrics is not None:
            self.metrics(batch, start_ns, end_ns)
        if not self._watched:
            return
        batch_size, tokens = len(batch.scheduled), batch.num_batched_tokens
        for item in batch.scheduled:
            timeline = self._watched.get(item.seq.request_id)
            if timeline is None:
                continue
            if timeline.first_step_ns is None:
                timeline.first_step_ns = start_ns
            timeline.preemptions = item.seq.num_preemptions
            if is_prefill_step(item.seq, item.num_tokens):
                timeline.num_chunks += 1
                if len(timeline.chunks) < RequestTimeline.MAX_CHUNKS:
                    timeline.chunks.append(
                        ChunkRecord(start_ns, end_ns, item.num_tokens, batch_size, tokens)
                    )
            else:
                timeline.decode_steps += 1
                timeline.decode_batch_sum += batch_size
                if timeline.first_decode_ns is None:
                    timeline.first_decode_ns = start_ns
                timeline.last_decode_ns = end_ns
