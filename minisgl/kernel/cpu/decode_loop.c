/* The whole layer stack of a bf16 decode batch in one call (CpuDecodeLoop, engine/cpu_decode.py).
 *
 * Why: on a small model the module path's per-op Python and ctypes calls (nine kernels a layer,
 * each converting its arguments and allocating its output) are a visible part of a decode step
 * (docs/PERFORMANCE.md). Here the same kernels run in the same order on the same buffers as the
 * module path's CPU ops, so the result is bitwise the module path's; Python builds the layer
 * table once, from the model's modules, and fills the step's fields per step.
 *
 * Every GEMM here is one that cannot decline for the rows it is given (checked by the caller
 * when it builds the table: the bf16 skinny GEMM takes any shape, the quantized ones and AMX
 * k % 32 == 0, AMX n % 16 == 0 and <= 640 rows), so a step never stops half way with some
 * layers' K/V written.
 */
#include <stdint.h>

void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w, uint16_t *out, long rows,
                       long h, float eps, int has_residual);
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, long rows, long inter);
void rope_store_bf16(uint16_t *qkv, const int32_t *positions, const uint16_t *cos, const uint16_t *sin,
                     const uint16_t *q_norm, const uint16_t *k_norm, float eps, uint16_t *k_cache,
                     uint16_t *v_cache, const int64_t *out_loc, long rows, long hq, long hk, long d);
void paged_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *page_table, long pt_stride, const int64_t *table_row,
                          const int64_t *kv_len, uint16_t *out, long rows, long hq, long hk, long d,
                          float scale, int nthreads);
void rope_store_q8_bf16(uint16_t *qkv, const int32_t *positions, const uint16_t *cos, const uint16_t *sin,
                        const uint16_t *q_norm, const uint16_t *k_norm, float eps, int8_t *k_cache, int8_t *v_cache,
                        float *k_scale, float *v_scale, const int64_t *out_loc, long rows, long hq, long hk, long d);
void paged_attention_q8_bf16(const uint16_t *q, long q_stride, const int8_t *k_cache, const int8_t *v_cache,
                             const float *k_scale, const float *v_scale, const int32_t *page_table, long pt_stride,
                             const int64_t *table_row, const int64_t *kv_len, uint16_t *out, long rows, long hq,
                             long hk, long d, float scale, int nthreads);
int gemv_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k, const uint16_t *bias,
              uint16_t *y, int nthreads);
int qgemv_q4_bf16(const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k,
                  const uint16_t *bias, uint16_t *y, int nthreads);
int qgemv_q8_bf16(const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k,
                  const uint16_t *bias, uint16_t *y, int nthreads);

int gemm_amx_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k, const uint16_t *bias,
                  uint16_t *y, int nthreads);
int gemm_avx2_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k, const uint16_t *bias,
                   uint16_t *y, int nthreads);
int gemv_vnni_bf16(const uint16_t *x, long ldx, long m, const uint32_t *w, long n, long k, const uint16_t *bias,
                   uint16_t *y, int nthreads);
int gemm_amx_vnni_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k, const uint16_t *bias,
                       uint16_t *y, int nthreads);
int gemm_amx_vnni_silu_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long inter, long k, uint16_t *act,
                            int nthreads);

/* One projection, dispatched by the batch's rows as QuantLinear does: the quantized records for
 * <= q_rows rows (q_bits 4 or 8; 0: none), else the bf16 skinny GEMM for <= gemv_rows rows, else
 * the AMX GEMM (the caller checked it takes the shape); both on the VNNI tiles where vnni is set. */
typedef struct {
    const void *q;
    long q_bits, q_rows;
    const uint16_t *w;
    long gemv_rows, n, k;
    const uint16_t *bias; /* NULL: none */
    long vnni;            /* w is in VNNI tiles (layers/quant.py vnni_pack) */
} DecodeGemm;
typedef struct {
    const uint16_t *ln1, *ln2, *q_norm, *k_norm; /* the norms may be NULL */
    void *k_cache, *v_cache;
    float *k_scale, *v_scale; /* an int8 pool's per-head scales (kv_int8.c); NULL: a bf16 pool */
    DecodeGemm qkv, o, gate_up, down;
} DecodeLayer;
typedef struct {
    uint16_t *res, *h, *qkv, *attn, *a, *gu, *act, *m; /* [rows, width] buffers */
    const int32_t *positions;
    const uint16_t *cos, *sin, *final_norm;
    const int64_t *out_loc, *table_row, *kv_len;
    const int32_t *page_table;
    long pt_stride, rows, hidden, inter, hq, hk, d;
    float eps, scale;
    long nthreads;
} DecodeStep;

static int run_gemm(const DecodeGemm *g, const uint16_t *x, long m, uint16_t *y, int nt) {
    if (g->q_bits && m <= g->q_rows)
        return (g->q_bits == 4 ? qgemv_q4_bf16 : qgemv_q8_bf16)(x, g->k, m, (const uint8_t *)g->q, g->n, g->k, g->bias, y, nt);
    if (g->vnni)
        return m <= g->gemv_rows ? gemv_vnni_bf16(x, g->k, m, (const uint32_t *)g->w, g->n, g->k, g->bias, y, nt)
                                 : gemm_amx_vnni_bf16(x, g->k, m, g->w, g->n, g->k, g->bias, y, nt);
    if (m <= g->gemv_rows) return gemv_bf16(x, g->k, m, g->w, g->n, g->k, g->bias, y, nt);
    /* the many-row GEMM: at most one of the two is built (AMX beside AVX512-BF16, else AVX2) */
    return gemm_amx_bf16(x, g->k, m, g->w, g->n, g->k, g->bias, y, nt) ||
           gemm_avx2_bf16(x, g->k, m, g->w, g->n, g->k, g->bias, y, nt);
}

/* act = silu(gate) * up of the MLP input x, as _Linear.forward_silu_and_mul: one pass over the
 * VNNI tiles where the AMX GEMM runs (the same bits as the GEMM then silu_mul), else the two. */
static int run_gate_up_act(const DecodeGemm *g, const uint16_t *x, long m, uint16_t *gu, uint16_t *act, long inter,
                           int nt) {
    const int dense = !g->q_bits || m > g->q_rows;
    if (g->vnni && dense && m > g->gemv_rows && !g->bias && gemm_amx_vnni_silu_bf16(x, g->k, m, g->w, inter, g->k, act, nt))
        return 1;
    if (!run_gemm(g, x, m, gu, nt)) return 0;
    silu_mul_bf16(gu, act, m, inter);
    return 1;
}

/* s->h holds layer 0's normed input and s->res its residual (the caller's first add_rms_norm);
 * on return s->h is the final norm's output. Returns 0 only on a malformed table. */
int decode_layers_bf16(const DecodeLayer *layers, long nlayers, const DecodeStep *s) {
    const long b = s->rows, width = (s->hq + 2 * s->hk) * s->d;
    const int nt = (int)s->nthreads;
    for (long i = 0; i < nlayers; i++) {
        const DecodeLayer *L = layers + i;
        if (!run_gemm(&L->qkv, s->h, b, s->qkv, nt)) return 0;
        if (L->k_scale) {
            rope_store_q8_bf16(s->qkv, s->positions, s->cos, s->sin, L->q_norm, L->k_norm, s->eps, L->k_cache,
                               L->v_cache, L->k_scale, L->v_scale, s->out_loc, b, s->hq, s->hk, s->d);
            paged_attention_q8_bf16(s->qkv, width, L->k_cache, L->v_cache, L->k_scale, L->v_scale, s->page_table,
                                    s->pt_stride, s->table_row, s->kv_len, s->attn, b, s->hq, s->hk, s->d, s->scale, nt);
        } else {
            rope_store_bf16(s->qkv, s->positions, s->cos, s->sin, L->q_norm, L->k_norm, s->eps, L->k_cache,
                            L->v_cache, s->out_loc, b, s->hq, s->hk, s->d);
            paged_attention_bf16(s->qkv, width, L->k_cache, L->v_cache, s->page_table, s->pt_stride, s->table_row,
                                 s->kv_len, s->attn, b, s->hq, s->hk, s->d, s->scale, nt);
        }
        if (!run_gemm(&L->o, s->attn, b, s->a, nt)) return 0;
        add_rms_norm_bf16(s->a, s->res, L->ln2, s->h, b, s->hidden, s->eps, 1);
        if (!run_gate_up_act(&L->gate_up, s->h, b, s->gu, s->act, s->inter, nt)) return 0;
        if (!run_gemm(&L->down, s->act, b, s->m, nt)) return 0;
        add_rms_norm_bf16(s->m, s->res, i + 1 < nlayers ? layers[i + 1].ln1 : s->final_norm, s->h, b, s->hidden, s->eps, 1);
    }
    return 1;
}
