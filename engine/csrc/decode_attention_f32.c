/* Decode attention straight from the paged KV cache, float32, AVX2 + FMA.
 *
 * One query token per sequence attends to its first ctx_len cached tokens, read block by block
 * through its block table: no gather into a contiguous copy, no padding, no mask.
 *
 *   q:        (B, H, D)                      out: (B, H, D)
 *   k_cache:  (num_blocks, block_size, KVH, D), v_cache the same
 *   tables:   (B, max_blocks) int64 block ids;  ctx_lens: (B,) int64
 *
 * Work item = (sequence, kv head): its G = H / KVH query heads share every K/V row loaded.
 * Softmax in two passes over a per-item score buffer: scores and their max, then exp, sum and
 * the weighted V sum, normalised once at the end.
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

static void one_item(const float *q, const float *kc, const float *vc, const int64_t *table, long ctx,
                     float *out, long G, long KVH, long D, long bs, float scale, float *scores) {
    long row_stride = KVH * D, block_stride = bs * row_stride;
    for (long t = 0; t < ctx; t++) {
        const float *k = kc + table[t / bs] * block_stride + (t % bs) * row_stride;
        for (long g = 0; g < G; g++) {
            const float *qg = q + g * D;
            __m256 acc = _mm256_setzero_ps();
            for (long d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), acc);
            scores[g * ctx + t] = hsum(acc) * scale;
        }
    }
    for (long g = 0; g < G; g++) softmax_inplace(scores + g * ctx, ctx);
    for (long g = 0; g < G; g++)
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(out + g * D + d, _mm256_setzero_ps());
    for (long t = 0; t < ctx; t++) {
        const float *v = vc + table[t / bs] * block_stride + (t % bs) * row_stride;
        for (long g = 0; g < G; g++) {
            __m256 p = _mm256_set1_ps(scores[g * ctx + t]);
            float *og = out + g * D;
            for (long d = 0; d < D; d += 8)
                _mm256_storeu_ps(og + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), _mm256_loadu_ps(og + d)));
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
        float *scores = malloc(sizeof(float) * (G * max_ctx + 1));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < B * KVH; item++) {
            if (!scores) continue;
            long b = item / KVH, h = item % KVH;
            one_item(q + (b * H + h * G) * D, k_cache + h * D, v_cache + h * D, tables + b * max_blocks, ctx_lens[b],
                     out + (b * H + h * G) * D, G, KVH, D, block_size, scale, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
