"""Knobs of the coordinator's HTTP surface, validated once when the app is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.coordinator.keys import ApiKey, KeyRing
from shared.config.policy import Price, SavedRouter, ServiceTiersConfig, default_prices
from shared.config.schema import TrainingLogConfig
from shared.modelfile.default import DEFAULT_MODEL_ID


@dataclass(frozen=True)
class APISettings:
    model_id: str = DEFAULT_MODEL_ID  # the model `/v1/models` lists first; requests name it
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get a 413
    max_tokens_limit: int = 4096  # the largest max_tokens / max_completion_tokens accepted
    default_max_tokens: int = 512  # chat output budget when the client gives none
    # OpenAI's legacy completions default; scoring harnesses rely on it.
    default_completion_max_tokens: int = 16
    max_choices: int = 16  # prompts x n in one request
    # Times one request may move to another replica pair when one dies under it.
    max_migrations: int = 2
    # Bearer keys accepted on /v1/*; empty = no authentication.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Keys with tier entitlements; both kinds are accepted when both are given.
    keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    tiers: ServiceTiersConfig = ServiceTiersConfig()
    prices: dict[str, Price] = field(default_factory=default_prices)
    saved_routers: dict[str, SavedRouter] = field(default_factory=dict)
    playground_enabled: bool = True  # serve /playground and its fleet and trace views
    # Finished requests' token ids go here when the operator turned capture on; None = off.
    training_log: TrainingLogConfig | None = None

    @property
    def keyring(self) -> KeyRing:
        return KeyRing(KeyRing.from_plain(self.api_keys).keys + self.keys)

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "prices", {**default_prices(), **self.prices})
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        for name in (
            "max_body_bytes",
            "max_tokens_limit",
            "default_max_tokens",
            "default_completion_max_tokens",
            "max_choices",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_migrations, int) or self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit "
                f"({self.max_tokens_limit})"
            )
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
