/* The per-token work between a layer's GEMMs, fused, float32, AVX2 + FMA.
 *
 * Each function reproduces the rounding of the torch expression it replaces where that is
 * cheap (RMSNorm's and RoPE's products and sums are separate roundings, as in HF; the file is
 * built with -ffp-contract=off so the compiler does not fuse them), and otherwise differs
 * only in summation order or in an ulp of exp.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

/* y = w * (x * rsqrt(mean(x^2) + eps)) per row, as HF's LlamaRMSNorm computes it in float32. */
void kvserve_rms_norm_f32(const float *x, const float *w, float *y, long rows, long dim, float eps,
                          int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= 65536)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        __m256 acc = _mm256_setzero_ps();
        long d = 0;
        for (; d + 8 <= dim; d += 8) {
            __m256 v = _mm256_loadu_ps(xr + d);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        float lanes[8], ss = 0.0f;
        _mm256_storeu_ps(lanes, acc);
        for (int i = 0; i < 8; i++) ss += lanes[i];
        for (; d < dim; d++) ss += xr[d] * xr[d];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (d = 0; d < dim; d++) yr[d] = w[d] * (xr[d] * inv);
    }
}

/* out[r, :] = silu(gu[r, :I]) * gu[r, I:] with silu(g) = g / (1 + exp(-g)); gu: (rows, 2I). */
void kvserve_silu_and_mul_f32(const float *gu, float *out, long rows, long inter, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= 65536)
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        long i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate q and k of a packed qkv projection in place (HF Llama's half-split layout:
 * x * cos + rotate_half(x) * sin), then write k and v into the paged caches at their slots.
 *   qkv: (T, (H + 2 KVH) * D);  cos, sin: (max positions, D);  positions, slots: (T,)
 *   k_cache, v_cache: (num_blocks * block_size, KVH, D) viewed flat by slot. */
void kvserve_rope_write_kv_f32(float *qkv, const float *cos_t, const float *sin_t, const int64_t *positions,
                               const int64_t *slots, float *k_cache, float *v_cache,
                               long T, long H, long KVH, long D, int num_threads) {
    long half = D / 2, width = (H + 2 * KVH) * D;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (T * width >= 65536)
    for (long t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        for (long h = 0; h < H + KVH; h++) {  /* q heads, then k heads */
            float *x = row + h * D;
            for (long i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                float lo = a * c[i], lo_rot = (-b) * s[i];
                float hi = b * c[i + half], hi_rot = a * s[i + half];
                x[i] = lo + lo_rot;
                x[i + half] = hi + hi_rot;
            }
        }
        float *k_dst = k_cache + slots[t] * KVH * D, *v_dst = v_cache + slots[t] * KVH * D;
        const float *k = row + H * D, *v = row + (H + KVH) * D;
        for (long i = 0; i < KVH * D; i++) { k_dst[i] = k[i]; v_dst[i] = v[i]; }
    }
}
