"""The coordinator's text stage (`text_changes`, fed by the retry loop): token ids in, text deltas
out, the reply cut at a stop string exactly where plain decoding would end it, and the
backend's stream closed there, so the request is aborted on its replicas (no tokens wasted,
every block back)."""

from __future__ import annotations

import asyncio
import contextlib

from services.coordinator.attempt.retry import RetryLoop
from services.coordinator.generation_backend import GenerationChunk, GenerationRequest, ModelInfo
from services.coordinator.route.targets import RetryPolicy
from services.coordinator.stream.text import text_changes
from services.coordinator.stream.text_tracker import TextTracker
from shared.sampling.logprob import TokenLogprob
from shared.sampling.params import SamplingParams
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from tests.unit.test_migration_backend import (
    collect,
    fleet_config,
    request,
    start_fleet,
    tiny_folder,  # noqa: F401 - the fixture
    tokens,
)
from tests.unit.test_migration_cancel import (
    LONG,
    assert_settled,
    free_blocks,
    settled,
    steps_after_a_pause,
)


def _ids(tokenizer, words: list[str]) -> list[int]:
    ids = [tokenizer.encode(w) for w in words]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def test_a_stop_string_inside_a_multi_token_chunk_cuts_it_there(real_tokenizer):
    ids = _ids(real_tokenizer, [" one", " two", " three", " four", " five"])
    chunk = GenerationChunk(
        token_ids=list(ids),
        text="",
        logprobs=[TokenLogprob(t, -0.5, []) for t in ids],
        num_output_tokens=7,  # two earlier tokens, then these five (accepted drafts)
    )
    tracker = TextTracker(IncrementalDetokenizer(real_tokenizer), (" thr",))
    chunk = chunk.with_changes(**text_changes(chunk, tracker))
    assert chunk.text == " one two"
    assert chunk.finished and chunk.finish_reason == "stop"
    assert chunk.token_ids == ids[:3]  # up to the token that completed " thr"
    assert [lp.token_id for lp in chunk.logprobs] == ids[:3]
    assert chunk.num_output_tokens == 5


def test_a_stop_token_ends_the_reply_unshown_and_held_text_is_flushed(real_tokenizer):
    one, two = _ids(real_tokenizer, [" one", " two"])
    tracker = TextTracker(IncrementalDetokenizer(real_tokenizer), (" one two three",))
    first = GenerationChunk(token_ids=[one], text="", num_output_tokens=1)
    first = first.with_changes(**text_changes(first, tracker))
    assert first.text == ""  # " one" may begin the stop string: held back
    # The backend stopped on a stop token (here a plain one, from `stop_token_ids`).
    last = GenerationChunk(
        token_ids=[two], text="", finished=True, finish_reason="stop", num_output_tokens=2
    )
    last = last.with_changes(**text_changes(last, tracker))
    assert last.text == " one"  # the held text, not the stop token's
    assert last.token_ids == [two] and last.num_output_tokens == 2


class _Counting:
    """A backend saying " one two three four", one token a chunk, noting when it is closed."""

    def __init__(self, tokenizer):
        self.ids = _ids(tokenizer, [" one", " two", " three", " four"])
        self.info = ModelInfo(id="m", context_length=64, tokenizer=tokenizer)
        self.closed: list[bool] = []

    def models(self):
        return [self.info]

    async def health(self):
        return {"ready": True}

    async def generate(self, req):
        try:
            for n, token in enumerate(self.ids, 1):
                yield GenerationChunk(token_ids=[token], num_output_tokens=n)
        finally:
            self.closed.append(True)


def test_the_loop_closes_the_backend_stream_at_a_stop_string(real_tokenizer):
    backend = _Counting(real_tokenizer)
    loop = RetryLoop(backend, RetryPolicy(models=["m"]), real_tokenizer)
    req = GenerationRequest(
        "r", "m", [1, 2, 3], SamplingParams(max_tokens=4, stop=(" two",)), 1, "default"
    )

    async def run() -> list[GenerationChunk]:
        chunks = [c async for c in loop.generate(req)]
        assert backend.closed == [True]  # closed by the loop itself, before it returned
        return chunks

    chunks = asyncio.run(run())
    assert [c.text for c in chunks] == [" one", ""]
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
    assert sum(len(c.token_ids) for c in chunks) == 2


def test_a_stop_string_aborts_the_request_on_the_replicas(tiny_folder, real_tokenizer):  # noqa: F811
    """Through the coordinator's retry loop and the gRPC backend: the text is the plain
    greedy text cut at the stop string, and the decode replica aborts the rest at once."""

    async def main():
        fleet = await start_fleet(
            fleet_config(tiny_folder, {"prefill": 1, "decode": 1}), real_tokenizer
        )
        try:
            start = await free_blocks(fleet)
            baseline = await collect(fleet.loop, request("plain", 40, ignore_eos=True))
            await settled(fleet, start)
            aborted = {wid: (await r.stats())["aborted"] for wid, r in fleet.replicas.items()}
            ids = tokens(baseline)
            text = real_tokenizer.decode(ids, skip_special_tokens=True)
            stop = real_tokenizer.decode(ids[10:12], skip_special_tokens=True)
            req = request("stopped", LONG, ignore_eos=True, stop=(stop,))
            stream = fleet.loop.generate(req)
            async with contextlib.aclosing(stream):
                chunks = [c async for c in stream]
            stats = await settled(fleet, start, timeout_s=2.0)
            return text, stop, chunks, start, aborted, stats, await steps_after_a_pause(fleet)
        finally:
            await fleet.close()

    text, stop, chunks, start, aborted, stats, (steps, later) = asyncio.run(main())
    assert stop.strip(), "the stop string must be visible text"
    assert "".join(c.text for c in chunks) == text.split(stop)[0]
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
    assert chunks[-1].num_output_tokens <= 12 and len(tokens(chunks)) <= 12
    assert_settled(stats, start)
    (decode,) = [wid for wid, s in stats.items() if s["role"] == "decode"]
    assert stats[decode]["aborted"] == aborted[decode] + 1  # stopped, not run to LONG tokens
    assert steps == later
