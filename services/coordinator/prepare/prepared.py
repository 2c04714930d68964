"""From a validated API body to the backend requests that serve it (one per choice).

Tokenizes once (chat template, then encode), applies the token limits and the context
window, builds `SamplingParams`, maps `service_tier` to a priority. Every refusal is an
`APIError` naming the parameter the way the client sent it. CPU-bound (tokenizing long
conversations): call it off the event loop.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from services.coordinator.errors import APIError, bad_request
from services.coordinator.generation_backend import GenerationRequest, ModelInfo
from services.coordinator.prepare.chat_prompt import render_chat
from services.coordinator.prepare.prompt_tokens import PromptTokens
from services.coordinator.prepare.schemas import ChatCompletionRequest, CompletionRequest
from services.coordinator.prepare.tool_calls import ToolCallParsing
from services.coordinator.service_tiers import resolve_tier, tier_priority
from services.coordinator.settings import APISettings
from shared.sampling.params import MAX_SEED, SamplingParamError, SamplingParams
from shared.sampling.structured import StructuredOutput, StructuredOutputError, canonical_json

Endpoint = Literal["chat", "completion"]


@dataclass
class PreparedRequest:
    """One API request made ready for the backends: tokenized, limited, at a service tier."""

    endpoint: Endpoint
    response_id: str
    model: ModelInfo
    tier: str
    requests: list[GenerationRequest]  # choice i is requests[i]
    prompt_ids: list[list[int]]  # per distinct prompt; choice i serves prompt i // n
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None  # alternatives per output token, None = no logprobs
    echo: bool = False
    drop_output: bool = False  # max_tokens=0: the one token generated is discarded
    tool_parsing: ToolCallParsing | None = None  # chat with tools offered: calls are parsed
    # Engine parameter names -> what this client called them (`max_completion_tokens`, ...).
    param_names: dict[str, str] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    def prompt_index(self, choice: int) -> int:
        return choice // self.n


def prepare_chat(
    body: ChatCompletionRequest,
    model: ModelInfo,
    encoder: PromptTokens,
    settings: APISettings,
    tier: str | None = None,
) -> PreparedRequest:
    """`encoder`: the model's tokenizer, with the pieces earlier turns encoded."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    chat = render_chat(body, model.tokenizer)
    prompt = encoder.encode(chat.text)
    limit_param = (
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if requested is not None and requested < 1:
        raise bad_request(f"{limit_param} must be at least 1, got {requested}", limit_param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prepared = _build(
        "chat",
        "chatcmpl",
        body,
        model,
        settings,
        prompts=[prompt],
        prompt_param="messages",
        limit_param=limit_param,
        requested=requested,
        default_max=settings.default_max_tokens,
        logprobs=logprobs,
        names={"max_tokens": limit_param, "logprobs": "top_logprobs"},
        tier=tier,
        constraint=chat.tool_constraint,
    )
    prepared.tool_parsing = chat.tool_parsing
    return prepared


def prepare_completion(
    body: CompletionRequest,
    model: ModelInfo,
    encoder: PromptTokens,
    settings: APISettings,
    tier: str | None = None,
) -> PreparedRequest:
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of other than n is not supported", "best_of")
    vocab = model.tokenizer.vocab_size
    prompts: list[list[int]] = []
    for p in body.prompt:
        if isinstance(p, str):
            prompts.append(encoder.encode(p))
            continue
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        prompts.append(list(p))
    requested = body.max_tokens
    if requested is not None and requested < 0:
        raise bad_request(f"max_tokens must be at least 0, got {requested}", "max_tokens")
    prepared = _build(
        "completion",
        "cmpl",
        body,
        model,
        settings,
        prompts=prompts,
        prompt_param="prompt",
        limit_param="max_tokens",
        requested=1 if requested == 0 else requested,  # see PreparedRequest.drop_output
        default_max=settings.default_completion_max_tokens,
        logprobs=body.logprobs,
        names={},
        prompt_logprobs=body.echo and body.logprobs is not None,
        tier=tier,
    )
    prepared.echo = body.echo
    prepared.drop_output = requested == 0
    return prepared


def _build(
    endpoint: Endpoint,
    id_prefix: str,
    body: ChatCompletionRequest | CompletionRequest,
    model: ModelInfo,
    settings: APISettings,
    *,
    prompts: list[list[int]],
    prompt_param: str,
    limit_param: str,
    requested: int | None,
    default_max: int,
    logprobs: int | None,
    names: dict[str, str],
    prompt_logprobs: bool = False,
    tier: str | None = None,
    constraint: StructuredOutput | None = None,
) -> PreparedRequest:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    n = body.n if body.n is not None else 1
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}", "n")
    if n * len(prompts) > settings.max_choices:
        raise bad_request(
            f"{len(prompts)} prompt(s) x n={n} asks for {n * len(prompts)} choices; at most "
            f"{settings.max_choices} are allowed per request",
            "n",
        )
    if requested is not None and requested > settings.max_tokens_limit:
        raise bad_request(
            f"{limit_param} is {requested}; this server allows at most {settings.max_tokens_limit}",
            limit_param,
        )
    # The caller resolves `auto` against the API key; without one, as at OpenAI.
    tier = tier or resolve_tier(body.service_tier)
    structured = _structured_output(body)
    if constraint is not None:  # a forced tool call: its grammar is the reply's
        if structured is not None:
            raise bad_request(
                "response_format cannot be combined with a required or named tool_choice: "
                "the reply is the tool call",
                "response_format",
            )
        structured = constraint
    response_id = f"{id_prefix}-{uuid.uuid4().hex}"
    context = model.context_length
    requests: list[GenerationRequest] = []
    for prompt in prompts:
        max_tokens = _max_tokens(prompt, context, requested, default_max, prompt_param, limit_param)
        for copy in range(n):
            params = _sampling_params(body, max_tokens, logprobs, copy, names, structured)
            index = len(requests)
            requests.append(
                GenerationRequest(
                    request_id=response_id if n * len(prompts) == 1 else f"{response_id}-{index}",
                    model=model.id,
                    prompt_token_ids=prompt,
                    params=params,
                    priority=tier_priority(tier),
                    service_tier=tier,
                    prompt_logprobs=prompt_logprobs,
                    user=body.user,
                )
            )
    options = body.stream_options
    return PreparedRequest(
        endpoint=endpoint,
        response_id=response_id,
        model=model,
        tier=tier,
        requests=requests,
        prompt_ids=prompts,
        n=n,
        stream=body.stream,
        include_usage=bool(options and (options.include_usage or options.continuous_usage_stats)),
        continuous_usage=bool(options and options.continuous_usage_stats),
        logprobs=logprobs,
        param_names={**names, "prompt": prompt_param},
    )


def _structured_output(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """`response_format` as the workers' constraint; the shape is checked here, the schema
    itself where it is compiled (a worker's refusal is a 400 on `response_format`)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise bad_request(
                "json_schema is only allowed with type 'json_schema'", "response_format.json_schema"
            )
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.json_schema is None:
        raise bad_request(
            "response_format of type 'json_schema' needs a 'json_schema' object",
            "response_format.json_schema",
        )
    try:
        return StructuredOutput("json_schema", canonical_json(fmt.json_schema.schema_))
    except StructuredOutputError as exc:
        raise bad_request(str(exc), "response_format.json_schema.schema") from exc


def _max_tokens(
    prompt: list[int],
    context: int,
    requested: int | None,
    default_max: int,
    prompt_param: str,
    limit_param: str,
) -> int:
    if not prompt:
        raise bad_request(f"{prompt_param} must not be empty", prompt_param)
    room = context - len(prompt)
    if room < 1:
        raise APIError(
            400,
            f"This model's context window is {context} tokens, but the {prompt_param} use "
            f"{len(prompt)} tokens; shorten them to leave room for the reply.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default_max, room)
    if requested > room:
        raise APIError(
            400,
            f"This model's context window is {context} tokens; the {prompt_param} use "
            f"{len(prompt)} tokens and {limit_param} asks for {requested} more. Lower "
            f"{limit_param} to at most {room} or shorten the {prompt_param}.",
            param=limit_param,
            code="context_length_exceeded",
        )
    return requested


def _sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    copy: int,
    names: dict[str, str],
    structured: StructuredOutput | None,
) -> SamplingParams:
    given = {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        )
        if getattr(body, name) is not None
    }
    seed = body.seed
    if seed is not None and copy:
        # n > 1 with a seed: distinct but reproducible choices.
        seed = seed + copy if seed + copy <= MAX_SEED else seed - copy
    try:
        return SamplingParams(
            **given,
            seed=seed,
            stop=body.stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            max_tokens=max_tokens,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            structured=structured,
        )
    except SamplingParamError as exc:
        param = names.get(exc.param, exc.param)
        raise bad_request(f"Invalid value for '{param}': {exc.message}", param) from exc
