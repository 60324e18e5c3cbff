/* Decode attention straight from the paged KV cache, float32, AVX2 + FMA.
 *
 * One query token per sequence attends to its first ctx_len cached tokens, read block by block
 * through its block table: no gather into a contiguous copy, no padding, no mask.
 *
 *   q:        (B, H, D)                      out: (B, H, D)
 *   k_cache:  (num_blocks, block_size, KVH, D), v_cache the same
 *   tables:   (B, max_blocks) int64 block ids;  ctx_lens: (B,) int64
 *
 * Work item = one sequence, all of its heads: each cached token's KV heads are read as one
 * contiguous run, and the G = H / KVH query heads of a kv head share every K/V row loaded.
 * Softmax in two passes over a per-item score buffer: scores (8 tokens at a time) and their max,
 * then exp and sum, then the weighted V sum (CHUNK tokens at a time).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

static void softmax_inplace(float *s, long n) {
    float mx = -INFINITY;
    for (long t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    __m256 vmx = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    long t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    if (t < n) {
        float tail[8] = {0}, out[8];
        for (long i = t; i < n; i++) tail[i - t] = s[i] - mx;
        for (long i = n - t; i < 8; i++) tail[i] = -INFINITY;
        _mm256_storeu_ps(out, exp_ps(_mm256_loadu_ps(tail)));
        for (long i = t; i < n; i++) { s[i] = out[i - t]; sum += out[i - t]; }
    }
    float inv = 1.0f / sum;
    for (long i = 0; i < n; i++) s[i] *= inv;
}

/* The 8 lane sums of a0..a7, as the 8 lanes of one vector (lane j = sum of aj), in one fixed order. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

#define CHUNK 32 /* tokens whose V rows one pass of the output accumulators reads */

/* Where token t's row (of this item's kv head) starts in a K or V cache, through the block table. */
static inline long row_offset(const int64_t *table, long t, long bs, long block_stride, long row_stride) {
    return table[t / bs] * block_stride + (t % bs) * row_stride;
}

static void one_item(const float *q, const float *kc, const float *vc, const int64_t *table, long ctx,
                     float *out, long G, long KVH, long D, long bs, float scale, float *scores) {
    /* q, out: (KVH * G, D) for this sequence; kc, vc: the caches; scores: (KVH * G, ctx). All
     * KVH heads at once, so each cached token's KVH * D contiguous floats are read together. */
    long row_stride = KVH * D, block_stride = bs * row_stride;
    __m256 vscale = _mm256_set1_ps(scale);
    /* Scores, 8 tokens at a time: each (token, head) dot product is its own chain of D / 8 FMAs
     * (8 chains in flight), summed across lanes by one hsum8. Past the context's end the last
     * group re-reads token t0 and drops what it computed. */
    for (long t0 = 0; t0 < ctx; t0 += 8) {
        long nt = ctx - t0 < 8 ? ctx - t0 : 8;
        const float *k[8];
        for (long j = 0; j < 8; j++) {
            long t = t0 + (j < nt ? j : 0);
            long off = row_offset(table, t, bs, block_stride, row_stride);
            k[j] = kc + off;
            /* the rows the V pass will read, into L2 while the scores are computed; and the
             * next group's K rows */
            for (long d = 0; d < row_stride; d += 16) _mm_prefetch((const char *)(vc + off + d), _MM_HINT_T1);
            long tn = t + 8 < ctx ? t + 8 : t;
            const float *kn = kc + row_offset(table, tn, bs, block_stride, row_stride);
            for (long d = 0; d < row_stride; d += 16) _mm_prefetch((const char *)(kn + d), _MM_HINT_T0);
        }
        for (long g = 0; g < KVH * G; g++) {
            const float *qg = q + g * D;
            long kv_off = g / G * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (long d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(qg + d);
                long e = kv_off + d;
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + e), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + e), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + e), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + e), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + e), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + e), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + e), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + e), a7);
            }
            __m256 sv = _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale);
            float *dst = scores + g * ctx + t0;
            if (nt == 8) {
                _mm256_storeu_ps(dst, sv);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, sv);
                for (long j = 0; j < nt; j++) dst[j] = tmp[j];
            }
        }
    }
    for (long g = 0; g < KVH * G; g++) softmax_inplace(scores + g * ctx, ctx);
    for (long i = 0; i < KVH * G * D; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
    /* Weighted V sum, CHUNK tokens at a time: per head, 64 output lanes stay in registers while
     * the chunk's V rows (in cache after the first head) stream by. */
    for (long t0 = 0; t0 < ctx; t0 += CHUNK) {
        long nt = ctx - t0 < CHUNK ? ctx - t0 : CHUNK;
        const float *v[CHUNK];
        for (long j = 0; j < nt; j++) v[j] = vc + row_offset(table, t0 + j, bs, block_stride, row_stride);
        for (long g = 0; g < KVH * G; g++) {
            const float *p = scores + g * ctx + t0;
            float *og = out + g * D;
            long kv_off = g / G * D;
            long d0 = 0;
            for (; d0 + 64 <= D; d0 += 64) {
                __m256 o[8];
                for (int i = 0; i < 8; i++) o[i] = _mm256_loadu_ps(og + d0 + 8 * i);
                for (long j = 0; j < nt; j++) {
                    __m256 pj = _mm256_set1_ps(p[j]);
                    for (int i = 0; i < 8; i++)
                        o[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v[j] + kv_off + d0 + 8 * i), o[i]);
                }
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(og + d0 + 8 * i, o[i]);
            }
            for (; d0 < D; d0 += 8) { /* head dims that are not a multiple of 64 */
                __m256 o = _mm256_loadu_ps(og + d0);
                for (long j = 0; j < nt; j++)
                    o = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + kv_off + d0), o);
                _mm256_storeu_ps(og + d0, o);
            }
        }
    }
}

/* Returns 0, -1 when D is not a multiple of 8 or H not a multiple of KVH, -2 when out of memory. */
int kvserve_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                 const int64_t *tables, long max_blocks, const int64_t *ctx_lens, float *out,
                                 long B, long H, long KVH, long D, long block_size, float scale, int num_threads) {
    if (D % 8 || H % KVH) return -1;
    long G = H / KVH, max_ctx = 0;
    for (long b = 0; b < B; b++) max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (H * max_ctx + 1));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (long b = 0; b < B; b++) {
            if (!scores) continue;
            one_item(q + b * H * D, k_cache, v_cache, tables + b * max_blocks, ctx_lens[b], out + b * H * D, G, KVH, D,
                     block_size, scale, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
