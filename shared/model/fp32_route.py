"""Which equivalent fp32 GEMM call serves a few rows fastest on this machine.

`y = x @ W.T` for a handful of rows (a decode step, a verify step of 2–9 query tokens) can be
asked of the BLAS as `linear(x, W)` or, weight-stationary, as `(W @ x.T).T`. The two compute
the same products; which is faster is the BLAS's choice of kernel for the shape, and it
differs by machine. Measured on a 2-core AMD EPYC with torch's MKL: the 49,152 x 576 head took
18 ms for 2 rows and 25 ms for 3 through `linear` (7.9 ms for 1), 3.4 and 4.7 ms
weight-stationary, so a speculative verify step of 3 tokens cost nearly twice a plain step.
On other shapes and row counts `linear` wins.

So the route is measured here, the first time a row count is seen (per thread count): the
most recently registered fp32 weights (the model loaded last, up to `MEASURE_BYTES`, and one
weight of each other shape) are multiplied once through each call in turn, in layer order as
a forward pass streams them, so each call meets its weight as a real step does (out of
cache, on a model larger than the cache; a per-call loop over one hot weight picks
differently). Two rounds, the better kept; the faster call per weight shape is kept for the
process.

Only row counts up to `SMALL_ROWS` are routed; beyond that both calls are the BLAS's ordinary
GEMM regime.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

SMALL_ROWS = 16
_ROUNDS = 2
# The measurement streams at most this much of the most recently loaded weights: well past a
# CPU's cache (so they come from memory, as in a step), and a pause of tens of ms, once per
# row count, whatever else the process holds.
MEASURE_BYTES = 128 << 20

Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_weights: list[weakref.ref[torch.Tensor]] = []
# (out, in, rows, threads) -> the call measured fastest for it (absent: `linear`).
_routes: dict[tuple[int, int, int, int], str] = {}
_measured: set[tuple[int, int]] = set()  # (rows, threads) measured so far


def register(weight: torch.Tensor) -> None:
    """A CPU fp32 weight [out, in] that serves through `fp32_linear`, in forward order."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return
    shape = (weight.shape[0], weight.shape[1])
    if not any(shape == (o, i) for o, i, _, _ in _routes):
        _measured.clear()  # a shape no measurement has seen: measure again, with it
    _weights.append(weakref.ref(weight))


def _weight_stationary(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


def _paired(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # One row asked as two: the BLAS's matrix-vector kernel can stream a large weight at
    # half the rate its two-column GEMM does.
    # (A real copy: a stride-0 `expand` is handed back to the matrix-vector kernel.)
    return torch.mm(weight, x.repeat(2, 1).t()).t()[:1].contiguous()


def _calls(rows: int) -> dict[str, Call]:
    calls: dict[str, Call] = {"linear": F.linear, "weight-stationary": _weight_stationary}
    if rows == 1:
        calls["paired"] = _paired
    return calls


def _pass_seconds(call: Call, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]):
    spent: dict[tuple[int, int], float] = defaultdict(float)
    for w in weights:
        start = time.perf_counter()
        call(xs[w.shape[1]], w)
        spent[(w.shape[0], w.shape[1])] += time.perf_counter() - start
    return spent


def _measure(rows: int, threads: int) -> None:
    _weights[:] = [r for r in _weights if r() is not None]
    weights: list[torch.Tensor] = []
    shapes: set[tuple[int, int]] = set()
    budget = MEASURE_BYTES
    for ref in reversed(_weights):
        w = ref()
        if w is None:
            continue
        shape = (w.shape[0], w.shape[1])
        if budget > 0 or shape not in shapes:  # past the budget, each new shape once
            weights.append(w)
            shapes.add(shape)
            budget -= w.numel() * w.element_size()
    weights.reverse()  # forward order, as a step streams them
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    best: dict[str, dict[tuple[int, int], float]] = {}
    with torch.no_grad():
        for _ in range(_ROUNDS):
            for name, call in _calls(rows).items():
                spent = _pass_seconds(call, weights, xs)
                kept = best.setdefault(name, spent)
                for shape, seconds in spent.items():
                    kept[shape] = min(kept[shape], seconds)
    for shape in best.get("linear", {}):
        _routes[(*shape, rows, threads)] = min(best, key=lambda name: best[name][shape])
    _measured.add((rows, threads))


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for fp32 `weight` [out, in], by the call measured fastest here."""
    if x.dim() != 2 or x.shape[0] > SMALL_ROWS or x.device.type != "cpu":
        return F.linear(x, weight)
    rows, threads = x.shape[0], torch.get_num_threads()
    if (rows, threads) not in _measured:
        _measure(rows, threads)
    route = _routes.get((weight.shape[0], weight.shape[1], rows, threads), "linear")
    return _CALLS[route](x, weight)


_CALLS: dict[str, Call] = _calls(1)


def measured_routes() -> dict[str, str]:
    """What was chosen so far, for logs and benchmarks: 'out x in, rows, threads' -> call."""
    return {f"{o}x{i}, {r} rows, {t} threads": c for (o, i, r, t), c in sorted(_routes.items())}
