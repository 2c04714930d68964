"""A `GenerationBackend` over one in-process `Engine`: single-process runs and tests.

The production backend is the gRPC one (prefill/decode worker pools); this one runs the whole
model in the coordinator's process, driven by the same `AsyncEngine` the workers use. Like
every backend it streams token ids; the coordinator turns them into text.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from engine.core.async_engine import AsyncEngine, EngineStepError
from engine.core.engine import Engine, RequestError
from services.coordinator.generation_backend import (
    BackendError,
    BackendRequestError,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.tokenizer.tokenizer import Tokenizer


class EngineBackend:
    """Runs `engine` on its own thread; `start()` before use, `close()` after."""

    def __init__(
        self,
        engine: Engine,
        model_id: str = DEFAULT_MODEL_ID,
        tokenizer: Tokenizer | None = None,
        replica: str = "local",
    ):
        tokenizer = tokenizer or engine.tokenizer
        if tokenizer is None:
            raise ValueError(
                "EngineBackend needs a tokenizer (pass one, or build the engine with one)"
            )
        self.engine = engine
        self.replica = replica
        fingerprint = hashlib.sha256(
            f"{tokenizer.fingerprint}|{engine.model.config!r}".encode()
        ).hexdigest()
        self._info = ModelInfo(
            id=model_id,
            context_length=engine.max_model_len,
            tokenizer=tokenizer,
            fingerprint=f"fp_{fingerprint[:10]}",
        )
        self.driver = AsyncEngine(engine)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineBackend:
        self.driver.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self.driver.stop(timeout)

    def __enter__(self) -> EngineBackend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- GenerationBackend ---------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return [self._info]

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        def add(engine: Engine) -> str:
            return engine.add_request(
                req.prompt_token_ids,
                req.params,
                request_id=req.request_id,
                priority=req.priority,
                prompt_logprobs=req.prompt_logprobs,
            )

        try:
            # Leaving early (client gone, stop string) aborts the request: aclosing closes
            # the driver's iterator with this generator, not when it is collected.
            async with contextlib.aclosing(
                self.driver.generate(add, req.params.structured)
            ) as outputs:
                async for out in outputs:
                    yield GenerationChunk(
                        token_ids=list(out.new_token_ids),
                        text="",
                        logprobs=list(out.logprobs),
                        prompt_logprobs=out.prompt_logprobs,
                        finished=out.finished,
                        finish_reason=out.finish_reason,
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_cached_tokens=out.num_cached_tokens,
                        num_output_tokens=out.num_output_tokens,
                        replica=self.replica,
                    )
        except RequestError as exc:
            raise BackendRequestError(exc.param, str(exc)) from exc
        except EngineStepError as exc:
            raise BackendError(f"the engine failed: {exc}") from exc

    async def health(self) -> dict[str, Any]:
        scheduler = self.engine.scheduler
        return {
            "ready": self.driver.running,
            "replica": self.replica,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "aborted": self.engine.num_aborted,
            "failed_steps": self.driver.num_failed_steps,
            "last_error": self.driver.last_error,
        }
