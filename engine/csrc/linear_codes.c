/* y = x W^T with W held in blocks of 32 integer codes along k: w = scale * q + offset, rounded
 * once after the product and once after the sum, exactly as a GGUF Q4_1 / Q8_0 tensor is
 * dequantized to float32 (gguf-py, which transformers uses); or with W held as bfloat16, the
 * float32 weights of a bfloat16 checkpoint (w's bits = code << 16).
 *
 * A decode step streams every weight once, so on CPU its GEMMs are bound by memory traffic; these
 * codes are 0.75 (4-bit) or 1.25 (8-bit) bytes a weight against 4 for float32. Each thread
 * dequantizes NB rows of W at a time into a small float32 scratch that stays in L1, then runs the
 * same register tile as the float32 kernel over it: for weights that the codes reproduce bit for
 * bit, y is bit-identical to kvserve_linear_f32's.
 *
 *   codes  4 bits: (N, K/2) bytes; in each 32-block of a row, byte j holds q[j] in its low nibble
 *                  and q[j + 16] in its high nibble (GGUF's order); q in [0, 15]
 *          8 bits: (N, K) signed bytes
 *         16 bits: (N, K) bfloat16, the weights' high halves
 *   scale, offset: (N, K/32) float32 (offset -0.0 for a pure scale: adding it changes no bits);
 *                  not read for 16 bits
 */
#include <stdint.h>
#include <stdlib.h>

#include "linear_tile.h"

static inline void store_block(float *out, __m256i q, __m256 d, __m256 m) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m));
}

/* Rows [n, n + nb) of W, dequantized into out (nb x K floats). */
static void dequantize_rows(const uint8_t *codes, const float *scale, const float *offset, int bits, long K, long n,
                            int nb, float *out) {
    long blocks = K / 32, row_bytes = bits == 4 ? K / 2 : bits == 8 ? K : 2 * K;
    for (int j = 0; j < nb; j++) {
        const uint8_t *c = codes + (n + j) * row_bytes;
        if (bits == 16) {  /* widen each half to 32 bits, then shift it into the high half */
            for (long i = 0; i < K; i += 8) {
                __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(c + 2 * i)));
                _mm256_storeu_ps(out + j * K + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
            }
            continue;
        }
        const float *s = scale + (n + j) * blocks, *o = offset + (n + j) * blocks;
        float *w = out + j * K;
        for (long b = 0; b < blocks; b++, w += 32) {
            __m256 d = _mm256_set1_ps(s[b]), m = _mm256_set1_ps(o[b]);
            if (bits == 4) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(c + b * 16)), mask = _mm_set1_epi8(0x0F);
                __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                store_block(w, _mm256_cvtepu8_epi32(lo), d, m);
                store_block(w + 8, _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), d, m);
                store_block(w + 16, _mm256_cvtepu8_epi32(hi), d, m);
                store_block(w + 24, _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), d, m);
            } else {
                for (int i = 0; i < 4; i++)
                    store_block(w + 8 * i, _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + b * 32 + 8 * i))),
                                d, m);
            }
        }
    }
}

/* Returns 0; -1 when K is not a multiple of 32 or bits is not 4, 8 or 16 (the caller falls back
 * to torch), -2 when a thread's scratch cannot be allocated. */
int kvserve_linear_codes_f32(const float *x, const uint8_t *codes, const float *scale, const float *offset, int bits,
                              float *y, long M, long N, long K, int num_threads) {
    if (K % 32 || (bits != 4 && bits != 8 && bits != 16)) return -1;
    long blocks = (N + NB - 1) / NB;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, (size_t)(NB * K * sizeof(float) + 63) / 64 * 64);
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(guided, 16)
        for (long b = 0; b < blocks; b++) {
            if (!scratch) continue;
            long n = b * NB;
            int nb = N - n < NB ? (int)(N - n) : NB;
            dequantize_rows(codes, scale, offset, bits, K, n, nb, scratch);
            column_block(x, scratch, scratch, y + n, M, N, K, nb);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}
