"""Pick: the lowest cost, then the lowest tie-break, then the smallest replica id, so two
coordinators with the same view always choose the same replica (never dict order or chance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class Scored(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def cost(self) -> float: ...
    @property
    def tiebreak(self) -> tuple[float, ...]: ...


S = TypeVar("S", bound=Scored)


def pick(scores: Sequence[S]) -> S | None:
    if not scores:
        return None
    return min(scores, key=lambda s: (s.cost, s.tiebreak, s.worker_id))
