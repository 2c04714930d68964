"""The calibration a profile produces and the simulator consumes: fitted step-time models of
one replica, plus the facts about its KV cache the simulator needs.

Prefill runs in chunks (a token budget per engine step); a step's time is
    prefill_step_ms = step_ms + token_ms * tokens + attn_ms * attended
where `attended` sums, over the chunk's new tokens, the positions each one attends to (a chunk
of n tokens at offset o attends to n * (o + n / 2) earlier positions): the quadratic part of a
long prompt, and why a cached prefix still costs something. A decode step over a batch is
    decode_step_ms = base_ms + seq_ms * batch + ctx_ms * C + ctx2_ms * C^2
with C the sum of the batch's contexts (the quadratic term is zero unless the measurements
need it: on a CPU a big batch's KV stops fitting in cache and each token gets dearer)
and a KV transfer of b bytes takes latency_ms + b / bytes_per_ms.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class PrefillModel:
    step_ms: float
    token_ms: float
    attn_ms: float

    def step(self, tokens: float, attended: float) -> float:
        return self.step_ms + self.token_ms * tokens + self.attn_ms * attended


@dataclass(frozen=True)
class DecodeModel:
    base_ms: float
    seq_ms: float
    ctx_ms: float
    ctx2_ms: float = 0.0  # per squared token: the batch's KV outgrowing the CPU caches
    # Mixture of experts: reading every routed expert once costs `experts_ms`; a batch of B
    # reads the fraction 1 - (1 - k/E)^B of them that its tokens touch (uniform routing).
    experts_ms: float = 0.0
    experts: int = 0
    experts_per_token: int = 0

    def step(self, batch: int, context_sum: float) -> float:
        ms = (
            self.base_ms
            + self.seq_ms * batch
            + (self.ctx_ms + self.ctx2_ms * context_sum) * context_sum
        )
        if self.experts_ms:
            ms += self.experts_ms * touched_fraction(self.experts, self.experts_per_token, batch)
        return ms

    def scaled(self, factor: float) -> DecodeModel:
        return replace(
            self,
            base_ms=self.base_ms * factor,
            seq_ms=self.seq_ms * factor,
            ctx_ms=self.ctx_ms * factor,
            ctx2_ms=self.ctx2_ms * factor,
            experts_ms=self.experts_ms * factor,
        )


def touched_fraction(experts: int, per_token: int, tokens: float) -> float:
    """The expected fraction of E experts that n tokens routing to k each touch."""
    return 1.0 - (1.0 - per_token / experts) ** tokens


@dataclass(frozen=True)
class TransferModel:
    latency_ms: float
    gb_s: float

    def ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / (self.gb_s * 1e6)


@dataclass(frozen=True)
class ReplicaProfile:
    prefill: PrefillModel
    decode: DecodeModel
    transfer: TransferModel
    chunk_tokens: int  # the prefill token budget per step the measurements ran with
    kv_bytes_per_token: int
    max_context: int
    kv_capacity_tokens: int  # tokens of KV one replica holds (prefix cache size, decode room)
    meta: dict = field(default_factory=dict)  # model, weights, threads, machine, date, fit errors
    measurements: dict = field(default_factory=dict)  # the raw points the fits came from
    # What the serving path (HTTP, coordinator, gRPC) adds to a first token beyond the engine
    # and the KV push; 0 for a bare-engine profile.
    serving_overhead_ms: float = 0.0

    def prefill_ms(self, tokens: int, cached: int = 0) -> float:
        """One prompt alone on a replica: `tokens` long, the first `cached` already in cache."""
        return prefill_alone_ms(self.prefill, tokens, cached, self.chunk_tokens)

    def lone_ttft_ms(self, tokens: int, cached: int = 0) -> float:
        """First token of a prompt alone on a replica: its prefill and the serving path. The
        KV push is not in it: the first token is streamed before the KV moves."""
        return self.prefill_ms(tokens, cached) + self.serving_overhead_ms

    def to_dict(self) -> dict:
        return asdict(self)

    def rescaled(
        self, prefill_factor: float, decode_factor: float, serving_overhead_ms: float
    ) -> ReplicaProfile:
        """The same shapes at another speed (a replica with more or less of the CPU)."""
        p = self.prefill
        return replace(
            self,
            prefill=PrefillModel(
                p.step_ms * prefill_factor, p.token_ms * prefill_factor, p.attn_ms * prefill_factor
            ),
            decode=self.decode.scaled(decode_factor),
            serving_overhead_ms=serving_overhead_ms,
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, raw: dict, origin: str = "<profile>") -> ReplicaProfile:
        try:
            profile = cls(
                prefill=PrefillModel(**raw["prefill"]),
                decode=DecodeModel(**raw["decode"]),
                transfer=TransferModel(**raw["transfer"]),
                chunk_tokens=int(raw["chunk_tokens"]),
                kv_bytes_per_token=int(raw["kv_bytes_per_token"]),
                max_context=int(raw["max_context"]),
                kv_capacity_tokens=int(raw["kv_capacity_tokens"]),
                meta=dict(raw.get("meta", {})),
                measurements=dict(raw.get("measurements", {})),
                serving_overhead_ms=float(raw.get("serving_overhead_ms", 0.0)),
            )
        except KeyError as exc:
            raise ProfileError(f"{origin}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"{origin}: malformed profile: {exc}") from None
        profile.check(origin)
        return profile

    def check(self, origin: str = "<profile>") -> None:
        if self.chunk_tokens < 1 or self.max_context < 2 or self.kv_capacity_tokens < 1:
            raise ProfileError(
                f"{origin}: chunk_tokens, max_context and kv_capacity_tokens must be positive"
            )
        if self.serving_overhead_ms < 0:
            raise ProfileError(f"{origin}: serving_overhead_ms is negative")
        if self.transfer.gb_s <= 0:
            raise ProfileError(f"{origin}: transfer.gb_s must be positive")
        coefficients = {
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "transfer.latency_ms": {"": self.transfer.latency_ms},
        }
        for group, values in coefficients.items():
            for name, value in values.items():
                if value < 0:
                    raise ProfileError(f"{origin}: {group}.{name} is negative ({value})")
        if self.prefill.token_ms <= 0 and self.prefill.step_ms <= 0:
            raise ProfileError(f"{origin}: prefill costs nothing (all coefficients zero)")
        d = self.decode
        if d.experts_ms and not 0 < d.experts_per_token <= d.experts:
            raise ProfileError(f"{origin}: decode.experts_per_token must be in 1..experts")
        if d.base_ms + d.seq_ms + d.experts_ms <= 0:
            raise ProfileError(f"{origin}: a decode step costs nothing")


def load_profile(path: str | Path) -> ReplicaProfile:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: profile file does not exist") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: the top level must be an object")
    return ReplicaProfile.from_dict(raw, str(path))


def chunk_plan(tokens: int, cached: int, chunk: int) -> tuple[int, int, float]:
    """(steps, new tokens, attended positions) of prefilling a prompt alone, chunk by chunk."""
    cached = min(cached, tokens - 1)  # the last prompt token is always computed: it samples
    new = max(0, tokens - cached)
    steps, attended, offset = 0, 0.0, cached
    left = new
    while left > 0:
        n = min(chunk, left)
        attended += n * (offset + n / 2)
        offset += n
        left -= n
        steps += 1
    return steps, new, attended


def prefill_alone_ms(model: PrefillModel, tokens: int, cached: int, chunk: int) -> float:
    steps, new, attended = chunk_plan(tokens, cached, chunk)
    return model.step_ms * steps + model.token_ms * new + model.attn_ms * attended
