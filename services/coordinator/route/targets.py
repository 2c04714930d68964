"""Which models a request will try, in order: from `model`/`models`, or a saved router."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.coordinator.errors import APIError, bad_request
from services.coordinator.generation_backend import ModelInfo
from services.coordinator.route.saved_routers import PREFIX, SavedRouters, cel_view

DEFAULT_MAX_MIGRATIONS = 2


@dataclass(frozen=True)
class RetryPolicy:
    """What the retry loop runs a request by: the models to try in order, the TTFT deadline
    after which it falls back to the next, and how many times it may migrate."""

    models: list[str]
    ttft_timeout_ms: float | None = None  # None: fall back only on failures
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    reasoning: list[str] = field(default_factory=list)  # from choosing the models

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a retry policy needs at least one model")
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")


def resolve_targets(
    body: Any,
    routes: SavedRouters,
    default_model: str,
    served: list[ModelInfo],
    max_migrations: int,
) -> tuple[RetryPolicy, list[ModelInfo]]:
    """The request's retry policy and the models it names, each one checked to be served.

    A request's own `fallback.ttft_timeout` overrides a saved router's.
    """
    requested = body.model or default_model
    timeout = body.fallback.ttft_timeout if body.fallback else None
    if requested.startswith(PREFIX):
        if body.models:
            raise bad_request("models cannot be combined with a saved router", "models")
        choice = routes.choose(requested[len(PREFIX) :], cel_view(body))
        models, reasoning = choice.models, list(choice.reasoning)
        timeout = timeout if timeout is not None else choice.ttft_timeout_ms
    else:
        models = list(body.models or [requested])
        if body.model and models[0] != body.model:
            models.insert(0, body.model)
        reasoning = []
    by_id = {info.id: info for info in served}
    infos = []
    for index, model_id in enumerate(models):
        info = by_id.get(model_id)
        if info is None:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist or is not served here; see /v1/models.",
                param="model" if index == 0 and not body.models else "models",
                code="model_not_found",
            )
        infos.append(info)
    fingerprint = infos[0].tokenizer.fingerprint
    odd = [i.id for i in infos if i.tokenizer.fingerprint != fingerprint]
    if odd:
        # The prompt is tokenized once, for the first model; a fallback must read it the same.
        raise bad_request(
            f"models {odd} use a different tokenizer from '{infos[0].id}'; fallback models "
            "must share the first one's tokenizer",
            "models",
        )
    if timeout is not None and len(models) > 1:
        reasoning.append(f"fallback: {' -> '.join(models)}, TTFT deadline {timeout:g} ms")
    return RetryPolicy(models, timeout, max_migrations, reasoning), infos
