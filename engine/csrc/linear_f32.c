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
#include "linear_tile.h"

/* Returns 0, or -1 when K is not a multiple of 8 (the caller falls back to torch). */
int kvserve_linear_f32(const float *x, const float *w, float *y, long M, long N, long K, int num_threads) {
    if (K % 8) return -1;
    long blocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(guided, 16) num_threads(num_threads)
    for (long b = 0; b < blocks; b++) {
        long n = b * NB;
        int nb = N - n < NB ? (int)(N - n) : NB;
        /* The next block's rows, or this one's again at the end of W: a prefetch never leaves W. */
        const float *next_w = w + (n + NB + NB <= N ? n + NB : n) * K;
        column_block(x, w + n * K, next_w, y + n, M, N, K, nb);
    }
    return 0;
}
