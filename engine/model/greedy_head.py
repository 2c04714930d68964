"""The greedy token of each row, exactly the full logits' argmax, without the full logits.

Why: a greedy decode or verify row needs only the argmax of its logits. The native head is
49,152 Q8_0 rows multiplied with fp32 activations, and past a few rows it is bound by its
instructions, not by its 30 MB: measured on a 2-core AVX-512 EPYC (Zen 4), 1.6 ms for 1 row,
4.4 for 9, 10.0 for 24 (a batch-8 verify step), against 1.2, 1.4 and 3.4 ms for the same
weights with int8 activations (`vpdpbusd`, the `native-a8` matrices' arithmetic). On that
build a verify row cost ~0.95 ms, 0.44 of it the head: the head was the dearest part of every
row speculation adds, and of a batch-8 decode step.

So the head's int8 twin ranks the vocabulary, and a rigorous bound on its error keeps every
output that could still be the exact argmax; those few are computed by the exact head's own
kernel (linear_q8_0 itself, one output at a time: the same bits as the whole head), and the
first maximum by id wins, as `torch.argmax`'s does. The token is the exact head's argmax,
never an approximation of it (decode_step.c, ss_greedy_pick, does the pruning).

The bound. Row x's block b (32 values) is quantized as s_b * k with s_b = max|x_b| / 127 and
|x - s_b k| <= s_b (1/2 + 1e-4) elementwise. For output o with Q8_0 weights d_ob * q_ob,
|exact - twin| <= sum_b |d_ob| sum|q_ob| s_b (1/2 + 1e-4) from the quantization, plus both
kernels' float rounding (fewer than 60 roundings of terms at most 255 s_b |d_ob| sum|q_ob|:
under 1e-3 of that sum). BOUND_FACTOR 0.51 covers both with room. Pruning is two-staged: the
widest bound of any output first keeps the outputs within twice it of the row's twin maximum
(1,278 decode rows of `bench spec`'s prompts on SmolLM2: median 7 kept, at most 1,270 on a
flat row), then each survivor's own bound E_o keeps it only if twin_o + E_o reaches the
largest twin_o' - E_o' (median 1 left, at most 44).

Measured end to end (`native-a8`, 2 threads, one process, with and without the twin, greedy
outputs identical): chat batch 8 plain 552 against 473 tok/s, adaptive speculation 676
against 544; grounded batch 1 adaptive 369 against 351, plain 208 against 212. Which path
serves a row count is still measured per machine (`tokens`): both give the same tokens.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import numpy as np
import torch

from kernels.native import abi

# |exact - int8| <= BOUND_FACTOR * sum_b |d_ob| sum|q_ob| s_b (see the module docstring).
BOUND_FACTOR = 0.51
# Calls of each path a row bucket is timed over before one keeps it (the quickest counts).
TIMED_CALLS = 3
# Inputs larger than this in magnitude take the full logits (RMS-normed states are far below).
FINITE_LIMIT = 1e6


class GreedyHead:
    """Exact argmax of `exact` (a Q8_0 head with fp32 activations) through `approx` (the same
    weights with int8 activations)."""

    def __init__(
        self,
        lib,
        exact_quants: np.ndarray,  # int8 [vocab, blocks, 32], the exact head's own blocks
        exact_scales: np.ndarray,  # fp32 [vocab, blocks]
        approx: abi.Linear,
        threads,
    ):
        self.lib = lib
        self.quants = exact_quants
        self.scales = exact_scales
        vocab, blocks, _ = exact_quants.shape
        self.exact = abi.Linear(
            abi.Q8_0,
            vocab,
            blocks * abi.GROUP,
            0,
            exact_quants.ctypes.data,
            exact_scales.ctypes.data,
            None,
        )
        self.approx = approx
        self.threads = threads  # a callable: torch's thread count is read per call
        self.vocab = vocab
        # |d_ob| * sum_j |q_obj|: the bound's weight side, per output and block (in slices:
        # the int32 copy of a whole head would be 4x its bytes).
        weight_side = np.empty(exact_scales.shape, dtype=np.float32)
        for at in range(0, vocab, 4096):
            part = np.abs(exact_quants[at : at + 4096].astype(np.int32)).sum(-1)
            weight_side[at : at + 4096] = np.abs(exact_scales[at : at + 4096]) * part
        self._weight_side = torch.from_numpy(weight_side)  # [vocab, blocks]
        self._widest = self._weight_side.amax(0).contiguous()  # [blocks]
        # Per row bucket: whether the twin is faster here (see `tokens`), and the timings.
        self._choice: dict[int, bool] = {}
        self._timings: dict[int, tuple[list[float], list[float]]] = {}

    def tokens(
        self, hidden: torch.Tensor, full: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """[rows] greedy tokens of `hidden`: through `argmax`, or `full` (the full logits'
        argmax), whichever this machine ran faster at this many rows. Both give the same
        tokens, so choosing by measurement never changes an output: the first calls of each
        row bucket alternate between the two, timed, and the faster keeps the bucket."""
        bucket = _bucket(hidden.shape[0])
        choice = self._choice.get(bucket)
        if choice is None:
            seen = self._timings.setdefault(bucket, ([], []))
            use_twin = len(seen[0]) <= len(seen[1])
            start = time.perf_counter()
            out = self.argmax(hidden) if use_twin else full(hidden)
            seen[0 if use_twin else 1].append(time.perf_counter() - start)
            if min(len(seen[0]), len(seen[1])) >= TIMED_CALLS:
                self._choice[bucket] = min(seen[0]) <= min(seen[1])
            return out
        return self.argmax(hidden) if choice else full(hidden)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] fp32 final-normed states -> [rows] token ids (long)."""
        x = hidden.float().contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, dtype=torch.long)
        # Past FINITE_LIMIT no bound is claimed (the kernels' sums could overflow): the
        # full logits decide there, as they do where the library finds a non-finite value.
        if rows and bool(x.abs().amax() <= FINITE_LIMIT):
            approx = self._matrix(self.approx, x, self.vocab)
            code = self.lib.ss_greedy_pick(
                ctypes.byref(self.exact),
                approx.data_ptr(),
                x.data_ptr(),
                rows,
                self._weight_side.data_ptr(),
                self._widest.data_ptr(),
                BOUND_FACTOR,
                out.data_ptr(),
            )
            if code == 0:
                return out
        return self._matrix(self.exact, x, self.vocab).argmax(dim=-1)

    def _matrix(self, linear: abi.Linear, x: torch.Tensor, out: int) -> torch.Tensor:
        y = torch.empty((x.shape[0], out), dtype=torch.float32)
        code = self.lib.ss_linear_forward(
            ctypes.byref(linear), x.data_ptr(), x.shape[0], y.data_ptr(), self.threads()
        )
        if code != 0:
            raise RuntimeError(f"native matrix refused {x.shape[0]} rows (code {code})")
        return y


def _bucket(rows: int) -> int:
    """Row counts that cost alike share a measurement: 1, 2, 3-4, 5-8, 9-16, ..."""
    return (rows - 1).bit_length()
