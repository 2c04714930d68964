"""API keys: who is calling, the service tier they get by default, the service tiers they may
ask for, and the 401 a missing or wrong key gets.

Keys are compared in constant time against every configured key; only the key's configured
name ever reaches logs and metrics.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from starlette.requests import Request

from services.coordinator.errors import APIError
from services.coordinator.service_tiers import SERVED_TIERS

ANONYMOUS = "anonymous"


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str = field(repr=False)
    default_tier: str = "default"
    allowed_tiers: tuple[str, ...] = SERVED_TIERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_tiers", tuple(self.allowed_tiers))
        if not self.key:
            raise ValueError(f"api key '{self.name}' is empty")
        unknown = [t for t in (self.default_tier, *self.allowed_tiers) if t not in SERVED_TIERS]
        if unknown:
            raise ValueError(f"api key '{self.name}': unknown tier(s) {unknown}")
        if self.default_tier not in self.allowed_tiers:
            raise ValueError(
                f"api key '{self.name}': default_tier '{self.default_tier}' is not allowed"
            )

    def resolve_tier(self, requested: str | None) -> str:
        """The tier served: `auto` or none means the key's default; others must be allowed.

        `requested` was already checked to be a known tier (unknown ones are a 400 earlier).
        """
        tier = self.default_tier if requested in (None, "auto") else requested
        if tier not in self.allowed_tiers:
            raise APIError(
                403,
                f"This API key may not use service_tier '{tier}'; it may use: "
                f"{', '.join(self.allowed_tiers)}.",
                param="service_tier",
                code="tier_not_allowed",
            )
        return tier


# With no keys configured nobody authenticates and every tier is open.
OPEN_ACCESS = ApiKey(name=ANONYMOUS, key="-", default_tier="default")


@dataclass(frozen=True)
class KeyRing:
    keys: tuple[ApiKey, ...] = ()

    @classmethod
    def from_plain(cls, keys: tuple[str, ...]) -> KeyRing:
        """Keys from the older one-per-line file: every tier, the default one by default."""
        return cls(tuple(ApiKey(name=f"key-{i}", key=k) for i, k in enumerate(keys)))

    def authenticate(self, request: Request) -> ApiKey:
        """The caller's key, or a 401; `OPEN_ACCESS` when no keys are configured."""
        if not self.keys:
            return OPEN_ACCESS
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized(
                "You didn't provide an API key. Send it in an Authorization header: "
                "'Authorization: Bearer YOUR_KEY'."
            )
        offered = token.encode()
        found: ApiKey | None = None
        # Every key is compared, with no early exit, so timing tells nothing about which
        # one (or how much of one) matched.
        for entry in self.keys:
            if hmac.compare_digest(offered, entry.key.encode()) and found is None:
                found = entry
        if found is None:
            raise unauthorized("Incorrect API key provided.")
        return found
