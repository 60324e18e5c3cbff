/* y = x W^T for float32 on AVX2 + FMA CPUs, tuned for the few rows of a decode step.
 *
 * x: (M, K) rows, W: (N, K) as nn.Linear stores it, y: (M, N); all contiguous, K % 8 == 0.
 * A decode step's GEMMs have M = running sequences (1..~64) against weights that do not fit in
 * cache, so they are bound by streaming W once. MKL's sgemm repacks W on every call; this reads
 * W in place: each tile keeps MB x NB dot products in registers while 8 lanes of k stream by,
 * and prefetches the next tile's rows of W.
 *
 * Every y[m, n] is computed by the same sequence of operations (8 lane sums over k in order,
 * then one fixed horizontal sum) whatever M, N or the tile it falls in, so a sequence's
 * logits do not depend on which other sequences share its batch.
 */
#include <immintrin.h>

#include "vec_math.h"

#define MB 4 /* rows of x per tile */
#define NB 3 /* rows of W per tile: MB * NB accumulators + NB weights + 1 input = 16 ymm */

/* One tile: rows [0, mb) of x against rows [0, nb) of w; mb <= MB, nb <= NB are compile-time
 * constants at every call site, so the loops unroll and acc stays in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y, long K,
                                                       long ldy, int mb, int nb, const float *next_w) {
    __m256 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8) {
        __m256 wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
        if ((k & 15) == 0)
            for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(next_w + j * K + k), _MM_HINT_T0);
        for (int i = 0; i < mb; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) y[i * ldy + j] = hsum(acc[i][j]);
}

#define TILE_CASE(MR, NR) \
    case (MR) * 8 + (NR): tile(x + m * K, w + n * K, y + m * N + n, K, N, MR, NR, next_w); break;

static void column_block(const float *x, const float *w, float *y, long M, long N, long K, long n) {
    int nb = N - n < NB ? (int)(N - n) : NB;
    /* The next block's rows, or this one's again at the end of W: a prefetch never leaves W. */
    const float *next_w = w + (n + NB + NB <= N ? n + NB : n) * K;
    for (long m = 0; m < M; m += MB) {
        int mb = M - m < MB ? (int)(M - m) : MB;
        switch (mb * 8 + nb) {
            TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
            TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
            TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
            TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
        }
    }
}

/* Returns 0, or -1 when K is not a multiple of 8 (the caller falls back to torch). */
int kvserve_linear_f32(const float *x, const float *w, float *y, long M, long N, long K, int num_threads) {
    if (K % 8) return -1;
    long blocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
    for (long b = 0; b < blocks; b++) column_block(x, w, y, M, N, K, b * NB);
    return 0;
}
