"""`ScriptedTestBackend`: a test-only `GenerationBackend` whose models behave as scripted.

Each model id maps to a `Script`: how long before the first token, whether it fails before
(or instead of) it, how many tokens and how fast. Every call is recorded with whether it
finished or was closed early (which is how the coordinator aborts a request), so tests can
check that a fallback cancelled the attempt it gave up on. Token i is the ids of the text
"t{i} ", so the coordinator's detokenizer reads "t0 t1 t2 " from three tokens' worth; or the
script gives the reply's text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.coordinator.generation_backend import (
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)


@dataclass
class Script:
    first_token_delay_s: float = 0.0
    fail: Exception | None = None  # raised before the first token, after the delay
    num_tokens: int = 3
    token_delay_s: float = 0.0
    cached_tokens: int = 0
    replica: str = "scripted-0"
    # The reply as text (its tokens one a chunk, then end of turn: "stop"), not "t0 t1 ...".
    text: str | None = None


@dataclass
class Call:
    request: GenerationRequest
    finished: bool = False
    closed_early: bool = False
    started: float = field(default_factory=lambda: asyncio.get_running_loop().time())


class ScriptedTestBackend:
    def __init__(self, tokenizer, scripts: dict[str, Script], context_length: int = 2048):
        self.scripts = scripts
        self.tokenizer = tokenizer
        self.calls: list[Call] = []
        self._infos = [
            ModelInfo(id=m, context_length=context_length, tokenizer=tokenizer) for m in scripts
        ]

    def models(self) -> list[ModelInfo]:
        return self._infos

    async def health(self) -> dict:
        return {"ready": True}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        script = self.scripts[req.model]
        call = Call(req)
        self.calls.append(call)
        prompt = len(req.prompt_token_ids)
        try:
            await asyncio.sleep(script.first_token_delay_s)
            if script.fail is not None:
                call.finished = True
                raise script.fail
            if script.text is not None:  # then the end-of-turn token, as a model stops
                pieces = [[t] for t in self.tokenizer.encode(script.text)]
                pieces.append([self.tokenizer.eos_token_id])
                end = "stop" if len(pieces) <= req.params.max_tokens else "length"
            else:
                pieces = [self.tokenizer.encode(f"t{i} ") for i in range(script.num_tokens)]
                end = "length"
            count = min(len(pieces), req.params.max_tokens)
            for i in range(count):
                if i:
                    await asyncio.sleep(script.token_delay_s)
                last = i == count - 1
                yield GenerationChunk(
                    token_ids=pieces[i],
                    finished=last,
                    finish_reason=end if last else None,
                    num_prompt_tokens=prompt,
                    num_cached_tokens=script.cached_tokens,
                    num_output_tokens=i + 1,
                    replica=script.replica,
                    metadata={"routing": [f"{script.replica} picked for {req.model}"]},
                )
            call.finished = True
        finally:
            if not call.finished:
                call.closed_early = True

    def calls_for(self, model: str) -> list[Call]:
        return [c for c in self.calls if c.request.model == model]
