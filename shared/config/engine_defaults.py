"""Defaults of the engine's knobs: one source for the deployment schema and `EngineConfig`.

Torch-free and pydantic-free, so the coordinator, the schema, the profiler and the engine can
all read it. The schema's defaults are what `splitserve up` gives a replica; `EngineConfig`
(the engine as a library: tests, benches, `splitserve generate`) takes the same values, except
the two named LIBRARY_* below, each with its reason.
"""

from __future__ import annotations

from typing import Final, Literal

PreemptionMode = Literal["recompute", "swap"]

BLOCK_SIZE = 16  # tokens per KV block; router and workers must agree
KV_CACHE_BYTES = 256 * 1024**2
HOST_CACHE_BYTES = 512 * 1024**2  # KV host tier a serving replica spills cold blocks to
DISK_CACHE_BYTES = 0  # KV disk tier; needs a host tier and a directory
MAX_NUM_BATCHED_TOKENS = 512  # chunked-prefill token budget per step
# Prompt chunks of background service tiers (flex, batch) are cut to this many tokens a step,
# so a priority or default request that arrives mid-step waits behind a short step.
BACKGROUND_CHUNK_TOKENS = 64
# While a step carries decode rows, its prompt chunks total at most this many tokens: a long
# prompt arriving cannot hold every streaming reply for a whole budget of prefill (measured at
# concurrency 8, 256-token prompts, 2 cores: ITL p99 391 ms uncapped, 220 ms at 128, 183 ms at
# 64, where output tok/s fell from 139 to 111 and 81; 128 keeps the throughput).
CHUNK_TOKENS_WHILE_DECODING = 128
MAX_NUM_SEQS = 64
PREEMPTION_MODE: PreemptionMode = "recompute"
WEIGHTS: Final = "auto"  # the fastest build that passed the quality gate, measured on this machine
# The KV pool's element type (engine/kvcache/kv_dtype.py): auto = fp16 where the hardware
# converts it, halving the cache bytes a decode step reads and doubling a budget's tokens.
KVCacheDtype = Literal["auto", "float32", "float16"]
KV_CACHE_DTYPES: Final = ("auto", "float32", "float16")
KV_CACHE_DTYPE: KVCacheDtype = "auto"

# An engine built as a library gets exactly the device blocks it is given: a test's or a
# bench's prefix-cache and eviction behaviour is that of its pool alone, and no 512 MiB host
# reservation is made per engine. A serving replica, whose conversations outlive its device
# pool, turns the KV host tier on (HOST_CACHE_BYTES).
LIBRARY_HOST_CACHE_BYTES = 0
# `auto` measures every eligible build at load time (seconds, and a quality-gate report per
# format); a library engine loads the reference fp32 weights unless told otherwise.
LIBRARY_WEIGHTS: Final = "fp32"
# ... and an fp32 KV cache: the library's reference is the plain fp32 model, whose every
# intermediate is fp32.
LIBRARY_KV_CACHE_DTYPE: KVCacheDtype = "float32"

# Speculative decoding (decode replicas).
SPECULATIVE_METHOD: Final = "none"
NUM_SPECULATIVE_TOKENS = 4
# A draft head's chain stops before the guess at which the head's own estimate that the chain
# is accepted (the product of its top probabilities) falls below this. Measured with
# `splitserve bench spec` on the chat set (fp32, b1, k=4): 0 -> 0.98x, 0.3 -> 1.25x,
# 0.5 -> 1.17x of plain decoding: a doubted guess costs a verify row and a head step and is
# seldom kept. Re-measured on an AVX2 EPYC with the fp32 GEMM calls (a 2-row verify step there costs
# no more than a plain one): a cutoff priced per guess from the measured step costs gave
# 1.09x (b1) and 0.62x (b8) against 1.14x and 0.88x with 0.3: the head's own top
# probabilities are too rough an acceptance estimate to price a row with, so 0.3 stayed.
# Re-measured on an AVX-512 (bf16) EPYC, where a verify row costs more: 1 query row 28 ms, 2
# rows 37, 5 rows 44, 8 rows 55 (calibrate.measure_step_costs, fp32, 2 threads). With the
# bench's 30-CPU-minute head (k=8, chains), two runs each (a sweep and `bench spec`), 0.5
# against 0.3: head alone chat b1 1.20/1.29x vs 1.20/1.30x, chat b8 1.07/0.90x vs 0.93/0.81x,
# grounded b1 0.96/1.06x vs 0.85/0.87x; adaptive chat b1 2.26/2.28x vs 2.07/2.10x, chat b8
# 1.50/1.32x vs 1.35/1.18x, grounded b1 1.72/1.77x vs 1.70/1.65x (grounded b8 split: 1.01/1.00x
# vs 0.88/1.28x). 0.15 lost to both.
# Then the fp32 GEMM calls gained its single-stream native loop and four-output tiles on that
# machine (engine/model/fp32_gemm.py), and a verify row became cheap again: 1 row 28.6 ms,
# 2 rows 30.7, 3 rows 33.4, 9 rows 45.6. Re-measured with the same head, one process, the
# two cutoffs interleaved prompt by prompt, 0.3 against 0.5: head alone chat b1 1.46x vs
# 1.26x, chat b8 0.92x vs 0.91x, grounded b1 1.03x vs 1.00x, grounded b8 0.91x vs 0.90x;
# adaptive chat b1 2.60x vs 2.59x, chat b8 1.55x vs 1.54x, grounded b1 1.88x vs 1.68x,
# grounded b8 1.06x vs 1.03x (an earlier sweep, before the four-output tiles, with 0.15 too:
# 0.3 ahead at b1, level at b8, 0.15 behind). So 0.3 again: the cutoff follows what a row
# costs, and that is the machine's and the kernel's.
DRAFT_MIN_CONFIDENCE = 0.3
# A draft head drafts a tree for greedy rows when this is above 1: at each depth its
# `width` likeliest nodes are extended by their `width` likeliest next tokens, and the k
# likeliest nodes of all depths are proposed (EAGLE-2's dynamic tree; head_proposer.py,
# engine/speculative/tree.py). 1 drafts chains. Trees still carry adaptive's n-gram branch
# (Speculator: MERGED) at width 1.
# Measured on an AVX-512 (bf16) EPYC, fp32, 2 threads, k=8, the bench's 30-CPU-minute head
# (held-out agreement 0.487), one process, variants interleaved prompt by prompt: head alone
# chat b1 1.73x (2.26 accepted/step) for chains; trees 2.05x (2.51) at width 3 with the
# tree cutoff 0.1, 2.04x (2.51) at width 4 / 0.1, 2.03x (2.58) at 4 / 0.05, 2.02x (2.57)
# at 3 / 0.05, 1.99x (2.41) at 2 / 0.15, 1.75x (2.26) at 2 / 0.3; grounded b1 1.16x chains,
# 1.26x at 3 / 0.1. Adaptive is level either way (chat b1 3.26x / 3.24x, grounded b1 2.28x /
# 2.31x). At b8 trees lost (head chat 0.88x against 0.99x for chains): each row's tree was
# then its own run of head steps, and a verify row there costs compute, hence the batch cap
# (re-measured with batched trees below DRAFT_TREE_MAX_BATCH).
# At b2 (chat, same head) trees were a wash: head alone 1.46x against 1.39x for chains,
# adaptive 2.37x against 2.50x; at b4 head 1.06x against 1.10x, adaptive 1.78x against 1.79x.
# (An older AVX2 measurement, before the global reranking, with a 14-CPU-minute head: width
# 2 at 0.1 gave head b1 1.11x against 1.09x for chains.)
DRAFT_TREE_WIDTH = 3
# A tree drops nodes whose path estimate (the product of the head's probabilities along
# it) falls below this. Lower than the chain cutoff: a tree proposes only its k likeliest
# nodes anyway, and a doubted sibling is a second chance where a chain has none.
# Re-measured with the bench's next head (held-out agreement 0.467; AVX-512 EPYC, fp32, 2
# threads, k=8, one process, variants interleaved): 0.05 against 0.1, head alone chat b1
# 2.46 against 2.31 accepted a step at 2.69x / 2.75x of plain, grounded b1 1.73x / 1.64x;
# adaptive chat b1 4.46x / 4.57x, b8 1.68x / 1.52x, grounded b1 3.27x / 3.32x, b8 1.01x /
# 0.96x; 0.03 took 2.49 accepted for 2.66x. Speed level, a verify step keeps more: 0.05.
# (Offline, on the bench's recorded chat replies, head alone: 0.1 2.21 tokens a step, 0.05
# 2.40, 0.02 2.41; width 4 or 5 at 0.05 no more than 3.)
DRAFT_TREE_MIN_CONFIDENCE = 0.05
# Method `draft` drafts trees only while a step decodes at most this many sequences; chains
# beyond (measured above: head trees pay alone at b1 only). Adaptive ignores the cap: it
# prices each step's k from measured step costs, so its trees stay small where a verify row
# is dear. Measured once every row's tree grew in the same head calls (one per depth for the
# batch; AVX-512 EPYC, fp32, 2 threads, k=8, the bench's head, held-out agreement 0.467; two
# sweeps, variants interleaved prompt by prompt): adaptive with trees at b8 against chains
# over batch 1, chat 1.48x / 1.52x of plain against 1.29x / 1.41x, grounded 1.23x / 1.14x
# against 1.08x / 0.97x; head alone at b8 still lost with trees, chat 0.77x against 0.90x,
# grounded 0.75x against 1.05x (k full-size trees are 72 verify rows).
DRAFT_TREE_MAX_BATCH = 1
NGRAM_MAX = 4
NGRAM_MIN = 1
