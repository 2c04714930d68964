"""Which of several equivalent fp32 GEMM calls serves a few rows fastest on this machine,
chosen once so that the same weights always give the same bits.

`y = x @ W.T` for a decode or verify step's handful of rows can be asked of the BLAS as
`linear`, weight-stationary or paired, or of the native kernel's loops; which is fastest
depends on the machine, the shape and the row count. So the call is measured the first time
a row count is seen (per thread count), over the weights registered last, kept for the
process, and shared with the machine's other processes through a file keyed by its CPU
signature. Greedy identity rests on three rules: every fp32 weight starts on a 64-byte
boundary (`aligned`); a choice is never changed in the process; every process of the
machine reads the same file. The measurements behind this are in the README's engine
section ("Two paths, a format each").
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
# Row counts past SMALL_ROWS share the choice measured at the bucket that holds them.
ROW_BUCKETS = (24, 32, 48, 64, 96, 128)
ALIGNMENT = 64  # bytes: a cache line, and past every vector width MKL's kernels align to
# Rounds (a pass over the weights through every call) that count, and the most run to get them.
# A round counts where no pass in it was preempted: on a machine whose cores other processes
# share (another replica's steps, a test suite, a build), a preempted pass times the
# scheduler, not the call, and a choice once stored serves every process of the machine from
# then on. Measured on a 2-core AVX-512 EPYC, passes over SmolLM2's matrices: 0-2 involuntary
# context switches a pass when quiet, 75-158 beside a two-thread GEMM loop; there the first
# measurement of 576x576 at 3 rows chose `weight-stationary` (7.9 ms a pass against native's
# 1.7 when quiet) in 4 of 6 tries, and a choices file written in such a moment served `bench
# spec`'s 9-row verify steps at 59.7 ms, against 54.5 once measured again when quiet.
_ROUNDS = 2
_MAX_ROUNDS = 6
# Involuntary context switches a pass may see and still count: a few (the kernel's own
# threads, a timer), one more per 10 ms of pass.
_QUIET_SWITCHES = 4
_QUIET_SWITCHES_PER_SECOND = 100.0
CHOICES_VERSION = 6  # bump when what is measured changes, so stored choices are redone
# The measurement streams at most this much of the most recently loaded weights: well past a
# CPU's cache (so they come from memory, as in a step), and a pause of tens of ms, once per
# row count and machine, whatever else the process holds.
MEASURE_BYTES = 128 << 20

Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Key = tuple[int, int, int, int]  # (out, in, rows, threads)


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
    library cannot be built (no compiler): it is then never a candidate."""

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


def _native_call(streamed: bool = False) -> _NativeF32 | None:
    return PROCESS_CHOICES.native_call(streamed)


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
            "fp32 GEMM calls for %d rows measured while other processes held the cores "
            "(every pass of %d rounds preempted): chosen from the best of them",
            rows,
            _MAX_ROUNDS,
        )
    best = quiet if quiet_rounds else every
    return {shape: min(best, key=lambda name: best[name][shape]) for shape in best["linear"]}


def choices_path(threads: int) -> Path:
    """Where this machine's choices for `threads` threads are kept."""
    omp = f"{os.environ.get('OMP_WAIT_POLICY', '')},{os.environ.get('GOMP_SPINCOUNT', '')}"
    # The native kernel's source too: a changed kernel is a different candidate.
    parts = [str(CHOICES_VERSION), cpu_signature(), str(threads), torch.__version__, omp]
    key = "|".join([*parts, source_digest()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    # The file's name predates the word "choice": kept, so a machine's choices carry over.
    return native_cache_dir().parent / "formats" / f"fp32-routes-{digest}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict[str, str]]:
    """The choices file's contents under an exclusive lock; what the body leaves in the dict
    is written back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored: dict[str, str] = {}
        if path.is_file():
            try:
                stored = dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring unreadable fp32 GEMM choices %s: %s", path, exc)
        before = dict(stored)
        yield stored
        if stored != before:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
            os.replace(tmp, path)


def _call(name: str) -> Call:
    if name in ("native", "native-streamed"):
        native = _native_call(streamed=name == "native-streamed")
        assert native is not None, "a native call is only chosen where the library loads"
        return native
    return _CALLS[name]


_CALLS: dict[str, Call] = {
    "linear": F.linear,
    "weight-stationary": _weight_stationary,
    "paired": _paired,
}


def choice_rows(rows: int) -> int | None:
    """The row count whose choice serves `rows` rows (None: past every bucket, `linear`)."""
    if rows <= SMALL_ROWS:
        return rows
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), None)


class GemmCallChoices:
    """One process's choices: the fp32 weights registered (in forward order), the call chosen
    per (out, in, rows, threads), and the (rows, threads) settled for every registered shape.

    One per process (`PROCESS_CHOICES`) on purpose: every model the process holds (the
    target, a draft, a head, a reference) must take the same call for a shape, and keep it,
    or the same weights would give other bits."""

    def __init__(self) -> None:
        self.weights: list[weakref.ref[torch.Tensor]] = []
        self.chosen: dict[Key, str] = {}
        self.settled: set[tuple[int, int]] = set()
        self.natives: dict[bool, _NativeF32] = {}

    def register(self, weight: torch.Tensor) -> None:
        """A CPU fp32 weight [out, in] that serves through `fp32_linear`, in forward order."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return
        shape = (weight.shape[0], weight.shape[1])
        if not any(shape == (o, i) for o, i, _, _ in self.chosen):
            self.settled.clear()  # a shape nothing was chosen for: settle again, with it
        self.weights.append(weakref.ref(weight))

    def native_call(self, streamed: bool = False) -> _NativeF32 | None:
        native = self.natives.get(streamed)
        if native is None:
            native = self.natives[streamed] = _NativeF32(streamed)
        return native if native.available else None

    def settle(self, max_rows: int) -> None:
        """Choose now for every row count up to `max_rows` and the registered weights
        (adopted from this machine's file, else measured), so that no timed step pauses to
        measure."""
        threads = torch.get_num_threads()
        counts = {choice_rows(n) for n in range(1, max_rows + 1)}
        for rows in sorted(c for c in counts if c is not None):
            if (rows, threads) not in self.settled:
                self._settle(rows, threads)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` for fp32 `weight` [out, in], by the call chosen for it here."""
        rows = choice_rows(x.shape[0]) if x.dim() == 2 else None
        if rows is None or x.device.type != "cpu":
            return F.linear(x, weight)
        key = (weight.shape[0], weight.shape[1], rows, torch.get_num_threads())
        name = self.chosen.get(key)
        if name is None:
            if (key[2], key[3]) not in self.settled:
                self._settle(key[2], key[3])
            name = self.chosen.get(key, "linear")  # a weight never registered
        return _call(name)(x, weight)

    def chosen_calls(self) -> dict[str, str]:
        """What was chosen so far, for logs and benchmarks: 'out x in, rows, threads' -> call."""
        return {
            f"{o}x{i}, {r} rows, {t} threads": c for (o, i, r, t), c in sorted(self.chosen.items())
        }

    def _settle(self, rows: int, threads: int) -> None:
        """Give every registered shape a call for `rows` rows: this process's, else this
        machine's stored one, else one measured now (and stored for the other processes)."""
        weights = self._live_weights()
        shapes = {(w.shape[0], w.shape[1]) for w in weights}
        missing = {s for s in shapes if (*s, rows, threads) not in self.chosen}
        if missing:
            try:
                with _locked(choices_path(threads)) as stored:
                    self._adopt(stored, rows, threads, missing, weights)
            except OSError as exc:  # a read-only home still serves; other processes may differ
                log.warning("cannot share fp32 GEMM choices: %s", exc)
                # What was adopted before the failure (a full disk at the write) is kept.
                left = {s for s in missing if (*s, rows, threads) not in self.chosen}
                self._adopt({}, rows, threads, left, weights)
        self.settled.add((rows, threads))

    def _adopt(
        self,
        stored: dict[str, str],
        rows: int,
        threads: int,
        missing: set[tuple[int, int]],
        weights: list[torch.Tensor],
    ) -> None:
        calls = _calls(rows)
        unknown = set()
        for shape in missing:
            name = stored.get(f"{shape[0]}x{shape[1]},{rows}")
            if name in calls:
                self.chosen[(*shape, rows, threads)] = name
            else:
                unknown.add(shape)
        if unknown:
            for shape, name in _measure(rows, weights).items():
                if shape in unknown:
                    self.chosen[(*shape, rows, threads)] = name
                    stored[f"{shape[0]}x{shape[1]},{rows}"] = name

    def _live_weights(self) -> list[torch.Tensor]:
        """The registered weights to time: the latest `MEASURE_BYTES`, then one of each
        other shape, in forward order."""
        self.weights[:] = [r for r in self.weights if r() is not None]
        weights: list[torch.Tensor] = []
        shapes: set[tuple[int, int]] = set()
        budget = MEASURE_BYTES
        for ref in reversed(self.weights):
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


PROCESS_CHOICES = GemmCallChoices()


def register(weight: torch.Tensor) -> None:
    PROCESS_CHOICES.register(weight)


def settle(max_rows: int) -> None:
    PROCESS_CHOICES.settle(max_rows)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return PROCESS_CHOICES.linear(x, weight)


def chosen_calls() -> dict[str, str]:
    return PROCESS_CHOICES.chosen_calls()
