"""Running torch's small elementwise and indexing ops on the calling thread alone.

torch splits an op over its intra-op threads once the op touches more than its grain size
(32,768 elements). Under `OMP_WAIT_POLICY=PASSIVE`, which the services set so that two
processes can share two cores, those threads sleep between ops, and waking them costs more
than the op. A verify step of a batch crosses the grain size in every layer: RoPE over
48 rows x 12 heads x 64, the MLP's activation over 24 rows x 1,536, RMSNorm over 64 rows x 576.
Measured on a 2-core AVX-512 EPYC (2 threads, each op timed after 300 us of other work, as in
a step): RoPE at 48 rows 242 us on two threads against 39 on one, the activation at 48 rows
189 against 56, RMSNorm at 64 rows 265 against 32, a 24-row KV write 59 against 8 us into
an fp32 cache (65 against 10 into fp16). In the engine's eight-sequence verify steps, summed
over 30 layers: RoPE 8.5 -> 3.4 ms a 48-row step, RMSNorm 17 -> 5 ms a 64-row step (of
150-220 ms). Attention itself keeps both threads (SDPA over 8 x 27 queries: 1.4 against
2.2 ms on one), and so does the gather of K/V out of the paged cache: alone it was faster on
one thread (158 against 214-275 us for eight 600-token sequences), but in the engine, bench
spec's chat set at batch 8 in one process, it lost 3% of plain and 4% of adaptive tokens/s
(117.8 against 121.6, 176.5 against 184.2), where these ops gained adaptive 4% (191.9) and
the KV write 2%, plain unchanged. The matrix products run on the native library's own pool.

Past a few hundred rows (a prefill chunk) the second thread earns its wake-up again. RoPE,
two RMSNorms and the activation together, per layer, two threads against one: 72 rows 914
against 188 us, 128 rows 1,824 / 1,197, 256 rows 4,028 / 4,311, 512 rows 6,785 / 8,945. So
only calls of up to `SERIAL_MAX_ROWS` rows run serially.

Elementwise ops give the same bits on one thread as on several (each element is computed
alone; reductions here run along rows, each row on one thread either way).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

SERIAL_MAX_ROWS = 128


@contextmanager
def serial_ops(rows: int) -> Iterator[None]:
    """torch ops inside, over `rows` rows, run on one intra-op thread when there are at most
    SERIAL_MAX_ROWS of them; the previous count is restored after."""
    threads = torch.get_num_threads()
    if threads == 1 or rows > SERIAL_MAX_ROWS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
