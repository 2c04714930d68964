/* The decode/verify step of a Llama-family decoder for CPUs, in one call.
 *
 * Why C: a batch-1 decode step of a 30-layer model is ~1,200 small operations; dispatched one
 * by one from Python they cost more than the arithmetic. Here the whole step (embedding,
 * every layer, final norm) runs in one call on a persistent thread pool, and the matrices are
 * read in the checkpoint's own quantized blocks (Q4_1, Q8_0) with fp32 activations, so a step
 * reads ~5x fewer bytes than dense fp32 and computes the same products (each weight is
 * dequantized exactly as the fp32 build dequantizes it; only the summation order differs).
 *
 * Rows are independent: every output of row r is computed by the same sequence of operations
 * whatever the other rows are, so a sequence's greedy output does not depend on its batch.
 *
 * Paged KV layout (the engine's pool): [blocks, layers, 2, block_size, kv_heads, head_dim].
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SS_AVX2 1
#else
#define SS_AVX2 0
#endif
#if defined(__SSE__) && !SS_AVX2
#include <xmmintrin.h>
#endif
#if SS_AVX2 && defined(__AVX512F__)
#define SS_AVX512 1
#else
#define SS_AVX512 0
#endif

#define QK 32 /* elements per quantized block */
/* Blocks arrive repacked (shared/model/native_step.py): quants in one array (16 bytes of
 * nibbles per Q4_1 block, 32 int8 per Q8_0 block), scales and Q4_1 mins as fp32 arrays
 * [out, in/32]. Converting fp16 scales inside the loop cost as many instructions as the
 * arithmetic; separate mins make sum(m * sum(x)) one short vector dot per output. */
#define Q4_1_QBYTES 16
#define Q8_0_QBYTES 32

/* The _TILES kinds are the _A8 kinds in 16-output tiles (linear_a8.h), VNNI-512 builds only. */
enum { SS_F32 = 0, SS_Q4_1 = 1, SS_Q8_0 = 2, SS_Q4_1_A8 = 3, SS_Q8_0_A8 = 4, SS_Q4_1_A8_TILES = 5, SS_Q8_0_A8_TILES = 6 };

typedef struct {
  int32_t kind;
  int32_t out_features;
  int32_t in_features;
  int32_t pad;
  const void *data;    /* f32 [out, in], or quants [out, in/32, 16|32] */
  const float *scales; /* [out, in/32] (quantized kinds) */
  const float *mins;   /* [out, in/32] (Q4_1) */
} ss_linear;

typedef struct {
  const float *input_norm;
  const float *post_norm;
  ss_linear qkv;     /* rows: q heads, k heads, v heads */
  ss_linear o_proj;
  ss_linear gate_up; /* rows: gate, up */
  ss_linear down;
} ss_layer;

typedef struct {
  int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, max_pos;
  float eps, scale;
  const float *embed;      /* [vocab, hidden] fp32, or NULL: rows from embed_quants */
  const float *final_norm; /* [hidden] */
  const float *rope_cos;   /* [max_pos, head_dim] */
  const float *rope_sin;
  const ss_layer *layers;
  ss_linear head; /* [vocab, hidden] */
  /* The embedding as Q8_0 blocks (int8 [vocab, hidden/32, 32], fp32 scales [vocab, hidden/32])
   * when embed is NULL: a row is dequantized on lookup, as the loader dequantizes the file. */
  const int8_t *embed_quants;
  const float *embed_scales;
  /* A draft head's input projection [hidden, 2 * hidden] (ss_forward_head; unused by the
   * target's step): the layer's input is input_proj([embedding of the token; a state]). */
  ss_linear input_proj;
} ss_model;

/* The pool holds fp32 or fp16 elements. fp16 halves the bytes attention reads each step (at
 * batch 8 and 512 tokens of context they were half the step) and doubles the tokens a
 * budget holds; values are converted to fp32 on load, so the arithmetic stays fp32. */
enum { SS_KV_F32 = 0, SS_KV_F16 = 1 };

typedef struct {
  void *cache; /* pool base */
  int32_t block_size;
  int32_t max_blocks; /* row stride of the block-table array */
  const int32_t *block_tables; /* [rows, max_blocks]: the row's sequence's blocks */
  int32_t dtype; /* SS_KV_F32 or SS_KV_F16 */
  int32_t pad;
} ss_kv;

/* ---------------------------------------------------------------- helpers */

#if SS_AVX2
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

/* IEEE half <-> float for the scalar paths, rounding to nearest even (what F16C and torch's
 * conversion do), so a K/V value is stored with the same bits whichever path wrote it. */
static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    float f = (float)man * 0x1p-24f; /* zero or subnormal: exact in fp32 */
    return sign ? -f : f;
  }
  bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u; /* NaN */
  if (ax >= 0x477ff000u) return sign | 0x7c00u; /* rounds past 65504: infinity */
  if (ax < 0x38800000u) {                        /* below 2^-14: a subnormal half (or zero) */
    float a;
    memcpy(&a, &ax, sizeof a);
    return sign | (uint16_t)lrintf(a * 0x1p24f); /* lrintf rounds to nearest even */
  }
  uint32_t h = ((ax >> 23) - 112u) << 10 | ((ax >> 13) & 0x3ffu), rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry into the exponent is right */
  return sign | (uint16_t)h;
}

static inline float dot_f32(const float *a, const float *b, int n) {
  int i = 0;
  float total = 0.f;
#if SS_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  total = _mm512_reduce_add_ps(acc);
#elif SS_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  total = hsum8(acc);
#endif
  for (; i < n; i++) total += a[i] * b[i];
  return total;
}

static inline void axpy(float *y, const float *x, float a, int n) {
  int i = 0;
#if SS_AVX512
  __m512 wa = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wa, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
#if SS_AVX2
  __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; i++) y[i] += a * x[i];
}

/* exp(x) for x >= -87, vectorized: a degree-6 polynomial after range reduction (~2 ulp). The
 * softmax's exps were a third of attention, and SiLU's scalar expf a tenth of a batch-8 step. */
#if SS_AVX512
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}
#endif

/* The same exp on 256-bit vectors (AVX2 has no scalef: 2^k is built in the exponent bits,
 * so x is also capped at 88, where exp is still finite). Where both run they agree: same
 * reduction, same polynomial, and p * 2^k is exact in either. On an AVX2-only CPU the scalar
 * expf of every softmax score and SiLU input was a third of a 1k-token prefill. */
#if SS_AVX2
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* The largest of s[0..n), vectorized: a scalar max is a chain of dependent compares, one per
 * score, and there are positions x heads of them in every layer. */
static inline float max_of(const float *s, int n) {
  int i = 0;
  float best = -INFINITY;
#if SS_AVX512
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(s);
    for (i = 16; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
    best = _mm512_reduce_max_ps(m);
  }
#elif SS_AVX2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    best = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; i++) best = s[i] > best ? s[i] : best;
  return best;
}

/* s[i] = exp(s[i] - shift) for i < n; returns their sum. */
static float exp_shifted(float *s, int n, float shift) {
  int i = 0;
  float total = 0.f;
#if SS_AVX512
  const __m512 vshift = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vshift));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#elif SS_AVX2
  const __m256 vshift = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vshift));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = hsum8(sum);
#endif
  for (; i < n; i++) {
    s[i] = expf(s[i] - shift);
    total += s[i];
  }
  return total;
}

/* a[i] = silu(g[i]) * u[i]. */
static void silu_mul(const float *g, const float *u, float *a, int n) {
  int i = 0;
#if SS_AVX512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    __m512 gv = _mm512_loadu_ps(g + i);
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
#elif SS_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Denormals flushed to zero for the duration of a job: softmax tails and long contexts make
 * products below FLT_MIN, and each one costs a microcode assist (~100 cycles) on x86 — a
 * 2,048-token step measured 7x slower with them. Values that small change no output. */
static inline unsigned flush_denormals(void) {
#if defined(__SSE__)
  unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
  return csr;
#else
  return 0;
#endif
}

static inline void restore_csr(unsigned csr) {
#if defined(__SSE__)
  _mm_setcsr(csr);
#else
  (void)csr;
#endif
}

/* ---------------------------------------------------------------- thread pool
 * Workers spin briefly for the next job (a decode step's ~250 phases follow each other within
 * microseconds), then sleep on a condition variable so an idle server costs no CPU. */

#define SS_MAX_THREADS 64
#define SS_SPIN 2000

typedef void (*ss_job)(void *ctx, int tid, int nth);

typedef struct {
  int started;
  int nth;
  pthread_t threads[SS_MAX_THREADS];
  atomic_uint generation;
  atomic_int pending;
  ss_job job;
  void *ctx;
  int job_nth;
  unsigned initial[SS_MAX_THREADS]; /* generation each worker starts from */
  pthread_mutex_t mutex;
  pthread_cond_t wake;
  pthread_mutex_t run; /* one job at a time: engines in several Python threads share the pool */
} ss_pool;

static ss_pool POOL = {.mutex = PTHREAD_MUTEX_INITIALIZER,
                       .wake = PTHREAD_COND_INITIALIZER,
                       .run = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if SS_AVX2
  _mm_pause();
#endif
}

static void *pool_worker(void *arg) {
  int tid = (int)(intptr_t)arg;
  unsigned seen = POOL.initial[tid];
  for (;;) {
    unsigned gen;
    int spins = 0;
    while ((gen = atomic_load_explicit(&POOL.generation, memory_order_acquire)) == seen) {
      if (++spins < SS_SPIN) {
        cpu_relax();
        continue;
      }
      pthread_mutex_lock(&POOL.mutex);
      while (atomic_load(&POOL.generation) == seen) pthread_cond_wait(&POOL.wake, &POOL.mutex);
      pthread_mutex_unlock(&POOL.mutex);
    }
    seen = gen;
    if (tid < POOL.job_nth) POOL.job(POOL.ctx, tid, POOL.job_nth);
    atomic_fetch_sub_explicit(&POOL.pending, 1, memory_order_release);
  }
  return NULL;
}

static void pool_run(ss_job job, void *ctx, int nth) {
  if (nth <= 1) {
    job(ctx, 0, 1);
    return;
  }
  pthread_mutex_lock(&POOL.run);
  pthread_mutex_lock(&POOL.mutex);
  while (POOL.started < nth - 1 && POOL.started < SS_MAX_THREADS - 1) {
    POOL.initial[POOL.started + 1] = atomic_load(&POOL.generation);
    pthread_create(&POOL.threads[POOL.started], NULL, pool_worker,
                   (void *)(intptr_t)(POOL.started + 1));
    POOL.started++;
  }
  if (nth > POOL.started + 1) nth = POOL.started + 1;
  POOL.job = job;
  POOL.ctx = ctx;
  POOL.job_nth = nth;
  atomic_store(&POOL.pending, POOL.started);
  atomic_fetch_add_explicit(&POOL.generation, 1, memory_order_release);
  pthread_cond_broadcast(&POOL.wake);
  pthread_mutex_unlock(&POOL.mutex);
  job(ctx, 0, nth);
  while (atomic_load_explicit(&POOL.pending, memory_order_acquire) > 0) cpu_relax();
  pthread_mutex_unlock(&POOL.run);
}

/* A sense-reversing barrier; yields after a while so an oversubscribed machine (two worker
 * processes on two cores) does not burn a time slice spinning on a descheduled peer. */
typedef struct {
  atomic_int count;
  atomic_int sense;
} ss_barrier;

static void barrier_wait(ss_barrier *b, int nth, int *local) {
  if (nth <= 1) return;
  *local = !*local;
  if (atomic_fetch_add(&b->count, 1) == nth - 1) {
    atomic_store(&b->count, 0);
    atomic_store_explicit(&b->sense, *local, memory_order_release);
    return;
  }
  int spins = 0;
  while (atomic_load_explicit(&b->sense, memory_order_acquire) != *local) {
    if (++spins < 4000)
      cpu_relax();
    else
      sched_yield();
  }
}

static inline void split(int n, int tid, int nth, int *begin, int *end) {
  int per = (n + nth - 1) / nth;
  *begin = tid * per < n ? tid * per : n;
  *end = *begin + per < n ? *begin + per : n;
}

/* ---------------------------------------------------------------- matrix x vector
 * y[r, o] = sum_i W[o, i] * x[r, i] for outputs o in [o0, o1). Rows go eight at a time so a
 * weight block is decoded once per eight rows. */

#if SS_AVX2
/* fp32 weights over several rows: F32_TILE_OUTS outputs and six rows form a tile whose sums
 * stay in registers, so each weight vector loaded feeds six FMAs and each input vector
 * F32_TILE_OUTS. A verify step of k + 1 rows then costs arithmetic, not k more passes over
 * the weights (a bandwidth-bound step's whole price). Each (row, output) sum is the very
 * sequence dot_f32 computes (one accumulator over the vectors in order, then its tail), so
 * a row's bits never depend on the rows beside it.
 * Four outputs where 32 vector registers hold the 24 sums (AVX-512), a pair where 16 do:
 * streaming SmolLM2's fp32 matrices on a 2-core AVX-512 EPYC, 72 rows (a batch of 8
 * verifying 8 drafts each) cost 150 ms a pass in pairs and 111 ms in fours, 16 rows 48 and 35,
 * 9 rows 30 and 27, 4 to 8 rows 26-28 and 23-27. Each input vector is held in a register
 * (F32_KEEP): left to itself the compiler reloaded it for every FMA, as a memory operand,
 * which made the loop load-bound (72 rows 150 -> 140 ms with that alone). */
#define F32_TILE_ROWS 6
#if SS_AVX512
#define F32_TILE_OUTS 4
#else
#define F32_TILE_OUTS 2
#endif
#define F32_KEEP(v) __asm__("" : "+v"(v))
/* Floats ahead of the tile's weight loads whose lines are requested early (their union
 * covers the weights that follow, whatever the shape). The hardware prefetcher keeps a
 * one-row pass at bandwidth but not a tile, whose arithmetic stalls the stream it follows:
 * 8 rows over SmolLM2's matrices on 2 AVX2 threads cost 31.9 ms a pass without, 22.5 with
 * (1 row: 17 ms).
 * The lines go to L2 (F32_PREFETCH_HINT), not L1: requests into L1 hold its few fill
 * buffers for a whole memory latency and the tile's own loads queue behind them. Passes over
 * SmolLM2's matrices on a 2-core AVX-512 EPYC (Zen 4, 2 threads), into L1 2,304 floats ahead
 * against into L2 9,216 ahead, the two builds interleaved: 3 rows 26.9 -> 19.4 ms, 9 rows
 * 31.2 -> 20.4, 16 rows 40.9 -> 32.9, 72 rows 115 -> 104 (1 row 17.5 either way, as it
 * streams through dot_f32 with no prefetch); the same build for AVX2 (-mno-avx512f) on that
 * CPU, 3 rows 26.8 -> 18.3, 9 rows 31.7 -> 23.9, 16 rows 48.1 -> 39.6, but 72 rows 134 -> 145 (a
 * batch's verify step; not measured on an AVX2 CPU itself). Into L2 2,304 ahead cost 9 rows
 * 22.4 and 16 rows 34.0. */
#define F32_AHEAD 9216
#define F32_PREFETCH_HINT _MM_HINT_T1
#if SS_AVX512
#define F32_STEP 16
typedef __m512 f32_vec;
static inline f32_vec f32_zero(void) { return _mm512_setzero_ps(); }
static inline f32_vec f32_load(const float *p) { return _mm512_loadu_ps(p); }
static inline f32_vec f32_fma(f32_vec a, f32_vec b, f32_vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float f32_sum(f32_vec v) { return _mm512_reduce_add_ps(v); }
#else
#define F32_STEP 8
typedef __m256 f32_vec;
static inline f32_vec f32_zero(void) { return _mm256_setzero_ps(); }
static inline f32_vec f32_load(const float *p) { return _mm256_loadu_ps(p); }
static inline f32_vec f32_fma(f32_vec a, f32_vec b, f32_vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float f32_sum(f32_vec v) { return hsum8(v); }
#endif

/* y[r, o..o+no-1] for the nr rows r0..r0+nr-1 (no <= F32_TILE_OUTS and nr <= 6 literals at
 * each call: every shape gets its own register-resident loop). */
static inline __attribute__((always_inline)) void f32_tile(const float *W, const float *x, int in, int out, int o,
                                                          int r0, float *y, const int no, const int nr) {
  const float *w0 = W + (size_t)o * in, *xr = x + (size_t)r0 * in;
  f32_vec acc[F32_TILE_OUTS][F32_TILE_ROWS];
  for (int j = 0; j < no; j++)
    for (int r = 0; r < nr; r++) acc[j][r] = f32_zero();
  int i = 0;
  for (; i + F32_STEP <= in; i += F32_STEP) {
    f32_vec wv[F32_TILE_OUTS];
    for (int j = 0; j < no; j++) {
      wv[j] = f32_load(w0 + (size_t)j * in + i);
      _mm_prefetch((const char *)(w0 + (size_t)j * in + i + F32_AHEAD), F32_PREFETCH_HINT);
    }
    for (int r = 0; r < nr; r++) {
      f32_vec xv = f32_load(xr + (size_t)r * in + i);
      F32_KEEP(xv);
      for (int j = 0; j < no; j++) acc[j][r] = f32_fma(wv[j], xv, acc[j][r]);
    }
  }
  for (int r = 0; r < nr; r++)
    for (int j = 0; j < no; j++) {
      float t = f32_sum(acc[j][r]);
      for (int k = i; k < in; k++) t += w0[(size_t)j * in + k] * xr[(size_t)r * in + k];
      y[(size_t)(r0 + r) * out + o + j] = t;
    }
}

/* Outputs [o, o + no) over every row: full tiles of six rows, then the rest. */
static inline __attribute__((always_inline)) void f32_tiles(const float *W, const float *x, int in, int out, int o,
                                                           int rows, float *y, const int no) {
  int r0 = 0;
  for (; r0 + F32_TILE_ROWS <= rows; r0 += F32_TILE_ROWS) f32_tile(W, x, in, out, o, r0, y, no, F32_TILE_ROWS);
  switch (rows - r0) {
    case 5: f32_tile(W, x, in, out, o, r0, y, no, 5); break;
    case 4: f32_tile(W, x, in, out, o, r0, y, no, 4); break;
    case 3: f32_tile(W, x, in, out, o, r0, y, no, 3); break;
    case 2: f32_tile(W, x, in, out, o, r0, y, no, 2); break;
    case 1: f32_tile(W, x, in, out, o, r0, y, no, 1); break;
    default: break;
  }
}
#endif

static void linear_f32(const ss_linear *w, const float *x, int rows, float *y, int o0, int o1) {
  const float *W = (const float *)w->data;
  int in = w->in_features, out = w->out_features, o = o0;
#if SS_AVX2
  if (rows > 1) { /* the outputs' weights stay in L1 across the row tiles */
    for (; o + F32_TILE_OUTS <= o1; o += F32_TILE_OUTS) f32_tiles(W, x, in, out, o, rows, y, F32_TILE_OUTS);
#if F32_TILE_OUTS > 2
    for (; o + 2 <= o1; o += 2) f32_tiles(W, x, in, out, o, rows, y, 2);
#endif
  }
#endif
  for (; o < o1; o++)
    for (int r = 0; r < rows; r++) y[(size_t)r * out + o] = dot_f32(W + (size_t)o * in, x + (size_t)r * in, in);
}

/* fp32 weights over a few rows, one output at a time: the weight row is read as one sequential
 * stream with no software prefetch, each input vector is loaded once into a register (the
 * compiler otherwise folds it into every FMA that uses it, a load per FMA), and the row's sums
 * are the very sequence dot_f32 computes. On a memory-bound pass this beats the tiles above
 * for a few rows: streaming SmolLM2's fp32 matrices on a 2-core AVX-512 EPYC (Zen 4,
 * 2 threads), 2 rows cost 12.1 ms against a pair tile's 24.6 and a four-output tile's 22
 * (1 row: 11.8 to 14.1), 3 rows 15.8 against 25.1 and 23, 5 rows 22.2 against 26.3 and 23,
 * 6 rows 27.5 against 26.3 and 25.5: the tiles' interleaved weight streams and prefetches
 * held the pass to ~20-25 GB/s where one stream reached ~40. Which serves a shape and row count is measured per machine
 * (shared/model/fp32_route.py offers both), as the AVX2 EPYC measured the tile best. */
#define F32_STREAM_MAX_ROWS 8
#if SS_AVX2
static inline __attribute__((always_inline)) void f32_stream_tile(const float *W, const float *x, int in, int out,
                                                                 int o, float *y, const int nr) {
  const float *w0 = W + (size_t)o * in;
  f32_vec acc[F32_STREAM_MAX_ROWS];
  for (int r = 0; r < nr; r++) acc[r] = f32_zero();
  int i = 0;
  for (; i + F32_STEP <= in; i += F32_STEP) {
    f32_vec wv = f32_load(w0 + i);
    for (int r = 0; r < nr; r++) {
      f32_vec xv = f32_load(x + (size_t)r * in + i);
      F32_KEEP(xv); /* a register load, not folded into the FMA */
      acc[r] = f32_fma(wv, xv, acc[r]);
    }
  }
  for (int r = 0; r < nr; r++) {
    float t = f32_sum(acc[r]);
    for (int j = i; j < in; j++) t += w0[j] * x[(size_t)r * in + j];
    y[(size_t)r * out + o] = t;
  }
}
#endif

static void linear_f32_streamed(const ss_linear *w, const float *x, int rows, float *y, int o0, int o1) {
#if SS_AVX2
  const float *W = (const float *)w->data;
  int in = w->in_features, out = w->out_features;
  if (rows <= F32_STREAM_MAX_ROWS) {
    for (int o = o0; o < o1; o++) switch (rows) {
        case 8: f32_stream_tile(W, x, in, out, o, y, 8); break;
        case 7: f32_stream_tile(W, x, in, out, o, y, 7); break;
        case 6: f32_stream_tile(W, x, in, out, o, y, 6); break;
        case 5: f32_stream_tile(W, x, in, out, o, y, 5); break;
        case 4: f32_stream_tile(W, x, in, out, o, y, 4); break;
        case 3: f32_stream_tile(W, x, in, out, o, y, 3); break;
        case 2: f32_stream_tile(W, x, in, out, o, y, 2); break;
        default: f32_stream_tile(W, x, in, out, o, y, 1); break;
      }
    return;
  }
#endif
  linear_f32(w, x, rows, y, o0, o1);
}

/* Q4_1: w = d * q + m, so sum(w * x) = sum_b d_b * sum(q * x) + sum_b m_b * xsum_b, where
 * xsum holds each row's per-block sum(x), computed once per call. */
static void linear_q4_1(const ss_linear *w, const float *x, const float *xsum, int rows, float *y,
                        int o0, int o1) {
  int in = w->in_features, out = w->out_features, nb = in / QK;
  const uint8_t *quants = (const uint8_t *)w->data;
  for (int r0 = 0; r0 < rows; r0 += 8) { /* eight rows a pass over the weights */
    int nr = rows - r0 < 8 ? rows - r0 : 8;
    for (int o = o0; o < o1; o++) {
      const uint8_t *qs = quants + (size_t)o * nb * Q4_1_QBYTES;
      const float *ds = w->scales + (size_t)o * nb, *ms = w->mins + (size_t)o * nb;
#if SS_AVX512
      __m512 acc[8];
      for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
      const __m128i low = _mm_set1_epi8(0x0f);
      for (int b = 0; b < nb; b++, qs += Q4_1_QBYTES) {
        __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low)));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low)));
        __m512 vd = _mm512_set1_ps(ds[b]);
        for (int r = 0; r < nr; r++) {
          const float *xr = x + (size_t)(r0 + r) * in + b * QK;
          __m512 t = _mm512_mul_ps(q0, _mm512_loadu_ps(xr));
          t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), t);
          acc[r] = _mm512_fmadd_ps(vd, t, acc[r]);
        }
      }
      for (int r = 0; r < nr; r++)
        y[(size_t)(r0 + r) * out + o] = _mm512_reduce_add_ps(acc[r]) + dot_f32(ms, xsum + (size_t)(r0 + r) * nb, nb);
#elif SS_AVX2
      __m256 acc[8];
      for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
      const __m128i low = _mm_set1_epi8(0x0f);
      for (int b = 0; b < nb; b++, qs += Q4_1_QBYTES) {
        __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        __m128i lo = _mm_and_si128(raw, low);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        __m256 vd = _mm256_set1_ps(ds[b]);
        for (int r = 0; r < nr; r++) {
          const float *xr = x + (size_t)(r0 + r) * in + b * QK;
          __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));
          t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), t);
          t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xr + 16), t);
          t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), t);
          acc[r] = _mm256_fmadd_ps(vd, t, acc[r]);
        }
      }
      for (int r = 0; r < nr; r++)
        y[(size_t)(r0 + r) * out + o] = hsum8(acc[r]) + dot_f32(ms, xsum + (size_t)(r0 + r) * nb, nb);
#else
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int b = 0; b < nb; b++, qs += Q4_1_QBYTES) {
        for (int r = 0; r < nr; r++) {
          const float *xr = x + (size_t)(r0 + r) * in + b * QK;
          float t = 0.f;
          for (int j = 0; j < 16; j++) t += (float)(qs[j] & 0x0f) * xr[j] + (float)(qs[j] >> 4) * xr[j + 16];
          acc[r] += ds[b] * t;
        }
      }
      for (int r = 0; r < nr; r++)
        y[(size_t)(r0 + r) * out + o] = acc[r] + dot_f32(ms, xsum + (size_t)(r0 + r) * nb, nb);
#endif
    }
  }
}

#define Q8_0_AHEAD 6 /* outputs ahead to prefetch: ~3.7 KB of a 576-wide matrix */

/* Not inlined: ss_greedy_pick calls it for single outputs and must get the bits a whole head
 * gets (the same instructions, whichever caller). */
__attribute__((noinline)) static void linear_q8_0(const ss_linear *w, const float *x, int rows, float *y, int o0,
                                                  int o1) {
  int in = w->in_features, out = w->out_features, nb = in / QK;
  const int8_t *quants = (const int8_t *)w->data;
  /* Eight rows share each pass over the weights: at batch 8 the head (49,152 x 576 Q8_0,
   * 30 MB) is then streamed once a step instead of twice. A row's sums are the same
   * whichever pass holds it. */
  for (int r0 = 0; r0 < rows; r0 += 8) {
    int nr = rows - r0 < 8 ? rows - r0 : 8;
    for (int o = o0; o < o1; o++) {
      const int8_t *qs = quants + (size_t)o * nb * Q8_0_QBYTES;
      const float *ds = w->scales + (size_t)o * nb;
      if (o + Q8_0_AHEAD < o1) { /* a row of the output head is a short loop: keep loads in flight */
        const char *next = (const char *)(qs + (size_t)Q8_0_AHEAD * nb * Q8_0_QBYTES);
        for (int off = 0; off < nb * Q8_0_QBYTES; off += 64) __builtin_prefetch(next + off, 0, 3);
        __builtin_prefetch(ds + (size_t)Q8_0_AHEAD * nb, 0, 3);
      }
#if SS_AVX512
      __m512 acc[8];
      for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
      for (int b = 0; b < nb; b++, qs += Q8_0_QBYTES) {
        __m512 vd = _mm512_set1_ps(ds[b]);
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
        for (int r = 0; r < nr; r++) {
          const float *xr = x + (size_t)(r0 + r) * in + b * QK;
          __m512 t = _mm512_mul_ps(q0, _mm512_loadu_ps(xr));
          t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), t);
          acc[r] = _mm512_fmadd_ps(vd, t, acc[r]);
        }
      }
      for (int r = 0; r < nr; r++) y[(size_t)(r0 + r) * out + o] = _mm512_reduce_add_ps(acc[r]);
#elif SS_AVX2
      __m256 acc[8];
      for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
      for (int b = 0; b < nb; b++, qs += Q8_0_QBYTES) {
        __m256 vd = _mm256_set1_ps(ds[b]);
        __m128i a = _mm_loadu_si128((const __m128i *)qs);
        __m128i c = _mm_loadu_si128((const __m128i *)(qs + 16));
        __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
        for (int r = 0; r < nr; r++) {
          const float *xr = x + (size_t)(r0 + r) * in + b * QK;
          __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));
          t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), t);
          t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xr + 16), t);
          t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), t);
          acc[r] = _mm256_fmadd_ps(vd, t, acc[r]);
        }
      }
      for (int r = 0; r < nr; r++) y[(size_t)(r0 + r) * out + o] = hsum8(acc[r]);
#else
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int b = 0; b < nb; b++, qs += Q8_0_QBYTES) {
        for (int r = 0; r < nr; r++) {
          const float *xr = x + (size_t)(r0 + r) * in + b * QK;
          float t = 0.f;
          for (int j = 0; j < QK; j++) t += (float)qs[j] * xr[j];
          acc[r] += ds[b] * t;
        }
      }
      for (int r = 0; r < nr; r++) y[(size_t)(r0 + r) * out + o] = acc[r];
#endif
    }
  }
}

#include "linear_a8.h"

static inline int takes_int8(int kind) {
  return kind == SS_Q4_1_A8 || kind == SS_Q8_0_A8 || kind == SS_Q4_1_A8_TILES || kind == SS_Q8_0_A8_TILES;
}

static void block_sums(const float *x, int rows, int in, float *xsum) {
  int nb = in / QK;
  for (int r = 0; r < rows; r++)
    for (int b = 0; b < nb; b++) {
      const float *xb = x + (size_t)r * in + b * QK;
      float s = 0.f;
      for (int j = 0; j < QK; j++) s += xb[j];
      xsum[(size_t)r * nb + b] = s;
    }
}

/* What a matrix needs of its input beyond x, for rows [r0, r1) of `rows` (each thread its own
 * rows, before the threads split the outputs): Q4_1's per-block sums, or an _A8 kind's int8 rows. */
static void prepare_rows(const ss_linear *w, const float *x, int rows, int r0, int r1, float *xsum, ss_acts *acts) {
  int in = w->in_features, nb = in / QK;
  if (r1 <= r0) return;
  if (w->kind == SS_Q4_1)
    block_sums(x + (size_t)r0 * in, r1 - r0, in, xsum + (size_t)r0 * nb);
  else if (takes_int8(w->kind))
    quantize_rows_part(x, rows, in, acts, r0 * nb, r1 * nb);
}

/* One thread's share of y = x W^T (outputs split evenly across threads). */
static void linear_part(const ss_linear *w, const float *x, const float *xsum, const ss_acts *acts,
                        int rows, float *y, int tid, int nth) {
  int o0, o1;
#if SS_AVX2
  if (w->kind == SS_Q4_1_A8_TILES || w->kind == SS_Q8_0_A8_TILES) { /* whole tiles per thread */
    split((w->out_features + A8_TILE - 1) / A8_TILE, tid, nth, &o0, &o1);
    o0 *= A8_TILE;
    o1 = o1 * A8_TILE < w->out_features ? o1 * A8_TILE : w->out_features;
#if SS_VNNI512
    if (w->kind == SS_Q8_0_A8_TILES) {
      linear_q8_0_a8_tiles(w, acts, rows, y, o0, o1);
      return;
    }
#endif
    linear_q4_1_a8_tiles(w, acts, rows, y, o0, o1); /* check_linear admitted only these */
    return;
  }
#endif
  split(w->out_features, tid, nth, &o0, &o1);
  if (w->kind == SS_Q4_1_A8)
    linear_q4_1_a8(w, acts, rows, y, o0, o1);
  else if (w->kind == SS_Q8_0_A8)
    linear_q8_0_a8(w, acts, rows, y, o0, o1);
  else if (w->kind == SS_Q4_1)
    linear_q4_1(w, x, xsum, rows, y, o0, o1);
  else if (w->kind == SS_Q8_0)
    linear_q8_0(w, x, rows, y, o0, o1);
  else
    linear_f32(w, x, rows, y, o0, o1);
}

/* ---------------------------------------------------------------- the step */

typedef struct {
  const ss_model *m;
  const ss_kv *kv;
  int rows;
  const int64_t *tokens;
  /* A draft head's rows (NULL: the target's): each row's state [rows, hidden], which the
   * model's input_proj reads beside the token's embedding. */
  const float *features;
  const int32_t *positions;
  /* Draft trees (NULL: none). Row r's logical positions t >= tree_base[r] live in the slots
   * tree_slots[r * tree_width + t - tree_base[r]] (its own included): a tree node attends to
   * its ancestors, which sit in the slots of other rows of the step, not at t. */
  const int32_t *tree_base, *tree_slots;
  int tree_width;
  float *out; /* [rows, hidden] final-normed hidden states */
  /* scratch */
  float *x, *h, *qkv, *attn, *gu, *act, *tmp, *xsum, *scores, *parts, *cat;
  int scores_stride;
  int *item_offsets; /* [rows + 1]: first attention work item of each row */
  void *acts_mem;    /* room for one matrix input's int8 rows (the widest input) */
  ss_barrier barrier;
  int error;
} step_ctx;

static void embed_row(const ss_model *m, int64_t token, float *x) {
  int hidden = m->hidden;
  if (m->embed) {
    memcpy(x, m->embed + (size_t)token * hidden, sizeof(float) * (size_t)hidden);
    return;
  }
  const int8_t *q = m->embed_quants + (size_t)token * hidden;
  const float *d = m->embed_scales + (size_t)token * (hidden / QK);
  for (int i = 0; i < hidden; i++) x[i] = (float)q[i] * d[i / QK];
}

static void rms_norm_rows(const float *x, const float *w, float eps, int rows, int n, float *y) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n;
    float ss = dot_f32(xr, xr, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    float *yr = y + (size_t)r * n;
    for (int i = 0; i < n; i++) yr[i] = xr[i] * inv * w[i];
  }
}

static void rope(float *v, const float *cos, const float *sin, int d) {
  int half = d / 2;
  float tmp[512];
  for (int i = 0; i < half; i++) {
    tmp[i] = v[i] * cos[i] - v[i + half] * sin[i];
    tmp[i + half] = v[i + half] * cos[i + half] + v[i] * sin[i + half];
  }
  memcpy(v, tmp, sizeof(float) * (size_t)d);
}

/* Element offset of one head's K (which 0) or V (1) at a row's position. */
static inline size_t kv_index(const step_ctx *c, int layer, int which, int row, int pos, int head) {
  const ss_model *m = c->m;
  const ss_kv *kv = c->kv;
  int bs = kv->block_size, d = m->head_dim, hkv = m->num_kv_heads;
  int32_t block = kv->block_tables[(size_t)row * kv->max_blocks + pos / bs];
  size_t per_layer = (size_t)2 * bs * hkv * d;
  return ((size_t)block * m->num_layers + layer) * per_layer + (size_t)which * bs * hkv * d +
         ((size_t)(pos % bs) * hkv + head) * d;
}

/* The KV slot of row r's logical position t: t itself, or the tree slot it was given. */
static inline int slot_of(const step_ctx *c, int r, int t) {
  if (c->tree_base && t >= c->tree_base[r]) return c->tree_slots[(size_t)r * c->tree_width + (t - c->tree_base[r])];
  return t;
}

/* Where row r's remapped (tree) positions start: past its context when it has none. */
static inline int tree_start(const step_ctx *c, int r) {
  return c->tree_base ? c->tree_base[r] : c->positions[r] + 1;
}

static void store_half(uint16_t *dst, const float *src, int d) {
  int i = 0;
#if SS_AVX512
  for (; i + 16 <= d; i += 16)
    _mm256_storeu_si256((__m256i *)(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if SS_AVX2
  for (; i + 8 <= d; i += 8)
    _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < d; i++) dst[i] = float_to_half(src[i]);
}

/* d values from fp32 into a slot of either element type. */
static void kv_store(const step_ctx *c, size_t index, const float *src, int d) {
  if (c->kv->dtype == SS_KV_F32)
    memcpy((float *)c->kv->cache + index, src, sizeof(float) * (size_t)d);
  else
    store_half((uint16_t *)c->kv->cache + index, src, d);
}

static inline float dot_f16(const float *a, const uint16_t *b, int n) {
  int i = 0;
  float total = 0.f;
#if SS_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + i))), acc);
  total = _mm512_reduce_add_ps(acc);
#elif SS_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i))), acc);
  total = hsum8(acc);
#endif
  for (; i < n; i++) total += a[i] * half_to_float(b[i]);
  return total;
}

static inline void axpy_f16(float *y, const uint16_t *x, float a, int n) {
  int i = 0;
#if SS_AVX512
  __m512 wa = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wa, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))),
                                            _mm512_loadu_ps(y + i)));
#endif
#if SS_AVX2
  __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))),
                                            _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; i++) y[i] += a * half_to_float(x[i]);
}

/* Attention is split over the context (split-KV): each work item is one row's GQA group of
 * query heads over one range of positions, so K and V are read once per group and two
 * threads share even a single row's work. A row's split count depends only on its context
 * length and the thread count, never on its batch-mates. */
#if SS_AVX512
/* Sixteen 64-element sums (one per vector) into one vector of the sums, lane u = sum of v[u]:
 * ~45 shuffles and adds for 16 dots, where reducing each dot alone cost ~10 apiece. */
static inline __m512 reduce16(__m512 *v) {
  __m512 r[8], s4[4], t2[2];
  for (int i = 0; i < 8; i++)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    s4[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; i++)
    t2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t2[0], t2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t2[0], t2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Sixteen K/V elements as fp32, from either element type (`half` is a constant at each call,
 * so the branch folds away in the specialised attention below). */
static inline __m512 load16(const void *base, size_t index, int half) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
  return _mm512_loadu_ps((const float *)base + index);
}

/* out[u] = scale * q . k[u * stride] for u < cnt (<= 16), head_dim 64; k is an element index. */
static inline __attribute__((always_inline)) void scores16(const float *q, const void *base, size_t k, int stride,
                                                           int cnt, float scale, float *out, int half) {
  __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16), q2 = _mm512_loadu_ps(q + 32),
         q3 = _mm512_loadu_ps(q + 48);
  __m512 acc[16];
  for (int u = 0; u < 16; u++) {
    if (u < cnt) {
      size_t ku = k + (size_t)u * stride;
      __m512 a = _mm512_mul_ps(q0, load16(base, ku, half));
      a = _mm512_fmadd_ps(q1, load16(base, ku + 16, half), a);
      a = _mm512_fmadd_ps(q2, load16(base, ku + 32, half), a);
      acc[u] = _mm512_fmadd_ps(q3, load16(base, ku + 48, half), a);
    } else {
      acc[u] = _mm512_setzero_ps();
    }
  }
  __m512 sums = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, (__mmask16)((1u << cnt) - 1), sums);
}
#endif

#if SS_AVX2 && !SS_AVX512
/* The AVX2 build's attention: a GQA group's heads share each K and V row, so a block's rows
 * are widened to fp32 once into a scratch tile and every head reads them from there, and
 * eight positions' dots are reduced together; converting a row per head and reducing every
 * dot alone made attention 45% of a batch-8 step at 512 tokens of context. */
#define AVX2_ROWS 16 /* positions widened at a time: one 16-token block */

/* rows [0, cnt) of K or V (element index k, row stride `stride`) as fp32 [cnt, 64]. */
static inline void widen_rows(const void *base, size_t k, int stride, int cnt, int half, float *dst) {
  for (int u = 0; u < cnt; u++, k += (size_t)stride)
    for (int i = 0; i < 64; i += 8) {
      __m256 v = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + k + i)))
                      : _mm256_loadu_ps((const float *)base + k + i);
      _mm256_storeu_ps(dst + u * 64 + i, v);
    }
}

/* out[u] = scale * q . rows[u] for u < cnt (<= 8), head_dim 64. */
static inline void scores8(const float *q, const float *rows, int cnt, float scale, float *out) {
  __m256 acc[8];
  for (int u = 0; u < 8; u++) {
    acc[u] = _mm256_setzero_ps();
    if (u < cnt)
      for (int i = 0; i < 64; i += 8)
        acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(rows + u * 64 + i), acc[u]);
  }
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
  for (int u = 0; u < cnt; u++) out[u] = lanes[u];
}
#endif

static inline int attn_splits(int ctx, int nth) {
  int splits = ctx / 64;
  if (splits > nth) splits = nth;
  return splits < 1 ? 1 : splits;
}

static inline int item_row(const step_ctx *c, int item) {
  int r = 0;
  while (item >= c->item_offsets[r + 1]) r++;
  return r;
}

/* Blocks of a sequence lie anywhere in the pool, so the hardware prefetcher, which follows
 * addresses within a page, stalls at every block boundary: the next block's rows for this
 * head group are requested while the current block is computed (measured at batch 8, 512
 * tokens: attention was half waiting on memory). */
static inline void prefetch_block(const void *base, size_t index, int count, int stride, int d, int half) {
  const char *p = (const char *)base + index * (half ? 2 : 4);
  size_t row_bytes = (size_t)d * (half ? 2 : 4), step = (size_t)stride * (half ? 2 : 4);
  for (int u = 0; u < count; u++, p += step)
    for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* Scores of the group's heads at one position (element index k): the arithmetic the block walk
 * gives that position (each lane of scores16 / scores8 is its own dot), so a tree row's
 * remapped positions score exactly as they will once they are ordinary context. */
static inline __attribute__((always_inline)) void score_position(const step_ctx *c, const float *q, const void *base,
                                                                 size_t k, int group, float *out, int n, const int half) {
  const ss_model *m = c->m;
  int d = m->head_dim;
#if SS_AVX512
  if (d == 64) {
    for (int j = 0; j < group; j++) scores16(q + j * d, base, k, 0, 1, m->scale, out + j * n, half);
    return;
  }
#elif SS_AVX2
  if (d == 64) {
    float wide[64];
    widen_rows(base, k, 0, 1, half, wide);
    for (int j = 0; j < group; j++) scores8(q + j * d, wide, 1, m->scale, out + j * n);
    return;
  }
#endif
  for (int j = 0; j < group; j++)
    out[j * n] = (half ? dot_f16(q + j * d, (const uint16_t *)base + k, d) : dot_f32(q + j * d, (const float *)base + k, d)) *
                 m->scale;
}

/* One attention pass over either element type; `half` is a literal at both call sites, so
 * each gets its own loop without a per-element branch. A range's positions below the row's
 * tree start are walked block by block; a tree row's remapped positions after them one at a
 * time, in the same order and with the same per-position arithmetic. */
static inline __attribute__((always_inline)) void attention_typed(step_ctx *c, int layer, int tid, int nth,
                                                                  const int half) {
  const ss_model *m = c->m;
  const void *base = c->kv->cache;
  int hq = m->num_heads, hkv = m->num_kv_heads, d = m->head_dim, group = hq / hkv;
  int qkv_width = (hq + 2 * hkv) * d, part_stride = group * (d + 2);
  float *scores = c->scores + (size_t)tid * c->scores_stride;
#if SS_AVX2 && !SS_AVX512
  float wide[AVX2_ROWS * 64]; /* one block's K or V rows as fp32 */
#endif
  for (int item = tid; item < c->item_offsets[c->rows]; item += nth) {
    int r = item_row(c, item), ctx = c->positions[r] + 1, splits = attn_splits(ctx, nth);
    int local = item - c->item_offsets[r], g = local / splits, sp = local % splits;
    int t0 = (int)((int64_t)sp * ctx / splits), t1 = (int)((int64_t)(sp + 1) * ctx / splits);
    int n = t1 - t0, tree = tree_start(c, r);
    int tm = tree < t0 ? t0 : (tree < t1 ? tree : t1); /* [t0, tm) in place, [tm, t1) remapped */
    const float *q = c->qkv + (size_t)r * qkv_width + (size_t)g * group * d;
    const int bs = c->kv->block_size, slot_stride = hkv * d;
    if (tm > t0) {
      /* The V rows of the range's first block too: they are read right after the scores. */
      int first = (t0 / bs + 1) * bs < tm ? (t0 / bs + 1) * bs - t0 : tm - t0;
      prefetch_block(base, kv_index(c, layer, 1, r, t0, g), first, slot_stride, d, half);
    }
    /* Positions are walked block by block: one table lookup per block, not per position. */
    for (int t = t0; t < tm;) {
      int stop = (t / bs + 1) * bs < tm ? (t / bs + 1) * bs : tm;
      size_t k = kv_index(c, layer, 0, r, t, g);
      if (stop < tm) {
        int next = tm - stop < bs ? tm - stop : bs;
        prefetch_block(base, kv_index(c, layer, 0, r, stop, g), next, slot_stride, d, half);
      }
#if SS_AVX512
      if (d == 64) { /* 16 positions' dots at a time, reduced together (see scores16) */
        for (; t < stop; t += 16, k += (size_t)16 * slot_stride) {
          int cnt = stop - t < 16 ? stop - t : 16;
          for (int j = 0; j < group; j++)
            scores16(q + j * d, base, k, slot_stride, cnt, m->scale, scores + j * n + (t - t0), half);
        }
        t = stop;
        continue;
      }
#elif SS_AVX2
      if (d == 64) { /* the block's K rows widened once, eight dots reduced together */
        for (; t < stop; t += AVX2_ROWS, k += (size_t)AVX2_ROWS * slot_stride) {
          int cnt = stop - t < AVX2_ROWS ? stop - t : AVX2_ROWS;
          widen_rows(base, k, slot_stride, cnt, half, wide);
          for (int j = 0; j < group; j++)
            for (int u = 0; u < cnt; u += 8)
              scores8(q + j * d, wide + u * 64, cnt - u < 8 ? cnt - u : 8, m->scale, scores + j * n + (t - t0) + u);
        }
        t = stop;
        continue;
      }
#endif
      for (; t < stop; t++, k += slot_stride)
        for (int j = 0; j < group; j++)
          scores[j * n + (t - t0)] =
              (half ? dot_f16(q + j * d, (const uint16_t *)base + k, d) : dot_f32(q + j * d, (const float *)base + k, d)) *
              m->scale;
    }
    for (int t = tm; t < t1; t++)
      score_position(c, q, base, kv_index(c, layer, 0, r, slot_of(c, r, t), g), group, scores + (t - t0), n, half);
    float *part = c->parts + (size_t)item * part_stride;
    for (int j = 0; j < group; j++) {
      float *sj = scores + j * n, best = max_of(sj, n);
      float *pj = part + j * (d + 2);
      pj[0] = best;
      pj[1] = exp_shifted(sj, n, best);
      memset(pj + 2, 0, sizeof(float) * (size_t)d);
    }
#if SS_AVX512
    if (d == 64 && group <= 4) { /* the group's outputs stay in registers over the range */
      __m512 acc[4][4];
      for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();
      for (int t = t0; t < t1;) {
        int stop = t >= tm ? t + 1 : ((t / bs + 1) * bs < tm ? (t / bs + 1) * bs : tm);
        size_t v = kv_index(c, layer, 1, r, slot_of(c, r, t), g);
        if (t < tm && stop < tm) {
          int next = tm - stop < bs ? tm - stop : bs;
          prefetch_block(base, kv_index(c, layer, 1, r, stop, g), next, slot_stride, d, half);
        }
        for (; t < stop; t++, v += slot_stride) {
          __m512 v0 = load16(base, v, half), v1 = load16(base, v + 16, half), v2 = load16(base, v + 32, half),
                 v3 = load16(base, v + 48, half);
          for (int j = 0; j < group; j++) {
            __m512 p = _mm512_set1_ps(scores[j * n + (t - t0)]);
            acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
            acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);
            acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);
          }
        }
      }
      for (int j = 0; j < group; j++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(part + j * (d + 2) + 2 + i * 16, acc[j][i]);
      continue;
    }
#elif SS_AVX2
    if (d == 64) { /* per block: V rows widened once, each head's 64 outputs in registers */
      for (int t = t0; t < t1;) {
        int stop = t >= tm ? t + 1 : ((t / bs + 1) * bs < tm ? (t / bs + 1) * bs : tm);
        size_t v = kv_index(c, layer, 1, r, slot_of(c, r, t), g);
        if (t < tm && stop < tm) {
          int next = tm - stop < bs ? tm - stop : bs;
          prefetch_block(base, kv_index(c, layer, 1, r, stop, g), next, slot_stride, d, half);
        }
        for (; t < stop; t += AVX2_ROWS, v += (size_t)AVX2_ROWS * slot_stride) {
          int cnt = stop - t < AVX2_ROWS ? stop - t : AVX2_ROWS;
          widen_rows(base, v, slot_stride, cnt, half, wide);
          for (int j = 0; j < group; j++) {
            float *y = part + j * (d + 2) + 2;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_loadu_ps(y + 8 * i);
            for (int u = 0; u < cnt; u++) {
              __m256 p = _mm256_set1_ps(scores[j * n + (t - t0) + u]);
              for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(wide + u * 64 + 8 * i), acc[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(y + 8 * i, acc[i]);
          }
        }
        t = stop;
      }
      continue;
    }
#endif
    for (int t = t0; t < t1;) {
      int stop = t >= tm ? t + 1 : ((t / bs + 1) * bs < tm ? (t / bs + 1) * bs : tm);
      size_t v = kv_index(c, layer, 1, r, slot_of(c, r, t), g);
      for (; t < stop; t++, v += slot_stride)
        for (int j = 0; j < group; j++) {
          float w = scores[j * n + (t - t0)];
          float *y = part + j * (d + 2) + 2;
          if (half)
            axpy_f16(y, (const uint16_t *)base + v, w, d);
          else
            axpy(y, (const float *)base + v, w, d);
        }
    }
  }
}

static void attention_part(step_ctx *c, int layer, int tid, int nth) {
  if (c->kv->dtype == SS_KV_F16)
    attention_typed(c, layer, tid, nth, 1);
  else
    attention_typed(c, layer, tid, nth, 0);
}

/* Softmax-weighted merge of each head's split partials, in split order. */
static void attention_merge(step_ctx *c, int tid, int nth) {
  const ss_model *m = c->m;
  int hq = m->num_heads, hkv = m->num_kv_heads, d = m->head_dim, group = hq / hkv;
  int part_stride = group * (d + 2), i0, i1;
  split(c->rows * hq, tid, nth, &i0, &i1);
  for (int item = i0; item < i1; item++) {
    int r = item / hq, h = item % hq, g = h / group, j = h % group;
    int splits = attn_splits(c->positions[r] + 1, nth);
    const float *first = c->parts + (size_t)(c->item_offsets[r] + g * splits) * part_stride + j * (d + 2);
    float best = -INFINITY, total = 0.f;
    for (int sp = 0; sp < splits; sp++) best = first[sp * part_stride] > best ? first[sp * part_stride] : best;
    float *out = c->attn + (size_t)r * hq * d + (size_t)h * d;
    memset(out, 0, sizeof(float) * (size_t)d);
    for (int sp = 0; sp < splits; sp++) {
      const float *p = first + sp * part_stride;
      float w = expf(p[0] - best);
      total += w * p[1];
      axpy(out, p + 2, w, d);
    }
    float inv = 1.0f / total;
    for (int i = 0; i < d; i++) out[i] *= inv;
  }
}

/* The per-row work between matrices (norms, RoPE and the K/V write, SiLU, residual adds and
 * the next matrix's input preparation) is split by rows: thread t owns rows [r0, r1) there,
 * and a row's values never depend on which thread computed them. */
static void step_job(void *arg, int tid, int nth) {
  step_ctx *c = (step_ctx *)arg;
  unsigned csr = flush_denormals();
  const ss_model *m = c->m;
  int rows = c->rows, hidden = m->hidden, hq = m->num_heads, hkv = m->num_kv_heads, d = m->head_dim;
  int inter = m->intermediate, qkv_width = (hq + 2 * hkv) * d;
  int sense = 0, r0, r1;
  split(rows, tid, nth, &r0, &r1);
  int own = r1 - r0;
  ss_acts acts;
  if (c->features) { /* a draft head: x = input_proj([embedding; state]) */
    const ss_linear *P = &m->input_proj;
    for (int r = r0; r < r1; r++) {
      float *row = c->cat + (size_t)r * 2 * hidden;
      embed_row(m, c->tokens[r], row);
      memcpy(row + hidden, c->features + (size_t)r * hidden, sizeof(float) * (size_t)hidden);
    }
    acts = acts_view(c->acts_mem, rows, 2 * hidden);
    prepare_rows(P, c->cat, rows, r0, r1, c->xsum, &acts);
    barrier_wait(&c->barrier, nth, &sense);
    linear_part(P, c->cat, c->xsum, &acts, rows, c->x, tid, nth);
    barrier_wait(&c->barrier, nth, &sense);
  } else {
    for (int r = r0; r < r1; r++) embed_row(m, c->tokens[r], c->x + (size_t)r * hidden);
  }
  for (int l = 0; l < m->num_layers; l++) {
    const ss_layer *L = &m->layers[l];
    acts = acts_view(c->acts_mem, rows, hidden);
    if (own > 0) {
      rms_norm_rows(c->x + (size_t)r0 * hidden, L->input_norm, m->eps, own, hidden, c->h + (size_t)r0 * hidden);
      prepare_rows(&L->qkv, c->h, rows, r0, r1, c->xsum, &acts);
    }
    barrier_wait(&c->barrier, nth, &sense);
    linear_part(&L->qkv, c->h, c->xsum, &acts, rows, c->qkv, tid, nth);
    barrier_wait(&c->barrier, nth, &sense);
    for (int r = r0; r < r1; r++) { /* RoPE on q and k, then the new K/V into their slots */
      float *row = c->qkv + (size_t)r * qkv_width;
      int pos = c->positions[r];
      const float *cs = m->rope_cos + (size_t)pos * d, *sn = m->rope_sin + (size_t)pos * d;
      for (int h = 0; h < hq + hkv; h++) rope(row + h * d, cs, sn, d);
      int slot = slot_of(c, r, pos);
      for (int h = 0; h < hkv; h++) {
        kv_store(c, kv_index(c, l, 0, r, slot, h), row + (hq + h) * d, d);
        kv_store(c, kv_index(c, l, 1, r, slot, h), row + (hq + hkv + h) * d, d);
      }
    }
    barrier_wait(&c->barrier, nth, &sense);
    attention_part(c, l, tid, nth);
    barrier_wait(&c->barrier, nth, &sense);
    attention_merge(c, tid, nth);
    barrier_wait(&c->barrier, nth, &sense);
    acts = acts_view(c->acts_mem, rows, hq * d);
    prepare_rows(&L->o_proj, c->attn, rows, r0, r1, c->xsum, &acts);
    barrier_wait(&c->barrier, nth, &sense);
    linear_part(&L->o_proj, c->attn, c->xsum, &acts, rows, c->tmp, tid, nth);
    barrier_wait(&c->barrier, nth, &sense);
    acts = acts_view(c->acts_mem, rows, hidden);
    if (own > 0) {
      for (size_t i = (size_t)r0 * hidden; i < (size_t)r1 * hidden; i++) c->x[i] += c->tmp[i];
      rms_norm_rows(c->x + (size_t)r0 * hidden, L->post_norm, m->eps, own, hidden, c->h + (size_t)r0 * hidden);
      prepare_rows(&L->gate_up, c->h, rows, r0, r1, c->xsum, &acts);
    }
    barrier_wait(&c->barrier, nth, &sense);
    linear_part(&L->gate_up, c->h, c->xsum, &acts, rows, c->gu, tid, nth);
    barrier_wait(&c->barrier, nth, &sense);
    acts = acts_view(c->acts_mem, rows, inter);
    for (int r = r0; r < r1; r++) {
      const float *g = c->gu + (size_t)r * 2 * inter, *u = g + inter;
      silu_mul(g, u, c->act + (size_t)r * inter, inter);
    }
    prepare_rows(&L->down, c->act, rows, r0, r1, c->xsum, &acts);
    barrier_wait(&c->barrier, nth, &sense);
    linear_part(&L->down, c->act, c->xsum, &acts, rows, c->tmp, tid, nth);
    barrier_wait(&c->barrier, nth, &sense);
    for (size_t i = (size_t)r0 * hidden; i < (size_t)r1 * hidden; i++) c->x[i] += c->tmp[i];
  }
  if (own > 0) rms_norm_rows(c->x + (size_t)r0 * hidden, m->final_norm, m->eps, own, hidden, c->out + (size_t)r0 * hidden);
  restore_csr(csr);
}

static int check_linear(const ss_linear *w) {
  if (w->kind == SS_F32) return 0;
  if (w->kind == SS_Q4_1_A8_TILES || w->kind == SS_Q8_0_A8_TILES) { /* this build's layout only */
    int built = w->kind == SS_Q4_1_A8_TILES ? SS_AVX2 : SS_VNNI512;
    return built && w->in_features % QK == 0 && w->data ? 0 : -1;
  }
  if ((w->kind == SS_Q4_1_A8 || w->kind == SS_Q8_0_A8) && w->in_features % QK == 0 && w->scales && w->mins)
    return 0;
  if (w->kind == SS_Q8_0 && w->in_features % QK == 0 && w->scales) return 0;
  if (w->kind == SS_Q4_1 && w->in_features % QK == 0 && w->scales && w->mins) return 0;
  return -1;
}

static int slot_fits(const ss_kv *kv, int slot) { return slot >= 0 && slot / kv->block_size < kv->max_blocks; }

/* Rows verifying a draft tree: row r's logical positions t >= tree_base[r] (up to its own,
 * positions[r], which RoPE uses) are read from, and its own K/V written to, the slots
 * tree_slots[r * tree_width + t - tree_base[r]]; a row without a tree has tree_base[r] =
 * positions[r] + 1. NULL arrays: no trees (ss_forward).
 * Returns 0, or a negative code: -1 bad argument, -2 out of memory. */
/* The target's rows (features NULL), or a draft head's (see ss_forward_head). */
static int forward_rows(const ss_model *m, const ss_kv *kv, int rows, const int64_t *tokens, const float *features,
                        const int32_t *positions, const int32_t *tree_base, const int32_t *tree_slots, int tree_width,
                        float *out, int nth) {
  if (rows <= 0 || !tokens || m->head_dim > 512 || m->num_heads % m->num_kv_heads) return -1;
  if (kv->dtype != SS_KV_F32 && kv->dtype != SS_KV_F16) return -1;
  if (!m->embed && (!m->embed_quants || !m->embed_scales || m->hidden % QK)) return -1;
  if (features && (m->input_proj.out_features != m->hidden || m->input_proj.in_features != 2 * m->hidden ||
                   !m->input_proj.data || check_linear(&m->input_proj)))
    return -1;
  if ((tree_base == NULL) != (tree_slots == NULL) || (tree_base && tree_width < 1)) return -1;
  int max_ctx = 0;
  for (int r = 0; r < rows; r++) {
    if (positions[r] < 0 || positions[r] >= m->max_pos || tokens[r] < 0 || tokens[r] >= m->vocab) return -1;
    if (!slot_fits(kv, positions[r])) return -1;
    if (tree_base) {
      int b = tree_base[r], used = positions[r] + 1 - b;
      if (b < 0 || used < 0 || used > tree_width) return -1;
      for (int i = 0; i < used; i++)
        if (!slot_fits(kv, tree_slots[(size_t)r * tree_width + i])) return -1;
    }
    if (positions[r] + 1 > max_ctx) max_ctx = positions[r] + 1;
  }
  for (int l = 0; l < m->num_layers; l++) {
    const ss_layer *L = &m->layers[l];
    if (check_linear(&L->qkv) || check_linear(&L->o_proj) || check_linear(&L->gate_up) ||
        check_linear(&L->down))
      return -1;
  }
  if (nth < 1) nth = 1;
  if (nth > SS_MAX_THREADS) nth = SS_MAX_THREADS;
  int hidden = m->hidden, d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
  int widest = 2 * m->intermediate > 2 * hidden ? 2 * m->intermediate : 2 * hidden;
  size_t sizes[] = {
      (size_t)rows * hidden,               /* x */
      (size_t)rows * hidden,               /* h */
      (size_t)rows * (hq + 2 * hkv) * d,   /* qkv */
      (size_t)rows * hq * d,               /* attn */
      (size_t)rows * 2 * m->intermediate,  /* gu */
      (size_t)rows * m->intermediate,      /* act */
      (size_t)rows * hidden,               /* tmp */
      (size_t)rows * (widest / QK + 1),    /* xsum */
      (size_t)nth * max_ctx * (hq / hkv),  /* scores */
      (size_t)rows * hkv * nth * (hq / hkv) * (d + 2), /* parts */
      features ? (size_t)rows * 2 * hidden : 0,        /* cat */
  };
  size_t total = 0;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i];
  int widest_in = m->intermediate > hq * d ? m->intermediate : hq * d;
  widest_in = widest_in > 2 * hidden ? widest_in : 2 * hidden;
  size_t acts_floats = (acts_bytes(rows, widest_in) + sizeof(float) - 1) / sizeof(float);
  float *scratch = (float *)malloc((total + acts_floats) * sizeof(float));
  if (!scratch) return -2;
  step_ctx c = {.m = m,
               .kv = kv,
               .rows = rows,
               .tokens = tokens,
               .features = features,
               .positions = positions,
               .tree_base = tree_base,
               .tree_slots = tree_slots,
               .tree_width = tree_width,
               .out = out};
  float **slots[] = {&c.x, &c.h, &c.qkv, &c.attn, &c.gu, &c.act, &c.tmp, &c.xsum, &c.scores, &c.parts, &c.cat};
  float *p = scratch;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    *slots[i] = p;
    p += sizes[i];
  }
  c.scores_stride = max_ctx * (hq / hkv);
  c.acts_mem = p;
  int *offsets = (int *)malloc(sizeof(int) * (size_t)(rows + 1));
  if (!offsets) {
    free(scratch);
    return -2;
  }
  offsets[0] = 0;
  for (int r = 0; r < rows; r++) offsets[r + 1] = offsets[r] + hkv * attn_splits(positions[r] + 1, nth);
  c.item_offsets = offsets;
  atomic_store(&c.barrier.count, 0);
  atomic_store(&c.barrier.sense, 0);
  pool_run(step_job, &c, nth);
  free(offsets);
  free(scratch);
  return 0;
}

int ss_forward_tree(const ss_model *m, const ss_kv *kv, int rows, const int64_t *tokens, const int32_t *positions,
                    const int32_t *tree_base, const int32_t *tree_slots, int tree_width, float *out, int nth) {
  if (!tokens) return -1;
  return forward_rows(m, kv, rows, tokens, NULL, positions, tree_base, tree_slots, tree_width, out, nth);
}

int ss_forward(const ss_model *m, const ss_kv *kv, int rows, const int64_t *tokens, const int32_t *positions,
               float *out, int nth) {
  return ss_forward_tree(m, kv, rows, tokens, positions, NULL, NULL, 0, out, nth);
}

/* A draft head's step (EAGLE-style): row r's input is input_proj([embedding of tokens[r];
 * features[r]]), features [rows, hidden] being a target state or the head's own previous
 * prediction; then the model's layers and final norm, over the head's own KV. In torch this
 * step was ~40 small operations (0.94 ms on a 2-core EPYC) around ~0.2 ms of arithmetic. */
int ss_forward_head(const ss_model *m, const ss_kv *kv, int rows, const int64_t *tokens, const float *features,
                    const int32_t *positions, const int32_t *tree_base, const int32_t *tree_slots, int tree_width,
                    float *out, int nth) {
  if (!features) return -1;
  return forward_rows(m, kv, rows, tokens, features, positions, tree_base, tree_slots, tree_width, out, nth);
}

/* ---------------------------------------------------------------- the output head */

typedef struct {
  const ss_linear *w;
  const float *x;
  const float *xsum;
  const ss_acts *acts;
  int rows;
  float *y;
  int streamed; /* fp32: linear_f32_streamed */
} head_ctx;

static void head_job(void *arg, int tid, int nth) {
  head_ctx *c = (head_ctx *)arg;
  unsigned csr = flush_denormals();
  if (c->streamed && c->w->kind == SS_F32) {
    int o0, o1;
    split(c->w->out_features, tid, nth, &o0, &o1);
    linear_f32_streamed(c->w, c->x, c->rows, c->y, o0, o1);
  } else {
    linear_part(c->w, c->x, c->xsum, c->acts, c->rows, c->y, tid, nth);
  }
  restore_csr(csr);
}

static int linear_forward(const ss_linear *w, const float *x, int rows, float *y, int nth, int streamed) {
  if (rows <= 0 || check_linear(w)) return -1;
  if (nth < 1) nth = 1;
  if (nth > SS_MAX_THREADS) nth = SS_MAX_THREADS;
  /* Room for whichever input form the kind needs: per-block sums or int8 rows. */
  void *mem = malloc(acts_bytes(rows, w->in_features) + sizeof(float) * (size_t)rows * (w->in_features / QK));
  if (!mem) return -2;
  ss_acts acts = acts_view(mem, rows, w->in_features);
  float *xsum = (float *)((char *)mem + acts_bytes(rows, w->in_features));
  prepare_rows(w, x, rows, 0, rows, xsum, &acts);
  head_ctx c = {.w = w, .x = x, .xsum = xsum, .acts = &acts, .rows = rows, .y = y, .streamed = streamed};
  pool_run(head_job, &c, nth);
  free(mem);
  return 0;
}

/* y [rows, out] = x [rows, in] W^T, on the pool (the output head, or any one matrix). */
int ss_linear_forward(const ss_linear *w, const float *x, int rows, float *y, int nth) {
  return linear_forward(w, x, rows, y, nth, 0);
}

/* The same product; fp32 weights over up to F32_STREAM_MAX_ROWS rows one output at a time
 * (linear_f32_streamed). Same bits as ss_linear_forward: only the order of outputs differs. */
int ss_linear_forward_streamed(const ss_linear *w, const float *x, int rows, float *y, int nth) {
  return linear_forward(w, x, rows, y, nth, 1);
}

/* Output o's bound on |exact - approximate| for a row with block steps `step` (see below). */
static inline float greedy_bound(const float *step, const float *weight_side, int o, int nb, float factor) {
  const float *w = weight_side + (size_t)o * nb;
  float total = 0.f;
  for (int b = 0; b < nb; b++) total += step[b] * w[b];
  return factor * total;
}

/* The first o' >= o with y[o'] >= floor, or n: a compare per 16 outputs, since nearly every
 * approximate logit lies far below its row's maximum. */
static inline int next_at_least(const float *y, int n, float floor, int o) {
#if SS_AVX512
  for (__m512 f = _mm512_set1_ps(floor); o + 16 <= n; o += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(y + o), f, _CMP_GE_OQ);
    if (m) return o + __builtin_ctz(m);
  }
#endif
  for (; o < n; o++)
    if (y[o] >= floor) return o;
  return n;
}

/* Each row's greedy token under the Q8_0 head `exact`, without its full logits
 * (shared/model/greedy_head.py has the why and the bound): `approx` holds every output's
 * logit from the same weights with int8 activations, within factor * sum_b step[b] *
 * weight_side[o, b] of the exact one, where step[b] = max|x_b| / 127. An output can be the
 * argmax only if its approximate logit is within twice the widest bound (`widest`, per
 * block) of the row's largest, and only if its own upper bound reaches the largest lower
 * bound among those; the few that pass are computed by linear_q8_0 itself, one output at a
 * time (the same function as the full head: the same bits), and the first maximum by
 * output wins, as torch.argmax's does. Returns -1, writing nothing, where a row's values are
 * not finite (no bound holds there): the caller then takes the full logits. */
int ss_greedy_pick(const ss_linear *exact, const float *approx, const float *x, int rows,
                   const float *weight_side, const float *widest, float factor, int64_t *out) {
  if (exact->kind != SS_Q8_0) return -2;
  int in = exact->in_features, vocab = exact->out_features, nb = in / QK;
  float step[256];
  if (nb > 256) return -2;
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * in, *y = approx + (size_t)r * vocab;
    float slack = 0.f;
    for (int b = 0; b < nb; b++) {
      float amax = 0.f;
      for (int j = 0; j < QK; j++) amax = fabsf(xr[b * QK + j]) > amax ? fabsf(xr[b * QK + j]) : amax;
      step[b] = amax / 127.f;
      slack += step[b] * widest[b];
    }
    slack *= 2.f * factor;
    float top = max_of(y, vocab);
    if (!isfinite(top) || !isfinite(slack)) return -1;
    float near = top - slack, floor = -INFINITY;
    for (int o = next_at_least(y, vocab, near, 0); o < vocab; o = next_at_least(y, vocab, near, o + 1)) {
      float low = y[o] - greedy_bound(step, weight_side, o, nb, factor);
      floor = low > floor ? low : floor;
    }
    float best = -INFINITY;
    int64_t pick = -1;
    for (int o = next_at_least(y, vocab, near, 0); o < vocab; o = next_at_least(y, vocab, near, o + 1)) {
      if (y[o] + greedy_bound(step, weight_side, o, nb, factor) < floor) continue;
      ss_linear one = *exact;
      one.out_features = 1;
      one.data = (const int8_t *)exact->data + (size_t)o * nb * Q8_0_QBYTES;
      one.scales = exact->scales + (size_t)o * nb;
      float value;
      linear_q8_0(&one, xr, 1, &value, 0, 1);
      if (pick < 0 || value > best) { /* strictly greater: the first maximum stays */
        best = value;
        pick = o;
      }
    }
    if (pick < 0 || !isfinite(best)) return -1;
    out[r] = pick;
  }
  return 0;
}

int ss_simd(void) { return SS_AVX2; }

/* Outputs per tile where this build multiplies int8 activations in tiles (the _TILES kinds:
 * 16 with VNNI-512, 8 with AVX2, which tiles Q4_1 only), or 0 where it has none. */
int ss_a8_tiles(void) {
#if SS_AVX2
  return A8_TILE;
#else
  return 0;
#endif
}

/* 1 where this build has Q8_0 tiles too (VNNI-512). */
int ss_a8_q8_tiles(void) { return SS_VNNI512; }

/* The K/V conversions alone, for tests: n floats to halves as a K/V store rounds them, and n
 * halves to floats as attention reads them. */
int ss_store_half(const float *src, int n, uint16_t *dst) {
  store_half(dst, src, n);
  return 0;
}

int ss_load_half(const uint16_t *src, int n, float *dst) {
  int i = 0;
#if SS_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src, (size_t)i, 1));
#endif
  for (; i < n; i++) dst[i] = half_to_float(src[i]);
  return 0;
}
