"""Model routes, the config's saved routers (`model: "router/<name>"`): CEL conditions,
sticky A/B variants, fallback. (Not the KV router, which picks replicas: a model route picks
models.)

A route picks the ordered model list a request will try: the first condition whose CEL
expression holds for the request, else a weighted variant chosen by a hash of the route's
name and the `user` (so one user always sees the same variant), else the route's `models`.
Expressions were compiled once when the config was loaded.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.coordinator.errors import APIError
from shared.config.policy import SavedRouter, compile_cel

if TYPE_CHECKING:
    import celpy

PREFIX = "router/"


@dataclass(frozen=True)
class ModelRouteChoice:
    models: list[str]
    ttft_timeout_ms: float | None = None
    reasoning: list[str] = field(default_factory=list)


def bucket(route: str, key: str) -> float:
    """A stable point in [0, 1) for (route, key): the same user lands in the same variant,
    and different routes split the same users independently."""
    digest = hashlib.blake2b(f"{route}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass
class _Compiled:
    name: str
    config: SavedRouter
    conditions: list[celpy.Runner]


class SavedRouters:
    def __init__(self, routes: dict[str, SavedRouter]):
        self._routes = {
            name: _Compiled(name, r, [compile_cel(c.when) for c in r.conditions])
            for name, r in routes.items()
        }

    def names(self) -> list[str]:
        return sorted(self._routes)

    def referenced_models(self) -> dict[str, set[str]]:
        return {n: r.config.referenced_models for n, r in self._routes.items()}

    def choose(self, name: str, request: dict[str, Any]) -> ModelRouteChoice:
        """Models for `request` (the CEL view: metadata, messages, user, ...) via route `name`."""
        compiled = self._routes.get(name)
        if compiled is None:
            known = ", ".join(self.names()) or "none are configured"
            raise APIError(
                404,
                f"The saved router '{PREFIX}{name}' does not exist (known: {known}).",
                param="model",
                code="router_not_found",
            )
        route = compiled.config
        timeout = route.fallback.ttft_timeout if route.fallback else None
        reasoning: list[str] = []
        if route.conditions:
            matched = _first_match(name, compiled, request, reasoning)
            if matched is not None:
                return ModelRouteChoice(matched, timeout, reasoning)
        if route.variants:
            user = request.get("user")
            key = user or uuid.uuid4().hex
            point = bucket(name, key)
            total = sum(v.weight for v in route.variants)
            edge = 0.0
            chosen = route.variants[-1]
            for variant in route.variants:
                edge += variant.weight / total
                if point < edge and variant.weight > 0:
                    chosen = variant
                    break
            how = f"sticky for user {user!r}" if user else "per request (no user)"
            reasoning.append(f"router {name}: variant '{chosen.name}' ({how}, bucket {point:.3f})")
            return ModelRouteChoice(list(chosen.models), timeout, reasoning)
        reasoning.append(f"router {name}: no condition matched; default models")
        return ModelRouteChoice(list(route.models), timeout, reasoning)


def _first_match(
    name: str, compiled: _Compiled, request: dict[str, Any], reasoning: list[str]
) -> list[str] | None:
    """The models of the first condition that holds for `request`, or None."""
    import celpy  # compile_cel imported it when the config loaded (see shared.config.policy)

    activation = {"request": celpy.json_to_cel(request)}
    for index, (condition, runner) in enumerate(
        zip(compiled.config.conditions, compiled.conditions, strict=True)
    ):
        try:
            matched = bool(runner.evaluate(activation))
        except celpy.CELEvalError as exc:
            # A field this request lacks (no metadata.plan, say) means "no match".
            reasoning.append(
                f"router {name}: condition {index} `{condition.when}` "
                f"not evaluable ({exc.args[0] if exc.args else exc})"
            )
            continue
        if matched:
            reasoning.append(f"router {name}: condition {index} `{condition.when}` matched")
            return list(condition.models)
    return None


def cel_view(body: Any) -> dict[str, Any]:
    """What CEL conditions see of a request body: `request.metadata`, `.messages`, `.user`."""
    messages = [
        {"role": m.role, "content": _text(m.content)} for m in getattr(body, "messages", None) or []
    ]
    view: dict[str, Any] = {
        "model": body.model or "",
        "metadata": dict(body.metadata or {}),
        "messages": messages,
        "user": body.user or "",
        "service_tier": body.service_tier or "auto",
    }
    prompt = getattr(body, "prompt", None)
    if prompt is not None:
        view["prompt"] = [p for p in prompt if isinstance(p, str)]
    return view


def _text(content: str | list[dict[str, str]] | None) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)
