"""Response bodies and stream chunks of the two endpoints, built from a `ResponseState`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from services.coordinator.generation_backend import GenerationChunk
from services.coordinator.prepare.prepared import PreparedRequest
from services.coordinator.prepare.tool_calls import ToolCallSplitter
from services.coordinator.stream.accumulate import ResponseState
from services.coordinator.stream.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    merge_completion_logprobs,
)


class ResponseFormatter(ABC):
    object_name: str
    chunk_object_name: str

    def __init__(self, prepared: PreparedRequest, state: ResponseState):
        self.prepared = prepared
        self.state = state
        self.tokenizer = prepared.model.tokenizer

    @abstractmethod
    def stream_chunks(self, index: int, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """The SSE payloads for a backend chunk already added to the state."""

    @abstractmethod
    def response(self) -> dict[str, Any]:
        """The whole non-streaming body, once every choice has finished."""

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with `include_usage`: totals and no choices."""
        body = self._envelope(self.chunk_object_name)
        body.update(choices=[], usage=self.state.usage(), metadata=self.state.metadata())
        return body

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.prepared.response_id,
            "object": object_name,
            "created": self.prepared.created,
            "model": self.state.served_model,
            "system_fingerprint": self.prepared.model.fingerprint or None,
            "service_tier": self.prepared.tier,
        }

    def _chunk(self, choice: dict[str, Any], with_metadata: bool) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name)
        body["choices"] = [choice]
        if self.prepared.continuous_usage:
            body["usage"] = self.state.usage()
        elif self.prepared.include_usage:
            body["usage"] = None  # as OpenAI sends it: present, null until the final chunk
        if with_metadata:
            body["metadata"] = self.state.metadata()
        return body

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._envelope(self.object_name)
        body.update(choices=choices, usage=self.state.usage(), metadata=self.state.metadata())
        return body


class ChatFormatter(ResponseFormatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, prepared: PreparedRequest, state: ResponseState):
        super().__init__(prepared, state)
        self._splitters: dict[int, ToolCallSplitter] = {}  # per choice, with tools offered

    def stream_chunks(self, index: int, chunk: GenerationChunk) -> list[dict[str, Any]]:
        choice = self.state.choices[index]
        out = []
        if not choice.started:
            choice.started = True
            opening = {"role": "assistant", "content": "", "refusal": None}
            out.append(self._chunk(self._choice(index, opening, None, None), with_metadata=True))
        logprobs = None
        if self.prepared.logprobs is not None and chunk.logprobs:
            logprobs = {"content": chat_logprobs(self.tokenizer, chunk.logprobs), "refusal": None}
        text, calls = chunk.text, []
        splitter = self._splitter(index)
        if splitter is not None:
            split = splitter.feed(text)
            if chunk.finished:
                rest = splitter.finish()
                split.content += rest.content
                split.calls += rest.calls
            text, calls = split.content, split.calls
        if text or calls or logprobs or chunk.finished:
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                first = len(splitter.calls) - len(calls) if splitter else 0
                delta["tool_calls"] = [c.delta_entry(first + i) for i, c in enumerate(calls)]
            reason = self._finish_reason(index) if chunk.finished else None
            payload = self._choice(index, delta, logprobs, reason)
            out.append(self._chunk(payload, with_metadata=chunk.finished))
        return out

    def response(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.state.choices):
            logprobs = None
            if self.prepared.logprobs is not None:
                logprobs = {
                    "content": chat_logprobs(self.tokenizer, choice.logprobs),
                    "refusal": None,
                }
            message: dict[str, Any] = {
                "role": "assistant",
                "content": choice.text,
                "refusal": None,
                "annotations": [],
            }
            splitter = self._splitter(index)
            if splitter is not None:
                content = splitter.feed(choice.text).content + splitter.finish().content
                if splitter.calls:
                    message["content"] = content or None
                    message["tool_calls"] = [c.message_entry() for c in splitter.calls]
                else:
                    message["content"] = content
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": self._finish_reason(index),
                }
            )
        return self._body(choices)

    def _splitter(self, index: int) -> ToolCallSplitter | None:
        parsing = self.prepared.tool_parsing
        if parsing is None:
            return None
        if index not in self._splitters:
            self._splitters[index] = ToolCallSplitter(parsing)
        return self._splitters[index]

    def _finish_reason(self, index: int) -> str | None:
        reason = self.state.choices[index].finish_reason
        splitter = self._splitters.get(index)
        # A reply cut off by max_tokens stays "length", calls or not: it did not end itself.
        if reason == "stop" and splitter is not None and splitter.calls:
            return "tool_calls"
        return reason

    @staticmethod
    def _choice(
        index: int, delta: dict[str, Any], logprobs: dict | None, reason: str | None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


class CompletionFormatter(ResponseFormatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, prepared: PreparedRequest, state: ResponseState):
        super().__init__(prepared, state)
        self._prompt_text = [self.tokenizer.decode(ids) for ids in prepared.prompt_ids]
        self._stream_logprobs: dict[int, CompletionLogprobs] = {}

    def stream_chunks(self, index: int, chunk: GenerationChunk) -> list[dict[str, Any]]:
        choice = self.state.choices[index]
        text = chunk.text
        parts = []
        first = index not in self._stream_logprobs
        if first:
            choice.started = True
            builder = self._builder(index)
            self._stream_logprobs[index] = builder
            if self.prepared.echo:
                text = self._prompt_text[self.prepared.prompt_index(index)] + text
                if self.prepared.logprobs is not None:
                    parts.append(self._prompt_part(builder, index))
        if self.prepared.logprobs is not None and chunk.logprobs:
            parts.append(self._stream_logprobs[index].output(chunk.logprobs))
        if not (text or parts or chunk.finished):
            return []
        logprobs = merge_completion_logprobs(*parts) if self.prepared.logprobs is not None else None
        reason = choice.finish_reason if chunk.finished else None
        payload = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return [self._chunk(payload, with_metadata=first or chunk.finished)]

    def response(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.state.choices):
            text = choice.text
            if self.prepared.echo:
                text = self._prompt_text[self.prepared.prompt_index(index)] + text
            logprobs = None
            if self.prepared.logprobs is not None:
                builder = self._builder(index)
                parts = [self._prompt_part(builder, index)] if self.prepared.echo else []
                parts.append(builder.output(choice.logprobs))
                logprobs = merge_completion_logprobs(*parts)
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }
            )
        return self._body(choices)

    def _builder(self, index: int) -> CompletionLogprobs:
        # Offsets count from the start of the returned text; without echo that text starts
        # right after the prompt, as in OpenAI's API.
        start = (
            0 if self.prepared.echo else len(self._prompt_text[self.prepared.prompt_index(index)])
        )
        return CompletionLogprobs(self.tokenizer, start)

    def _prompt_part(self, builder: CompletionLogprobs, index: int) -> dict[str, list]:
        choice = self.state.choices[index]
        return builder.prompt(
            self.prepared.prompt_ids[self.prepared.prompt_index(index)], choice.prompt_logprobs
        )
