"""Which equivalent fp32 GEMM call serves a few rows fastest on this machine, chosen so that the
same weights always give the same bits.

`y = x @ W.T` for a handful of rows (a decode step, a verify step of 2–9 query tokens) can be
asked of the BLAS as `linear(x, W)` or, weight-stationary, as `(W @ x.T).T`. The two compute
the same products; which is faster is the BLAS's choice of kernel for the shape, and it
differs by machine. Measured with torch's MKL on two 2-core AMD EPYCs, whole fp32 passes over
SmolLM2's 121 matrices: on the AVX2 one, 75 ms for 1 row through `linear` but 157-216 ms for
2-5 rows, against 55-80 ms weight-stationary; on the AVX-512 one the 49,152 x 576 head alone
took 18 and 25 ms for 2 and 3 rows through `linear` (7.9 ms for 1), 3.4 and 4.7 ms
weight-stationary. So a speculative verify step cost two to three plain steps. On other
shapes and row counts `linear` wins. The native kernel's own loops are candidates too (its
register tiles, and for up to `STREAMED_MAX_ROWS` rows its single-stream loop), as their
order of speed flips between those two machines as well.

So the route is measured, the first time a row count is seen on this machine (per thread
count): the most recently registered fp32 weights (the model loaded last, up to
`MEASURE_BYTES`, and one weight of each other shape) are multiplied once through each call in
turn, in layer order as a forward pass streams them, so each call meets its weight as a real
step does (out of cache, on a model larger than the cache; a per-call loop over one hot
weight picks differently). Two rounds, the better kept, counting only rounds that no other
process preempted (`_measure`).

Reproducibility, which greedy identity rests on, takes three rules:
- Every fp32 weight starts on a 64-byte boundary (`aligned`). MKL's kernels give other bits
  for a weight 4 or 8 bytes off (measured here: both `linear` for one row and the
  weight-stationary call, at every shape tried; offsets of 16-byte multiples agree). Weights
  read from a file sit wherever its layout put them, so the same model loaded from a GGUF and
  from a safetensors folder gave different logits.
- A route once chosen for a shape and row count is never changed in the process.
- Routes are shared by every process of this machine through a file keyed by its CPU
  signature (the first process to need a row count measures it under a lock; the others read
  its choice), so a prefill replica, a decode replica and a reference run agree.

Row counts up to `SMALL_ROWS` are routed one by one. Past them, up to the largest of
`ROW_BUCKETS`, a verify step of a batch (8 rows of k + 1 query tokens) or a small batch's
prefill takes the route measured for its bucket's row count (one measurement per bucket, not
per count): the native kernel still beat MKL's `linear` there when measured (AVX2 EPYC, 2
threads, a pass over SmolLM2's matrices): 24 rows 52 against 89 ms, 48 rows 105 / 129,
72 rows 142 / 165, 96 rows 191 / 207. Larger calls (prefill chunks) are the BLAS's ordinary
GEMM regime and take `linear`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import resource
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.native.build import cache_dir as native_cache_dir
from kernels.native.build import cpu_signature, source_digest

log = logging.getLogger(__name__)

SMALL_ROWS = 16
# Row counts past SMALL_ROWS share the route measured at the bucket that holds them.
ROW_BUCKETS = (24, 32, 48, 64, 96, 128)
ALIGNMENT = 64  # bytes: a cache line, and past every vector width MKL's kernels align to
# Rounds (a pass over the weights through every call) that count, and the most run to get them.
# A round counts where no pass in it was preempted: on a machine whose cores other processes
# share (another replica's steps, a test suite, a build), a preempted pass times the
# scheduler, not the call, and a route once stored serves every process of the machine from
# then on. Measured on a 2-core AVX-512 EPYC, passes over SmolLM2's matrices: 0-2 involuntary
# context switches a pass when quiet, 75-158 beside a two-thread GEMM loop; there the first
# measurement of 576x576 at 3 rows chose `weight-stationary` (7.9 ms a pass against native's
# 1.7 when quiet) in 4 of 6 tries, and a routes file written in such a moment served `bench
# spec`'s 9-row verify steps at 59.7 ms, against 54.5 once measured again when quiet.
_ROUNDS = 2
_MAX_ROUNDS = 6
# Involuntary context switches a pass may see and still count: a few (the kernel's own
# threads, a timer), one more per 10 ms of pass.
_QUIET_SWITCHES = 4
_QUIET_SWITCHES_PER_SECOND = 100.0
ROUTES_VERSION = 6  # bump when what is measured changes, so cached routes are redone
# The measurement streams at most this much of the most recently loaded weights: well past a
# CPU's cache (so they come from memory, as in a step), and a pause of tens of ms, once per
# row count and machine, whatever else the process holds.
MEASURE_BYTES = 128 << 20

Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Key = tuple[int, int, int, int]  # (out, in, rows, threads)

_weights: list[weakref.ref[torch.Tensor]] = []
# (out, in, rows, threads) -> the call chosen for it (absent: not settled yet).
_routes: dict[Key, str] = {}
_measured: set[tuple[int, int]] = set()  # (rows, threads) settled for every registered shape


def aligned(weight: torch.Tensor) -> torch.Tensor:
    """`weight` contiguous and starting on an `ALIGNMENT`-byte boundary (copied if not)."""
    weight = weight.contiguous()
    if weight.device.type != "cpu" or weight.data_ptr() % ALIGNMENT == 0:
        return weight
    # torch's CPU allocator hands out 64-byte-aligned blocks.
    copy = torch.empty_like(weight, memory_format=torch.contiguous_format)
    copy.copy_(weight)
    assert copy.data_ptr() % ALIGNMENT == 0, "torch's allocator no longer aligns to 64 bytes"
    return copy


def register(weight: torch.Tensor) -> None:
    """A CPU fp32 weight [out, in] that serves through `fp32_linear`, in forward order."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return
    shape = (weight.shape[0], weight.shape[1])
    if not any(shape == (o, i) for o, i, _, _ in _routes):
        _measured.clear()  # a shape no route has: settle again, with it
    _weights.append(weakref.ref(weight))


def _weight_stationary(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


def _paired(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # One row asked as two: the BLAS's matrix-vector kernel can stream a large weight at
    # half the rate its two-column GEMM does.
    # (A real copy: a stride-0 `expand` is handed back to the matrix-vector kernel.)
    return torch.mm(weight, x.repeat(2, 1).t()).t()[:1].contiguous()


class _NativeF32:
    """`x @ W.T` through the native library's fp32 matrix kernel (decode_step.c,
    linear_f32): rows in register tiles of six, each weight vector read once per tile, where
    MKL's small-row kernels were measured at a third of the CPU's FMA rate (an 8-row pass
    over SmolLM2's matrices cost 1.6 one-row passes on an AVX2 EPYC). Absent where the
    library cannot be built (no compiler): the route then never offers it."""

    def __init__(self, streamed: bool = False) -> None:
        from kernels.native import abi
        from kernels.native.build import load

        self._abi = abi
        self._build = load()
        self._streamed = streamed
        # weight storage address -> its descriptor, for the weights alive (a freed weight's
        # address may be reused: the shape is checked too).
        self._matrices: dict[int, tuple[int, int, object]] = {}

    @property
    def available(self) -> bool:
        return self._build.available

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out, inp = weight.shape
        entry = self._matrices.get(weight.data_ptr())
        if entry is None or entry[:2] != (out, inp):
            linear = self._abi.Linear(self._abi.F32, out, inp, 0, weight.data_ptr(), None, None)
            entry = self._matrices[weight.data_ptr()] = (out, inp, linear)
        x = x.contiguous()
        y = torch.empty((x.shape[0], out), dtype=torch.float32)
        lib = self._build.library
        forward = lib.ss_linear_forward_streamed if self._streamed else lib.ss_linear_forward
        code = forward(
            ctypes.byref(entry[2]),  # type: ignore[arg-type]
            x.data_ptr(),
            x.shape[0],
            y.data_ptr(),
            max(1, torch.get_num_threads()),
        )
        if code != 0:
            raise RuntimeError(f"native fp32 matrix refused {tuple(x.shape)} x {out}x{inp}")
        return y


# The native kernel's two loops over fp32 weights (decode_step.c): register tiles of a pair of
# outputs ("native"), or one output at a time as a single weight stream ("native-streamed",
# up to STREAMED_MAX_ROWS rows). Both give every row the same bits; which streams memory
# faster differs by machine (2 and 3 rows: 12 and 16 ms a pass streamed against 25 tiled on an
# AVX-512 EPYC, where an AVX2 EPYC had the tile near one row's cost).
STREAMED_MAX_ROWS = 8
_natives: dict[bool, _NativeF32] = {}


def _native_call(streamed: bool = False) -> _NativeF32 | None:
    native = _natives.get(streamed)
    if native is None:
        native = _natives[streamed] = _NativeF32(streamed)
    return native if native.available else None


def _calls(rows: int) -> dict[str, Call]:
    calls: dict[str, Call] = {"linear": F.linear, "weight-stationary": _weight_stationary}
    if rows == 1:
        calls["paired"] = _paired
    native = _native_call()
    if native is not None:
        calls["native"] = native
        streamed = _native_call(streamed=True)
        if streamed is not None and 1 < rows <= STREAMED_MAX_ROWS:
            calls["native-streamed"] = streamed
    return calls


def _pass_seconds(call: Call, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]):
    spent: dict[tuple[int, int], float] = defaultdict(float)
    for w in weights:
        start = time.perf_counter()
        call(xs[w.shape[1]], w)
        spent[(w.shape[0], w.shape[1])] += time.perf_counter() - start
    return spent


def _live_weights() -> list[torch.Tensor]:
    """The registered weights to time: the latest `MEASURE_BYTES`, then one of each other
    shape, in forward order."""
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
    return weights


def _preemptions() -> int:
    """Involuntary context switches of this process so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def _measure(rows: int, weights: list[torch.Tensor]) -> dict[tuple[int, int], str]:
    """The fastest call per weight shape for `rows` rows, timed over `weights`: the best of
    `_ROUNDS` quiet rounds (every call in turn, the order rotated each round), or of every
    round run where `_MAX_ROUNDS` gave fewer."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    calls = _calls(rows)
    names = list(calls)
    quiet: dict[str, dict[tuple[int, int], float]] = {}
    every: dict[str, dict[tuple[int, int], float]] = {}
    quiet_rounds = 0
    with torch.no_grad():
        for round_ in range(_MAX_ROUNDS):
            turn = round_ % len(names)
            timed: dict[str, dict[tuple[int, int], float]] = {}
            preempted = False
            for name in names[turn:] + names[:turn]:
                before, start = _preemptions(), time.perf_counter()
                timed[name] = _pass_seconds(calls[name], weights, xs)
                allowed = _QUIET_SWITCHES + _QUIET_SWITCHES_PER_SECOND * (
                    time.perf_counter() - start
                )
                preempted |= _preemptions() - before > allowed
            kept_sets = (every,) if preempted else (every, quiet)
            for kept_set in kept_sets:
                for name, spent in timed.items():
                    kept = kept_set.setdefault(name, dict(spent))
                    for shape, seconds in spent.items():
                        kept[shape] = min(kept[shape], seconds)
            quiet_rounds += not preempted
            if quiet_rounds >= _ROUNDS:
                break
    if not quiet_rounds:
        log.warning(
            "fp32 routes for %d rows measured while other processes held the cores "
            "(every pass of %d rounds preempted): chosen from the best of them",
            rows,
            _MAX_ROUNDS,
        )
    best = quiet if quiet_rounds else every
    return {shape: min(best, key=lambda name: best[name][shape]) for shape in best["linear"]}


def routes_path(threads: int) -> Path:
    """Where this machine's routes for `threads` threads are kept."""
    omp = f"{os.environ.get('OMP_WAIT_POLICY', '')},{os.environ.get('GOMP_SPINCOUNT', '')}"
    # The native kernel's source too: a changed kernel is a different candidate.
    parts = [str(ROUTES_VERSION), cpu_signature(), str(threads), torch.__version__, omp]
    key = "|".join([*parts, source_digest()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return native_cache_dir().parent / "formats" / f"fp32-routes-{digest}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict[str, str]]:
    """The routes file's contents under an exclusive lock; what the body leaves in the dict
    is written back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored: dict[str, str] = {}
        if path.is_file():
            try:
                stored = dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring unreadable fp32 routes %s: %s", path, exc)
        before = dict(stored)
        yield stored
        if stored != before:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
            os.replace(tmp, path)


def _settle(rows: int, threads: int) -> None:
    """Give every registered shape a route for `rows` rows: this process's, else this
    machine's stored one, else one measured now (and stored for the other processes)."""
    weights = _live_weights()
    shapes = {(w.shape[0], w.shape[1]) for w in weights}
    missing = {s for s in shapes if (*s, rows, threads) not in _routes}
    if missing:
        try:
            with _locked(routes_path(threads)) as stored:
                _adopt(stored, rows, threads, missing, weights)
        except OSError as exc:  # a read-only home still serves; other processes may differ
            log.warning("cannot share fp32 routes: %s", exc)
            # What was adopted before the failure (a full disk at the write) is kept.
            left = {s for s in missing if (*s, rows, threads) not in _routes}
            _adopt({}, rows, threads, left, weights)
    _measured.add((rows, threads))


def _adopt(
    stored: dict[str, str],
    rows: int,
    threads: int,
    missing: set[tuple[int, int]],
    weights: list[torch.Tensor],
) -> None:
    calls = _calls(rows)
    unknown = set()
    for shape in missing:
        route = stored.get(f"{shape[0]}x{shape[1]},{rows}")
        if route in calls:
            _routes[(*shape, rows, threads)] = route
        else:
            unknown.add(shape)
    if unknown:
        for shape, route in _measure(rows, weights).items():
            if shape in unknown:
                _routes[(*shape, rows, threads)] = route
                stored[f"{shape[0]}x{shape[1]},{rows}"] = route


def routed_rows(rows: int) -> int | None:
    """The row count whose route serves `rows` rows (None: past every bucket, `linear`)."""
    if rows <= SMALL_ROWS:
        return rows
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), None)


def settle(max_rows: int) -> None:
    """Route now every row count up to `max_rows` for the registered weights (adopted from
    this machine's routes file, else measured), so that no timed step pauses to measure."""
    threads = torch.get_num_threads()
    counts = {routed_rows(n) for n in range(1, max_rows + 1)}
    for rows in sorted(c for c in counts if c is not None):
        if (rows, threads) not in _measured:
            _settle(rows, threads)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for fp32 `weight` [out, in], by the call chosen for it here."""
    rows = routed_rows(x.shape[0]) if x.dim() == 2 else None
    if rows is None or x.device.type != "cpu":
        return F.linear(x, weight)
    key = (weight.shape[0], weight.shape[1], rows, torch.get_num_threads())
    route = _routes.get(key)
    if route is None:
        if (key[2], key[3]) not in _measured:
            _settle(key[2], key[3])
        route = _routes.get(key, "linear")  # a weight never registered
    return _call(route)(x, weight)


def _call(route: str) -> Call:
    if route in ("native", "native-streamed"):
        native = _native_call(streamed=route == "native-streamed")
        assert native is not None, "a native route is only chosen where the library loads"
        return native
    return _CALLS[route]


_CALLS: dict[str, Call] = {
    "linear": F.linear,
    "weight-stationary": _weight_stationary,
    "paired": _paired,
}


def measured_routes() -> dict[str, str]:
    """What was chosen so far, for logs and benchmarks: 'out x in, rows, threads' -> call."""
    return {f"{o}x{i}, {r} rows, {t} threads": c for (o, i, r, t), c in sorted(_routes.items())}
