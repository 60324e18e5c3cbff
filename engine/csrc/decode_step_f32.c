/* A whole decode step of a Llama-family decoder in one call, float32, AVX2 + FMA.
 *
 * On a CPU a small decode step is some 300 kernel calls (about ten per layer), and from Python
 * each one costs a ctypes call and a tensor allocation or two: a few microseconds apiece, a fifth
 * of a batch-1 step on SmolLM2. This file runs the same kernels, in the same order and on the
 * same operands, from C: the hidden states it returns are bit for bit those of the per-layer path
 * (engine/model/llama.py with engine/cpu_kernels.py), so the step changes no token.
 *
 * Per layer, for B sequences with one new token each (h: (B, hidden), updated in place):
 *   n   = rms_norm(h)                      qkv = linear(n) [+ bias]
 *   [each head of q and of k rms-normed over head_dim: Qwen3]
 *   rope on q and k in qkv, k and v into their cache slots
 *   a   = decode_attention(q)              h  += linear(a) [+ bias]
 *   n   = rms_norm(h)                      gu  = linear(n) [+ bias]
 *   h  += linear(silu(gate) * up) [+ bias]
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int kvserve_linear_f32(const float *x, const float *w, float *y, long M, long N, long K, int num_threads);
int kvserve_linear_codes_f32(const float *x, const uint8_t *codes, const float *scale, const float *offset, int bits,
                             float *y, long M, long N, long K, int num_threads);
int kvserve_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                 const int64_t *tables, long max_blocks, const int64_t *ctx_lens, float *out,
                                 long B, long H, long KVH, long D, long block_size, float scale, int num_threads);
void kvserve_rms_norm_f32(const float *x, const float *w, float *y, long rows, long dim, float eps, int num_threads);
void kvserve_silu_and_mul_f32(const float *gu, float *out, long rows, long inter, int num_threads);
void kvserve_rope_write_kv_f32(float *qkv, const float *cos_t, const float *sin_t, const int64_t *positions,
                               const int64_t *slots, float *k_cache, float *v_cache,
                               long T, long H, long KVH, long D, int num_threads);

/* One nn.Linear's weight (N, K): float32, or its 4/8-bit codes where codes != NULL (as
 * engine.cpu_kernels.linear chooses); bias may be NULL. Field order is engine/decode_step.py's. */
typedef struct {
    const float *weight;
    const uint8_t *codes;
    const float *scale;
    const float *offset;
    const float *bias;
    long bits, n, k;
} kvserve_linear;

typedef struct {
    const float *input_norm;
    const float *post_norm;
    kvserve_linear qkv, o, gate_up, down;
    float *k_cache, *v_cache;  /* (num_blocks, block_size, KVH, D) */
    const float *q_norm, *k_norm;  /* (D,) per-head norm weights (Qwen3), or NULL */
} kvserve_layer;

typedef struct {
    long num_layers, hidden, inter, num_heads, num_kv_heads, head_dim, block_size;
    float eps, scale;
    const float *cos, *sin;  /* (max positions, head_dim) rope tables */
    const kvserve_layer *layers;
} kvserve_decoder;

static int linear(const kvserve_linear *l, const float *x, float *y, long M, int threads) {
    int rc = l->codes ? kvserve_linear_codes_f32(x, l->codes, l->scale, l->offset, (int)l->bits, y, M, l->n, l->k, threads)
                      : kvserve_linear_f32(x, l->weight, y, M, l->n, l->k, threads);
    if (rc == 0 && l->bias)  /* as torch's y.add_(bias) */
        for (long m = 0; m < M; m++)
            for (long i = 0; i < l->n; i++) y[m * l->n + i] += l->bias[i];
    return rc;
}

static void add_inplace(float *h, const float *x, long count) {
    for (long i = 0; i < count; i++) h[i] = h[i] + x[i];
}

/* h: (B, hidden) the step's embeddings in, the last layer's output out (before the final norm).
 * positions, slots, ctx_lens: (B,); tables: (B, max_blocks). Returns 0, a kernel's nonzero code
 * (the first that failed), or -3 when scratch memory cannot be allocated. */
int kvserve_decode_step_f32(const kvserve_decoder *m, float *h, long B, const int64_t *positions, const int64_t *slots,
                            const int64_t *tables, long max_blocks, const int64_t *ctx_lens, int threads) {
    long H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim, hid = m->hidden;
    long qkv_width = (H + 2 * KVH) * D, q_width = H * D;
    size_t floats = (size_t)B * (hid + qkv_width + 2 * q_width + hid + 3 * m->inter);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -3;
    float *normed = buf, *qkv = normed + B * hid, *q = qkv + B * qkv_width, *attn = q + B * q_width;
    float *proj = attn + B * q_width, *gate_up = proj + B * hid, *act = gate_up + B * 2 * m->inter;
    int rc = 0;
    for (long i = 0; i < m->num_layers && rc == 0; i++) {
        const kvserve_layer *l = &m->layers[i];
        kvserve_rms_norm_f32(h, l->input_norm, normed, B, hid, m->eps, threads);
        if ((rc = linear(&l->qkv, normed, qkv, B, threads))) break;
        if (l->q_norm)  /* in place: the kernel reads a row whole before writing it */
            for (long b = 0; b < B; b++) {
                float *row = qkv + b * qkv_width;
                kvserve_rms_norm_f32(row, l->q_norm, row, H, D, m->eps, 1);
                kvserve_rms_norm_f32(row + q_width, l->k_norm, row + q_width, KVH, D, m->eps, 1);
            }
        kvserve_rope_write_kv_f32(qkv, m->cos, m->sin, positions, slots, l->k_cache, l->v_cache, B, H, KVH, D, threads);
        for (long b = 0; b < B; b++) memcpy(q + b * q_width, qkv + b * qkv_width, q_width * sizeof(float));
        if ((rc = kvserve_decode_attention_f32(q, l->k_cache, l->v_cache, tables, max_blocks, ctx_lens, attn, B, H, KVH,
                                               D, m->block_size, m->scale, threads))) break;
        if ((rc = linear(&l->o, attn, proj, B, threads))) break;
        add_inplace(h, proj, B * hid);
        kvserve_rms_norm_f32(h, l->post_norm, normed, B, hid, m->eps, threads);
        if ((rc = linear(&l->gate_up, normed, gate_up, B, threads))) break;
        kvserve_silu_and_mul_f32(gate_up, act, B, m->inter, threads);
        if ((rc = linear(&l->down, act, proj, B, threads))) break;
        add_inplace(h, proj, B * hid);
    }
    free(buf);
    return rc;
}
