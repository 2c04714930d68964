"""The retry loop's decision when a draining replica hands a stream over: continue on another
pair from the tokens streamed (recorded as `drain`, the replica excluded), not counted
against `max_migrations` (nothing failed), while a real loss still is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.coordinator.attempt.retry import RetryLoop
from services.coordinator.generation_backend import (
    BackendError,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
    ReplicaHandedOver,
    ReplicaLost,
)
from services.coordinator.route.targets import RetryPolicy
from shared.sampling.params import SamplingParams

PROMPT = [1, 2, 3]
MAX_TOKENS = 12


class MovingBackend:
    """Serves one fixed reply; attempt i stops after `cuts[i] = (n, exc)` of its tokens by
    raising `exc` (its replica is `D{i}`); attempts past the plan finish the reply."""

    def __init__(self, tokenizer, cuts: list[tuple[int, type[ReplicaLost]]]):
        self.tokenizer = tokenizer
        self.cuts = cuts
        self.requests: list[GenerationRequest] = []

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(id="m", context_length=1024, tokenizer=self.tokenizer)]

    async def health(self) -> dict:
        return {"ready": True}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        index = len(self.requests)
        self.requests.append(req)
        replica = f"D{index}"
        done = len(req.prompt_token_ids) - len(PROMPT)  # a continuation carries the streamed
        cut = self.cuts[index] if index < len(self.cuts) else None
        for n, token in enumerate(reply(self.tokenizer)[done:]):
            if cut is not None and n == cut[0]:
                raise cut[1](replica, "draining: its grace ran out")
            last = done + n == MAX_TOKENS - 1
            yield GenerationChunk(
                token_ids=[token],
                finished=last,
                finish_reason="length" if last else None,
                num_output_tokens=n + 1,
                replica=replica,
                metadata={"replica": replica},
            )
            await asyncio.sleep(0)


def reply(tokenizer) -> list[int]:
    ids = tokenizer.encode(" ".join(f"word{i}" for i in range(MAX_TOKENS)))
    assert len(ids) >= MAX_TOKENS
    return ids[:MAX_TOKENS]


def serve(tokenizer, cuts, max_migrations: int):
    backend = MovingBackend(tokenizer, cuts)
    loop = RetryLoop(backend, RetryPolicy(["m"], max_migrations=max_migrations), tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    req = GenerationRequest("r", "m", list(PROMPT), params, 1, "default")

    async def run() -> list[GenerationChunk]:
        return [c async for c in loop.generate(req)]

    return backend, asyncio.run(run())


def test_hand_overs_continue_the_stream_beyond_the_migration_budget(real_tokenizer):
    backend, chunks = serve(
        real_tokenizer, [(4, ReplicaHandedOver), (3, ReplicaHandedOver)], max_migrations=0
    )
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == reply(real_tokenizer)  # nothing lost or doubled
    assert chunks[-1].finished and chunks[-1].num_output_tokens == MAX_TOKENS
    attempts = chunks[-1].metadata["attempts"]
    assert [a["reason"] for a in attempts] == ["first", "drain", "drain"]
    assert [a["after_tokens"] for a in attempts] == [0, 4, 7]
    assert all(a["success"] and a["error"] is None for a in attempts)
    assert [r.exclude for r in backend.requests] == [set(), {"D0"}, {"D0", "D1"}]
    assert any(
        line.startswith("drain: replica D0 handed") for line in chunks[-1].metadata["reasoning"]
    )


def test_a_loss_after_a_hand_over_still_has_its_migration(real_tokenizer):
    _, chunks = serve(real_tokenizer, [(4, ReplicaHandedOver), (3, ReplicaLost)], max_migrations=1)
    attempts = chunks[-1].metadata["attempts"]
    assert [a["reason"] for a in attempts] == ["first", "drain", "migration"]
    assert not attempts[1]["success"] and "lost" in attempts[1]["error"]
    assert chunks[-1].num_output_tokens == MAX_TOKENS


def test_losses_past_the_budget_give_up_and_count_the_hand_over_as_a_move(real_tokenizer):
    with pytest.raises(BackendError) as err:
        serve(real_tokenizer, [(4, ReplicaHandedOver), (3, ReplicaLost)], max_migrations=0)
    assert "migrated 1 times; giving up" in str(err.value)
