"""What a response has gathered so far from its backend chunks: per choice and in total."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.coordinator.generation_backend import GenerationChunk
from services.coordinator.prepare.prepared import PreparedRequest
from services.coordinator.stream.pricing import response_cost
from shared.config.policy import Price
from shared.sampling.logprob import TokenLogprob


@dataclass
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1, 2, ...
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    started: bool = False  # has emitted its opening chunk (streaming)


class ResponseState:
    """Per-choice accumulators, usage totals and the response's `metadata`."""

    def __init__(self, prepared: PreparedRequest, price: Price | None = None):
        self.prepared = prepared
        self.price = price  # of the request's tier; None = no `cost` in the metadata
        self.choices = [ChoiceState() for _ in prepared.requests]
        self._replicas: list[str] = []
        self._extra: dict[str, Any] = {}
        self._served_model: str | None = None

    def add(self, index: int, chunk: GenerationChunk) -> ChoiceState:
        """Gathers choice `index`'s chunk, as `shown` made it for the client."""
        state = self.choices[index]
        state.text += chunk.text
        state.token_ids.extend(chunk.token_ids)
        state.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            state.prompt_logprobs = chunk.prompt_logprobs
        state.num_prompt_tokens = chunk.num_prompt_tokens
        state.num_cached_tokens = chunk.num_cached_tokens
        state.num_output_tokens = 0 if self.prepared.drop_output else chunk.num_output_tokens
        if chunk.finished:
            state.finish_reason = _openai_finish_reason(chunk.finish_reason)
        if chunk.replica and chunk.replica not in self._replicas:
            self._replicas.append(chunk.replica)
        if chunk.metadata:
            extra = dict(chunk.metadata)
            # The model that answered goes in the envelope's `model`, not in the metadata.
            self._served_model = extra.pop("model", self._served_model)
            self._extra.update(extra)
        return state

    @property
    def served_model(self) -> str:
        """The model that answered: a fallback may have moved on from the one asked for."""
        return self._served_model or self.prepared.model.id

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict[str, Any]:
        # A prompt shared by n choices is counted once, as OpenAI bills it.
        firsts = [self.choices[p * self.prepared.n] for p in range(len(self.prepared.prompt_ids))]
        prompt = sum(c.num_prompt_tokens for c in firsts)
        cached = sum(c.num_cached_tokens for c in firsts)
        completion = sum(c.num_output_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }

    def structured_metadata(self) -> dict[str, Any]:
        """The metadata with lists and objects as they are: for metrics and spans."""
        merged: dict[str, Any] = {
            "request_id": self.prepared.response_id,
            "replica": ",".join(self._replicas) if self._replicas else None,
            "service_tier": self.prepared.tier,
        }
        merged.update(self._extra)
        if self.price is not None and self.finished:
            # Only once the usage is final: a partial cost on a first chunk would mislead.
            merged["cost"] = response_cost(self.usage(), self.prepared.tier, self.price)
        return {key: value for key, value in merged.items() if value is not None}

    def metadata(self) -> dict[str, str]:
        """OpenAI types `metadata` as string -> string; structured values travel as JSON."""
        return {key: _as_string(value) for key, value in self.structured_metadata().items()}


def shown(chunk: GenerationChunk, prepared: PreparedRequest) -> GenerationChunk:
    """The chunk as the client sees it: with max_tokens=0 the token generated to finish the
    prompt pass is not output."""
    if not prepared.drop_output:
        return chunk
    return chunk.with_changes(token_ids=[], text="", logprobs=[])


def _as_string(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _openai_finish_reason(reason: str | None) -> str:
    # "abort" only reaches a client when the backend gave up on the request on its own
    # (e.g. a worker drained it); OpenAI's closest value says the output is cut short.
    if reason in ("stop", "length"):
        return reason
    return "length" if reason == "abort" else "stop"
