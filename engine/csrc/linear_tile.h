/* The register tile shared by the float32 and the packed GEMM kernels: y[m, n] = x[m, :] . w[n, :]
 * computed by one fixed sequence of operations (8 lane sums over k in order, then one horizontal
 * sum), so that both kernels give the same bits for the same weights. */
#pragma once

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
    case (MR) * 8 + (NR): tile(x + m * K, w, y + m * ldy, K, ldy, MR, NR, next_w); break;

/* Rows [0, M) of x against the nb <= NB rows of W at w (row stride K) into y (row stride ldy);
 * next_w: rows to prefetch for the next call. */
static void column_block(const float *x, const float *w, const float *next_w, float *y, long M, long ldy, long K,
                         int nb) {
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
