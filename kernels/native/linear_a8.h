/* Matrix x vector with int8 activations: the `native-a8` build's matrices.
 *
 * Why: with fp32 activations every weight is widened to a float and multiplied on its own, so
 * a batch-1 step on two cores was bound by instructions, not by the bytes it reads. Quantizing
 * each row's input once per matrix to int8 (per 32 elements, symmetric, like the weights'
 * own blocks) turns the inner loop into integer dot products of 4 byte pairs per lane
 * (AVX512-VNNI `vpdpbusd`; AVX2 `vpmaddubsw`), ~3.5x fewer instructions per weight. The
 * products are then no longer the fp32 build's: this is a lossy build with a quality-gate
 * report of its own (shared/quality/reports).
 *
 * Every integer dot is exact; a row's result is the same sequence of float operations
 * whatever rows share the call, so batching never changes a sequence's output.
 *
 * Layouts (repacked once at load, shared/model/native_step.py):
 * - Q4_1_A8: the file's nibbles regrouped per 4 blocks (128 elements, 64 bytes): byte k holds
 *   element k in its low nibble and element 64 + k in its high one, so two masks give two
 *   runs of 64 elements in order. A trailing pair of blocks (32 bytes) holds element k low and
 *   32 + k high; a trailing single block keeps the file's layout (k low, 16 + k high).
 *   Scales and mins as fp32 [out, blocks].
 * - Q8_0_A8: the file's int8 quants; `mins` holds -128 * d * sum(q) per block, the correction
 *   for VNNI's unsigned-times-signed product of (x_q + 128) and q.
 */

/* One row set's inputs, quantized: q [rows, in] int8, qu = q + 128 as uint8 (VNNI's unsigned
 * operand), d [rows, nb] scales, dx [rows, nb * 8] each scale repeated 8 times (one 256-bit
 * lane group per block, so two blocks' scales load as one 512-bit vector), s [rows, nb] = d *
 * sum(q) (the Q4_1 mins' partner). */
typedef struct {
  int8_t *q;
  uint8_t *qu;
  float *d, *dx, *s;
  int in;
} ss_acts;

static size_t acts_bytes(int rows, int in) {
  int nb = in / QK;
  return (size_t)rows * ((size_t)in * 2 + (size_t)nb * 10 * sizeof(float)) + 64;
}

/* Carve an ss_acts out of `mem` (acts_bytes(rows, in) bytes). */
static ss_acts acts_view(void *mem, int rows, int in) {
  int nb = in / QK;
  ss_acts a;
  float *f = (float *)mem;
  a.d = f;
  a.dx = a.d + (size_t)rows * nb;
  a.s = a.dx + (size_t)rows * nb * 8;
  a.q = (int8_t *)(a.s + (size_t)rows * nb);
  a.qu = (uint8_t *)(a.q + (size_t)rows * in);
  a.in = in;
  return a;
}

/* One block's scale and int8 values: d = max|x| / 127, q = x / d rounded to nearest even. Every
 * path computes the same values (x * (1/d), the same rounding), so a build quantizes alike
 * whatever its vector width. */
static void quantize_block(const float *xb, int8_t *q, uint8_t *qu, float *d_out, int *sum_out) {
#if SS_AVX512
  __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  __m512 vid = _mm512_set1_ps(id);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), lo), hi);
  __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid)), lo), hi);
  __m128i b0 = _mm512_cvtepi32_epi8(q0), b1 = _mm512_cvtepi32_epi8(q1);
  _mm_storeu_si128((__m128i *)q, b0);
  _mm_storeu_si128((__m128i *)(q + 16), b1);
  const __m128i flip = _mm_set1_epi8((char)0x80);
  _mm_storeu_si128((__m128i *)qu, _mm_xor_si128(b0, flip));
  _mm_storeu_si128((__m128i *)(qu + 16), _mm_xor_si128(b1, flip));
  *sum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  *d_out = d;
#elif SS_AVX2
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                            _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float d = _mm_cvtss_f32(m4) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  __m256 vid = _mm256_set1_ps(id);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i qi[4];
  for (int i = 0; i < 4; i++)
    qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid)), lo), hi);
  /* Packing interleaves 128-bit lanes; the permute puts the 32 bytes back in order. */
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i *)q, bytes);
  _mm256_storeu_si256((__m256i *)qu, _mm256_xor_si256(bytes, _mm256_set1_epi8((char)0x80)));
  __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  *sum_out = _mm_cvtsi128_si32(s4);
  *d_out = d;
#else
  float amax = 0.f;
  for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
  float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int j = 0; j < QK; j++) {
    int v = (int)lrintf(xb[j] * id);
    v = v > 127 ? 127 : (v < -127 ? -127 : v);
    q[j] = (int8_t)v;
    qu[j] = (uint8_t)(v + 128);
    sum += v;
  }
  *sum_out = sum;
  *d_out = d;
#endif
}

/* Blocks [b0, b1) of the rows' flattened block list: the threads split the work. */
static void quantize_rows_part(const float *x, int rows, int in, ss_acts *a, int b0, int b1) {
  int nb = in / QK;
  for (int i = b0; i < b1 && i < rows * nb; i++) {
    int r = i / nb, b = i % nb, sum;
    size_t at = (size_t)r * in + (size_t)b * QK;
    float d;
    quantize_block(x + at, a->q + at, a->qu + at, &d, &sum);
    a->d[i] = d;
    a->s[i] = d * (float)sum;
    for (int j = 0; j < 8; j++) a->dx[(size_t)i * 8 + j] = d;
  }
}

/* The integer dot of one Q4_1_A8 block that sits alone at the end (file layout). */
static inline int idot_q4_single(const uint8_t *w, const int8_t *q) {
  int t = 0;
  for (int j = 0; j < 16; j++) t += (w[j] & 0x0f) * q[j] + (w[j] >> 4) * q[j + 16];
  return t;
}

static inline int idot_q8(const int8_t *w, const int8_t *q) {
  int t = 0;
  for (int j = 0; j < QK; j++) t += w[j] * q[j];
  return t;
}

#if SS_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SS_VNNI512 1
#else
#define SS_VNNI512 0
#endif
/* Rows that share one decoding of a weight block: 8 keeps a batch-8 step to one pass over the
 * weights and fits AVX-512's 32 registers; AVX2's 16 hold 4. */
#if SS_VNNI512
#define A8_ROWS 8
#else
#define A8_ROWS 4
#endif

/* Rows of a matrix are short loops (one output each), so the loads of the rows a few outputs
 * ahead are issued early: the weights stream from memory every step. */
#define A8_AHEAD 6

static inline void prefetch_bytes(const void *p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

static void linear_q4_1_a8(const ss_linear *w, const ss_acts *a, int rows, float *y, int o0, int o1) {
  int in = w->in_features, out = w->out_features, nb = in / QK;
  int groups = nb / 4, pair = (nb % 4) >= 2, single = nb % 2;
  const uint8_t *quants = (const uint8_t *)w->data;
  for (int r0 = 0; r0 < rows; r0 += A8_ROWS) {
    int nr = rows - r0 < A8_ROWS ? rows - r0 : A8_ROWS;
    for (int o = o0; o < o1; o++) {
      const uint8_t *qs = quants + (size_t)o * nb * Q4_1_QBYTES;
      const float *ds = w->scales + (size_t)o * nb, *ms = w->mins + (size_t)o * nb;
      if (o + A8_AHEAD < o1) {
        prefetch_bytes(qs + (size_t)A8_AHEAD * nb * Q4_1_QBYTES, (size_t)nb * Q4_1_QBYTES);
        prefetch_bytes(ds + (size_t)A8_AHEAD * nb, sizeof(float) * (size_t)nb);
        prefetch_bytes(ms + (size_t)A8_AHEAD * nb, sizeof(float) * (size_t)nb);
      }
      float tail[A8_ROWS] = {0.f};
#if SS_VNNI512
      const __m512i low = _mm512_set1_epi8(0x0f);
      const __m512i idx_lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      const __m512i idx_hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
      __m512 acc[A8_ROWS];
      for (int r = 0; r < A8_ROWS; r++) acc[r] = _mm512_setzero_ps();
      for (int g = 0; g < groups; g++) {
        __m512i raw = _mm512_loadu_si512((const void *)(qs + (size_t)g * 64));
        __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        __m512 d4 = _mm512_castps128_ps512(_mm_loadu_ps(ds + 4 * g));
        __m512 dlo = _mm512_permutexvar_ps(idx_lo, d4), dhi = _mm512_permutexvar_ps(idx_hi, d4);
        for (int r = 0; r < nr; r++) {
          const int8_t *q = a->q + (size_t)(r0 + r) * in + (size_t)g * 128;
          const float *dx = a->dx + ((size_t)(r0 + r) * nb + 4 * g) * 8;
          __m512i plo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)q));
          __m512i phi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512((const void *)(q + 64)));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(plo), _mm512_mul_ps(dlo, _mm512_loadu_ps(dx)), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(phi), _mm512_mul_ps(dhi, _mm512_loadu_ps(dx + 16)), acc[r]);
        }
      }
      if (pair) {
        int b = 4 * groups;
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + (size_t)b * Q4_1_QBYTES));
        const __m256i low8 = _mm256_set1_epi8(0x0f);
        __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, low8)),
                                       _mm256_and_si256(_mm256_srli_epi16(raw, 4), low8), 1);
        __m512 d2 = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(ds + b))));
        __m512 dlo = _mm512_permutexvar_ps(idx_lo, d2);
        for (int r = 0; r < nr; r++) {
          const int8_t *q = a->q + (size_t)(r0 + r) * in + (size_t)b * QK;
          const float *dx = a->dx + ((size_t)(r0 + r) * nb + b) * 8;
          __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512((const void *)q));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dlo, _mm512_loadu_ps(dx)), acc[r]);
        }
      }
      float sums[A8_ROWS];
      for (int r = 0; r < nr; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
#elif SS_AVX2
      const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
      __m256 acc[A8_ROWS];
      for (int r = 0; r < A8_ROWS; r++) acc[r] = _mm256_setzero_ps();
      /* One block's 32 weights (w, in order) against each row's 32 quantized inputs. */
#define SS_Q4_BLOCK(wv, b)                                                                          \
  do {                                                                                              \
    for (int r = 0; r < nr; r++) {                                                                  \
      const int8_t *q = a->q + (size_t)(r0 + r) * in + (size_t)(b) * QK;                            \
      __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16((wv), _mm256_loadu_si256((const __m256i *)q)), ones); \
      __m256 sc = _mm256_set1_ps(ds[(b)] * a->d[(size_t)(r0 + r) * nb + (b)]);                     \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[r]);                                  \
    }                                                                                               \
  } while (0)
      for (int g = 0; g < groups; g++) {
        __m256i raw0 = _mm256_loadu_si256((const __m256i *)(qs + (size_t)g * 64));
        __m256i raw1 = _mm256_loadu_si256((const __m256i *)(qs + (size_t)g * 64 + 32));
        int b = 4 * g;
        SS_Q4_BLOCK(_mm256_and_si256(raw0, low), b);
        SS_Q4_BLOCK(_mm256_and_si256(raw1, low), b + 1);
        SS_Q4_BLOCK(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), low), b + 2);
        SS_Q4_BLOCK(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), low), b + 3);
      }
      if (pair) {
        int b = 4 * groups;
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + (size_t)b * Q4_1_QBYTES));
        SS_Q4_BLOCK(_mm256_and_si256(raw, low), b);
        SS_Q4_BLOCK(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), b + 1);
      }
#undef SS_Q4_BLOCK
      float sums[A8_ROWS];
      for (int r = 0; r < nr; r++) sums[r] = hsum8(acc[r]);
#else
      float sums[A8_ROWS] = {0.f};
      for (int r = 0; r < nr; r++) {
        const int8_t *q = a->q + (size_t)(r0 + r) * in;
        const float *d = a->d + (size_t)(r0 + r) * nb;
        for (int g = 0; g < groups; g++) {
          const uint8_t *wg = qs + (size_t)g * 64;
          for (int k = 0; k < 2; k++) { /* low run: blocks 4g, 4g+1; high run: 4g+2, 4g+3 */
            for (int h = 0; h < 2; h++) {
              int t = 0, b = 4 * g + 2 * k + h;
              for (int j = 0; j < QK; j++) {
                uint8_t byte = wg[h * QK + j];
                t += (k ? byte >> 4 : byte & 0x0f) * q[(size_t)b * QK + j];
              }
              sums[r] += ds[b] * d[b] * (float)t;
            }
          }
        }
        if (pair) {
          int b = 4 * groups;
          const uint8_t *wp = qs + (size_t)b * Q4_1_QBYTES;
          int t0 = 0, t1 = 0;
          for (int j = 0; j < QK; j++) {
            t0 += (wp[j] & 0x0f) * q[(size_t)b * QK + j];
            t1 += (wp[j] >> 4) * q[(size_t)(b + 1) * QK + j];
          }
          sums[r] += ds[b] * d[b] * (float)t0;
          sums[r] += ds[b + 1] * d[b + 1] * (float)t1;
        }
      }
#endif
      for (int r = 0; r < nr; r++) {
        size_t row = (size_t)(r0 + r);
        if (single) {
          int b = nb - 1;
          int t = idot_q4_single(qs + (size_t)b * Q4_1_QBYTES, a->q + row * in + (size_t)b * QK);
          tail[r] = ds[b] * a->d[row * nb + b] * (float)t;
        }
        y[row * out + o] = sums[r] + tail[r] + dot_f32(ms, a->s + row * nb, nb);
      }
    }
  }
}

static void linear_q8_0_a8(const ss_linear *w, const ss_acts *a, int rows, float *y, int o0, int o1) {
  int in = w->in_features, out = w->out_features, nb = in / QK;
  const int8_t *quants = (const int8_t *)w->data;
  for (int r0 = 0; r0 < rows; r0 += A8_ROWS) {
    int nr = rows - r0 < A8_ROWS ? rows - r0 : A8_ROWS;
    for (int o = o0; o < o1; o++) {
      const int8_t *qs = quants + (size_t)o * nb * Q8_0_QBYTES;
      const float *ds = w->scales + (size_t)o * nb;
      if (o + A8_AHEAD < o1) {
        prefetch_bytes(qs + (size_t)A8_AHEAD * nb * Q8_0_QBYTES, (size_t)nb * Q8_0_QBYTES);
        prefetch_bytes(ds + (size_t)A8_AHEAD * nb, sizeof(float) * (size_t)nb);
        prefetch_bytes(w->mins + (size_t)(o + A8_AHEAD) * nb, sizeof(float) * (size_t)nb);
      }
#if SS_VNNI512
      /* (x_q + 128) . w, then the per-block -128 * d * sum(w) correction (in `mins`). */
      const __m512i idx_lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      const float *cs = w->mins + (size_t)o * nb;
      __m512 acc[A8_ROWS];
      for (int r = 0; r < A8_ROWS; r++) acc[r] = _mm512_setzero_ps();
      int b = 0;
      for (; b + 2 <= nb; b += 2) {
        __m512i wv = _mm512_loadu_si512((const void *)(qs + (size_t)b * QK));
        __m512 d2 = _mm512_permutexvar_ps(idx_lo, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(ds + b)))));
        for (int r = 0; r < nr; r++) {
          const uint8_t *qu = a->qu + (size_t)(r0 + r) * in + (size_t)b * QK;
          const float *dx = a->dx + ((size_t)(r0 + r) * nb + b) * 8;
          __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512((const void *)qu), wv);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d2, _mm512_loadu_ps(dx)), acc[r]);
        }
      }
      for (int r = 0; r < nr; r++) {
        size_t row = (size_t)(r0 + r);
        float t = _mm512_reduce_add_ps(acc[r]);
        if (b < nb) t += ds[b] * a->d[row * nb + b] * (float)idot_q8(qs + (size_t)b * QK, a->q + row * in + (size_t)b * QK);
        /* The correction covers the blocks VNNI summed, not the exact trailing one. */
        y[row * out + o] = t + dot_f32(cs, a->d + row * nb, b);
      }
#elif SS_AVX2
      const __m256i ones = _mm256_set1_epi16(1);
      __m256 acc[A8_ROWS];
      for (int r = 0; r < A8_ROWS; r++) acc[r] = _mm256_setzero_ps();
      for (int b = 0; b < nb; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(qs + (size_t)b * QK));
        __m256i wabs = _mm256_sign_epi8(wv, wv);
        for (int r = 0; r < nr; r++) {
          const int8_t *q = a->q + (size_t)(r0 + r) * in + (size_t)b * QK;
          __m256i qs_ = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)q), wv);
          __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, qs_), ones);
          __m256 sc = _mm256_set1_ps(ds[b] * a->d[(size_t)(r0 + r) * nb + b]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[r]);
        }
      }
      for (int r = 0; r < nr; r++) y[(size_t)(r0 + r) * out + o] = hsum8(acc[r]);
#else
      for (int r = 0; r < nr; r++) {
        size_t row = (size_t)(r0 + r);
        float t = 0.f;
        for (int b = 0; b < nb; b++)
          t += ds[b] * a->d[row * nb + b] * (float)idot_q8(qs + (size_t)b * QK, a->q + row * in + (size_t)b * QK);
        y[row * out + o] = t;
      }
#endif
    }
  }
}

#if SS_VNNI512
/* ---------------------------------------------------------------- 16-output tiles
 *
 * Why: with one output's weights along a vector, every 64 weights of a row cost a VNNI dot,
 * a conversion, a scale multiply and an FMA, and a lane reduction at the end: a batch-8 step
 * and every prefill chunk were bound by those instructions, not by bytes. With sixteen
 * outputs side by side (4 bytes each per vector), one broadcast 4-byte run of the input
 * multiplies a whole vector: a block's 32 inputs are 8 `vpdpbusd` into sixteen outputs'
 * integer sums, then one conversion and two FMAs apply the block's scales, and nothing is
 * left to reduce (about 2.7x fewer instructions per weight and row).
 *
 * Layout per tile of 16 outputs and per block, contiguous (repacked at load,
 * shared/model/native_step.py); outputs are padded to a multiple of 16 with zero blocks:
 * - Q4_1 (320 bytes, the file's 20 per output-block): 4 x 64 bytes where vector v, lane i,
 *   byte c is the file's quant byte 4v + c of output i (low nibble element 4v + c, high
 *   nibble 16 + 4v + c), then the 16 outputs' fp16 scales and fp16 mins as in the file.
 * - Q8_0 (576 bytes, the file's 34 plus a 2-byte sum): 8 x 64 bytes where vector v, lane i,
 *   byte c is element 4v + c of output i, then 16 fp16 scales, then 16 int16 sums of the
 *   block's quants (for VNNI's unsigned-input correction, -128 * d * sum, applied per row).
 * The scales stay fp16, as in the file: converting 16 of them is one instruction shared by
 * the row group, and the step reads a sixth fewer bytes than with fp32 copies. */
#define A8_TILE 16
#define Q4_1_TILE_BYTES (4 * 64 + 2 * 32)
#define Q8_0_TILE_BYTES (8 * 64 + 2 * 32)
/* Blocks ahead whose bytes are requested early: the first row group streams the weights. */
#define A8_TILE_AHEAD 4

static inline __m512i bcast4(const void *p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

static inline void store_tile(float *y, __m512 v, int valid) {
  _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1), v);
}

/* Outputs [o0, o1): o0 is a multiple of A8_TILE, and so is o1 unless it is out_features. */
static void linear_q4_1_a8_tiles(const ss_linear *w, const ss_acts *a, int rows, float *y, int o0, int o1) {
  int in = w->in_features, out = w->out_features, nb = in / QK;
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int t = o0; t < o1; t += A8_TILE) {
    const uint8_t *tile = (const uint8_t *)w->data + (size_t)(t / A8_TILE) * nb * Q4_1_TILE_BYTES;
    int valid = out - t < A8_TILE ? out - t : A8_TILE;
    for (int r0 = 0; r0 < rows; r0 += A8_ROWS) {
      int nr = rows - r0 < A8_ROWS ? rows - r0 : A8_ROWS;
      __m512 acc[A8_ROWS];
      for (int r = 0; r < A8_ROWS; r++) acc[r] = _mm512_setzero_ps();
      for (int b = 0; b < nb; b++) {
        const uint8_t *p = tile + (size_t)b * Q4_1_TILE_BYTES;
        if (r0 == 0) prefetch_bytes(p + A8_TILE_AHEAD * Q4_1_TILE_BYTES, Q4_1_TILE_BYTES);
        __m512i wv[8];
        for (int v = 0; v < 4; v++) {
          __m512i raw = _mm512_loadu_si512((const void *)(p + 64 * v));
          wv[v] = _mm512_and_si512(raw, low);
          wv[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        for (int r = 0; r < A8_ROWS; r++) {
          if (r >= nr) break;
          size_t at = (size_t)(r0 + r) * nb + b;
          const int8_t *xq = a->q + at * QK;
          __m512i s = _mm512_setzero_si512();
          for (int v = 0; v < 8; v++) s = _mm512_dpbusd_epi32(s, wv[v], bcast4(xq + 4 * v));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a->d[at])), acc[r]);
          acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[at]), acc[r]);
        }
      }
      for (int r = 0; r < nr; r++) store_tile(y + (size_t)(r0 + r) * out + t, acc[r], valid);
    }
  }
}

static void linear_q8_0_a8_tiles(const ss_linear *w, const ss_acts *a, int rows, float *y, int o0, int o1) {
  int in = w->in_features, out = w->out_features, nb = in / QK;
  for (int t = o0; t < o1; t += A8_TILE) {
    const uint8_t *tile = (const uint8_t *)w->data + (size_t)(t / A8_TILE) * nb * Q8_0_TILE_BYTES;
    int valid = out - t < A8_TILE ? out - t : A8_TILE;
    for (int r0 = 0; r0 < rows; r0 += A8_ROWS) {
      int nr = rows - r0 < A8_ROWS ? rows - r0 : A8_ROWS;
      __m512 acc[A8_ROWS];
      for (int r = 0; r < A8_ROWS; r++) acc[r] = _mm512_setzero_ps();
      for (int b = 0; b < nb; b++) {
        const uint8_t *p = tile + (size_t)b * Q8_0_TILE_BYTES;
        if (r0 == 0) prefetch_bytes(p + A8_TILE_AHEAD * Q8_0_TILE_BYTES, Q8_0_TILE_BYTES);
        __m512i wv[8];
        for (int v = 0; v < 8; v++) wv[v] = _mm512_loadu_si512((const void *)(p + 64 * v));
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512)));
        __m512 sums = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(p + 544))));
        __m512 corr = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(-128.f)), sums);
        for (int r = 0; r < A8_ROWS; r++) {
          if (r >= nr) break;
          size_t at = (size_t)(r0 + r) * nb + b;
          const uint8_t *xu = a->qu + at * QK;
          __m512i s = _mm512_setzero_si512();
          for (int v = 0; v < 8; v++) s = _mm512_dpbusd_epi32(s, bcast4(xu + 4 * v), wv[v]);
          __m512 dx = _mm512_set1_ps(a->d[at]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[r]);
          acc[r] = _mm512_fmadd_ps(corr, dx, acc[r]);
        }
      }
      for (int r = 0; r < nr; r++) store_tile(y + (size_t)(r0 + r) * out + t, acc[r], valid);
    }
  }
}
#endif

#if SS_AVX2 && !SS_VNNI512
/* ---------------------------------------------------------------- 8-output tiles (AVX2)
 *
 * The same idea on 256-bit vectors without VNNI: eight outputs side by side, one broadcast
 * 4-byte run of the input per `vpmaddubsw`. A block's eight products fit int16 exactly
 * (|w| <= 15, |x| <= 127: each pair <= 3,810, eight of them <= 30,480), so they are summed
 * in 16 bits and widened once, where the row-major path widened every block of every output.
 * Layout per tile of 8 outputs and per block (160 bytes, the file's 20 per output-block):
 * 4 x 32 bytes where vector v, lane i, byte c is the file's quant byte 4v + c of output i,
 * then 8 fp16 scales and 8 fp16 mins. Q4_1 only: this build's Q8_0 stays row-major (in the
 * bundled model only the head is Q8_0, and it takes fp32 activations). */
#define A8_TILE 8
#define Q4_1_TILE_BYTES (4 * 32 + 2 * 16)
/* Blocks ahead whose bytes are requested early: the first row group streams the weights. */
#define A8_TILE_AHEAD 4

static inline __m256i bcast4(const void *p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

static void linear_q4_1_a8_tiles(const ss_linear *w, const ss_acts *a, int rows, float *y, int o0, int o1) {
  int in = w->in_features, out = w->out_features, nb = in / QK;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int t = o0; t < o1; t += A8_TILE) {
    const uint8_t *tile = (const uint8_t *)w->data + (size_t)(t / A8_TILE) * nb * Q4_1_TILE_BYTES;
    int valid = out - t < A8_TILE ? out - t : A8_TILE;
    for (int r0 = 0; r0 < rows; r0 += A8_ROWS) {
      int nr = rows - r0 < A8_ROWS ? rows - r0 : A8_ROWS;
      __m256 acc[A8_ROWS];
      for (int r = 0; r < A8_ROWS; r++) acc[r] = _mm256_setzero_ps();
      for (int b = 0; b < nb; b++) {
        const uint8_t *p = tile + (size_t)b * Q4_1_TILE_BYTES;
        if (r0 == 0) prefetch_bytes(p + A8_TILE_AHEAD * Q4_1_TILE_BYTES, Q4_1_TILE_BYTES);
        __m256i s16[A8_ROWS];
        for (int r = 0; r < A8_ROWS; r++) s16[r] = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) {
          __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 32 * v));
          __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          for (int r = 0; r < A8_ROWS; r++) {
            if (r >= nr) break;
            const int8_t *xq = a->q + ((size_t)(r0 + r) * nb + b) * QK;
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, bcast4(xq + 4 * v)));
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * v)));
          }
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 128)));
        __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 144)));
        for (int r = 0; r < A8_ROWS; r++) {
          if (r >= nr) break;
          size_t at = (size_t)(r0 + r) * nb + b;
          __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));
          acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(a->d[at])), acc[r]);
          acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[at]), acc[r]);
        }
      }
      for (int r = 0; r < nr; r++) {
        float lanes[A8_TILE];
        _mm256_storeu_ps(lanes, acc[r]);
        memcpy(y + (size_t)(r0 + r) * out + t, lanes, sizeof(float) * (size_t)valid);
      }
    }
  }
}
#endif
