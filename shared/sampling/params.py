"""Per-request sampling parameters, validated once where a request enters the system.

Everything below the API edge (batch building, the sampler, the engine) trusts a
``SamplingParams`` it receives, so every limit a user could break is checked here and
reported as a ``SamplingParamError`` that names the offending parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.sampling.structured import StructuredOutput, StructuredOutputError

# Limits. Temperature is looser than OpenAI's 2.0 because the distribution is still well
# defined far beyond it; the hard requirement is a finite number.
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
# torch generators take any 64-bit seed; accepting the signed range too lets clients send
# negative seeds, which are folded into the unsigned range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class SamplingParamError(ValueError):
    """A user-supplied sampling parameter is out of range; ``param`` names it for the API."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report per token
    # The output must match this (JSON object or JSON schema); None: free text.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept any sequence (and a lone string, as OpenAI's `stop` allows) but store tuples
        # so the params stay hashable and immutable.
        stop = self.stop or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """The token is the argmax of the raw logits and nothing else is read from them: no
        penalty, grammar or logprobs (so a model may find it without the full logits)."""
        return (
            self.is_greedy
            and not self.uses_repetition_penalty
            and not self.uses_count_penalties
            and self.logprobs is None
            and self.structured is None
        )

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_count_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def continued(self, num_tokens: int) -> SamplingParams:
        """The params of a continuation whose prompt ends with `num_tokens` tokens this
        request already generated: that much less to generate, and a structured output's
        grammar state rebuilt from those tokens."""
        structured = self.structured
        if structured is not None:
            structured = replace(structured, replay_tokens=structured.replay_tokens + num_tokens)
        return replace(self, max_tokens=max(1, self.max_tokens - num_tokens), structured=structured)

    def validate(self, max_context: int | None = None, prompt_tokens: int = 0) -> None:
        """Raise ``SamplingParamError`` for the first parameter out of range.

        Called on construction without a context; call again with the model's context length
        (and the prompt length) once they are known to check that the output fits.
        """
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        if self.seed is not None:
            _check_int("seed", self.seed, low=MIN_SEED, high=MAX_SEED)
        _check_stop(self.stop)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise SamplingParamError(
                    "response_format", f"must be a StructuredOutput, got {self.structured!r}"
                )
            try:
                self.structured.validate()
            except StructuredOutputError as exc:
                raise SamplingParamError("response_format", str(exc)) from exc
        if max_context is not None and prompt_tokens + self.max_tokens > max_context:
            raise SamplingParamError(
                "max_tokens",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({self.max_tokens}) exceeds "
                f"the model's context length of {max_context} tokens",
            )


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    # bool is an int subclass; `max_tokens=True` is a client bug worth reporting.
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamError(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise SamplingParamError(name, f"must be {bound}, got {value}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise SamplingParamError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingParamError(name, f"must be a finite number, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        left = "(" if low_open else "["
        right = ")" if math.isinf(high) else "]"
        raise SamplingParamError(name, f"must be in {left}{low}, {high}{right}, got {value}")


def _check_stop(stop: Sequence[object]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise SamplingParamError(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}"
        )
    for s in stop:
        if not isinstance(s, str):
            raise SamplingParamError("stop", f"stop strings must be strings, got {s!r}")
        if not s:
            raise SamplingParamError("stop", "stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise SamplingParamError(
                "stop",
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                f"got one of {len(s)}",
            )
