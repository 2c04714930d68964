"""The coordinator's commercial policy in the deployment config: tiers, API keys, prices, routers.

Validated at load like the rest of the schema: a saved router whose CEL condition does not
compile, or whose A/B weights do not add up to anything, refuses the whole config, naming the
router, the expression and the error, rather than failing on the first request that hits it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import celpy

TierName = Literal["priority", "default", "flex", "batch"]
ALL_TIERS: tuple[TierName, ...] = ("priority", "default", "flex", "batch")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServiceTierPolicy(_Strict):
    """Targets (reported, not enforced) and queue limits of one tier."""

    ttft_goal_ms: float | None = Field(None, gt=0)
    itl_goal_ms: float | None = Field(None, gt=0)
    max_queue: int = Field(0, ge=0, description="requests of this tier that may wait; 0 = none")
    max_wait_s: float | None = Field(None, gt=0, description="waiting longer is a 429; None = any")
    # Slots past the model's in-flight limit that only this tier may take: a priority request
    # should not sit behind a batch request's whole generation; the engine preempts for it.
    burst: int = Field(0, ge=0)


class ServiceTiersConfig(_Strict):
    priority: ServiceTierPolicy = ServiceTierPolicy(
        ttft_goal_ms=500, itl_goal_ms=50, max_queue=256, burst=4
    )
    # No queue: under overload a default request is told to come back (429 + Retry-After).
    default: ServiceTierPolicy = ServiceTierPolicy(ttft_goal_ms=2000, itl_goal_ms=100, max_queue=0)
    flex: ServiceTierPolicy = ServiceTierPolicy(max_queue=256, max_wait_s=30.0)
    batch: ServiceTierPolicy = ServiceTierPolicy(max_queue=4096)
    max_in_flight: int | None = Field(
        None, ge=1, description="requests in flight per model at the coordinator; None = no limit"
    )
    max_in_flight_per_model: dict[str, int] = Field(default_factory=dict)

    def policy(self, tier: str) -> ServiceTierPolicy:
        return getattr(self, tier)

    def limit(self, model_id: str) -> int | None:
        return self.max_in_flight_per_model.get(model_id, self.max_in_flight)

    @model_validator(mode="after")
    def _positive_limits(self) -> ServiceTiersConfig:
        bad = {m: n for m, n in self.max_in_flight_per_model.items() if n < 1}
        if bad:
            raise ValueError(f"max_in_flight_per_model must be positive; got {bad}")
        return self


class ApiKeyEntry(_Strict):
    name: str = Field(min_length=1, description="for logs and metrics; the key is never logged")
    key: str = Field(min_length=8, repr=False)
    default_tier: TierName = "default"
    allowed_tiers: list[TierName] = Field(default_factory=lambda: list(ALL_TIERS), min_length=1)

    @model_validator(mode="after")
    def _default_is_allowed(self) -> ApiKeyEntry:
        if self.default_tier not in self.allowed_tiers:
            raise ValueError(
                f"api key '{self.name}': default_tier '{self.default_tier}' is not among its "
                f"allowed_tiers ({', '.join(self.allowed_tiers)})"
            )
        return self


class ApiKeysConfig(_Strict):
    """Keys with entitlements, inline or in a YAML file (a list of entries like `keys`).

    The older `coordinator.api_keys_file` (one key per line, every tier) keeps working.
    """

    keys: list[ApiKeyEntry] = Field(default_factory=list)
    file: str | None = None


class Price(_Strict):
    """USD per million tokens."""

    input: float = Field(ge=0)
    cached_input: float = Field(ge=0)
    output: float = Field(ge=0)


def default_prices() -> dict[TierName, Price]:
    # Cached input at a tenth of fresh input; priority at a premium, flex and batch at half.
    return {
        "priority": Price(input=0.25, cached_input=0.025, output=1.0),
        "default": Price(input=0.15, cached_input=0.015, output=0.6),
        "flex": Price(input=0.075, cached_input=0.0075, output=0.3),
        "batch": Price(input=0.075, cached_input=0.0075, output=0.3),
    }


class RouteFallback(_Strict):
    ttft_timeout: float = Field(gt=0, description="ms to the first token before the next model")


class RouteCondition(_Strict):
    when: str = Field(min_length=1, description="CEL over `request` (metadata, messages, user)")
    models: list[str] = Field(min_length=1)


class RouteVariant(_Strict):
    name: str = Field(min_length=1)
    weight: float = Field(ge=0)
    models: list[str] = Field(min_length=1)


class SavedRouter(_Strict):
    """Addressed as `model: "router/<name>"`: first matching condition, else a sticky A/B
    variant, else `models`; the chosen list is tried in order under `fallback`."""

    models: list[str] = Field(default_factory=list)
    fallback: RouteFallback | None = None
    conditions: list[RouteCondition] = Field(default_factory=list)
    variants: list[RouteVariant] = Field(default_factory=list)

    @property
    def referenced_models(self) -> set[str]:
        lists = [self.models, *(c.models for c in self.conditions)]
        lists += [v.models for v in self.variants]
        return {m for models in lists for m in models}


def compile_cel(expression: str) -> celpy.Runner:
    # Imported here: cel-python (with lark and pendulum) is a tenth of the coordinator's
    # start-up, and a deployment without saved-router conditions never needs it.
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(expression))


def _check_model_routes(routes: dict[str, SavedRouter]) -> dict[str, SavedRouter]:
    for name, router in routes.items():
        if not name or "/" in name:
            raise ValueError(f"router name {name!r} must be non-empty and contain no '/'")
        if not router.models and not router.variants:
            raise ValueError(
                f"router '{name}' needs `models` or `variants` for requests no condition matches"
            )
        if router.variants and sum(v.weight for v in router.variants) <= 0:
            raise ValueError(
                f"router '{name}': variant weights must sum to a positive number, got "
                f"{sum(v.weight for v in router.variants)}"
            )
        names = [v.name for v in router.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"router '{name}': variant names must be unique; got {names}")
        for index, condition in enumerate(router.conditions):
            try:
                compile_cel(condition.when)
            except Exception as exc:
                raise ValueError(
                    f"router '{name}': condition {index} `{condition.when}` does not compile "
                    f"as CEL: {type(exc).__name__}: {exc}"
                ) from exc
    return routes


ModelRoutesConfig = Annotated[dict[str, SavedRouter], AfterValidator(_check_model_routes)]


def _fill_prices(prices: dict[TierName, Price]) -> dict[TierName, Price]:
    # A table naming only some tiers keeps the defaults for the others: every response has
    # a cost, never a missing one.
    return {**default_prices(), **prices}


Prices = Annotated[dict[TierName, Price], AfterValidator(_fill_prices)]
