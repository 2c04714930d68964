"""Latency targets: parsed once from `ttft_p99_ms=…,itl_p99_ms=…`, judged against a replay."""

from __future__ import annotations

from dataclasses import dataclass

SLO_KEYS: tuple[str, ...] = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p90_ms",
    "itl_p99_ms",
)


@dataclass(frozen=True)
class SLO:
    targets: dict[str, float]  # e.g. {"ttft_p99_ms": 2000.0, "itl_p99_ms": 100.0}

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("an SLO needs at least one target")
        for key, value in self.targets.items():
            if key not in SLO_KEYS:
                raise ValueError(f"unknown SLO key {key!r}; valid: {', '.join(SLO_KEYS)}")
            if not value > 0:
                raise ValueError(f"SLO {key} must be a positive number of ms, got {value}")

    @property
    def ttft_keys(self) -> list[str]:
        return [k for k in self.targets if k.startswith("ttft")]

    @property
    def itl_keys(self) -> list[str]:
        return [k for k in self.targets if k.startswith("itl")]

    def violation(self, latency: dict, keys: list[str] | None = None) -> float:
        """max over targets of predicted / target: <= 1 meets them all. A missing figure
        (no tokens to measure) counts as met."""
        worst = 0.0
        for key in keys if keys is not None else list(self.targets):
            value = latency.get(key)
            if value is not None:
                worst = max(worst, value / self.targets[key])
        return worst

    def describe(self) -> str:
        return ",".join(f"{k}={v:g}" for k, v in self.targets.items())


def parse_slo(text: str) -> SLO:
    targets: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"bad SLO item {part!r}: expected KEY=MILLISECONDS")
        try:
            targets[key] = float(value)
        except ValueError:
            raise ValueError(f"SLO {key}: {value!r} is not a number") from None
    return SLO(targets)
