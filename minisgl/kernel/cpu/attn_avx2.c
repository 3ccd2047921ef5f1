/* Causal prefill attention for CPUs with AVX2 + FMA but no AMX (attn_amx.c's role and signature):
 * out[i, h] = softmax(q_i . k_j * scale, j <= i) v, bf16 in and out, fp32 throughout, for a
 * prompt whose keys are its own rows (no cached prefix).
 *
 * Why: torch's SDPA (its CPU flash kernel) runs at ~4 GFLOP/s on such a CPU (fp32 or bf16), so
 * it took ~1.0 s of a 1.4 s 500-token prefill of the embedded model (docs/PERFORMANCE.md).
 * This runs both products as gemm_avx2.c's register blocks: per KV head, K is packed once as
 * [key block of 16][d][16] fp32 and V as [d block of 16][key][16]; per task (a query head and 6
 * query rows) S = Q K^T over the causal keys into a per-thread row buffer (6 x 16 outputs in 12
 * accumulators), an exact row softmax (no online rescaling: the whole causal row is there), then
 * O = P V in the same blocks and one division by the row sum.
 *
 * Returns 0 (caller uses SDPA) without AVX2 + FMA, for head_dim % 16, hq % hk, or no memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#if MINISGL_SKINNY_ISA == 2
#include <immintrin.h>
#include <omp.h>

#include "vec_math.h"

#define QB 6  /* query rows per task */
#define KB 16 /* keys per score block, and d columns per output block */

/* One KV head's keys -> kp [key block][d][KB] (keys past n zero); values -> vp [d / KB][n][KB]. */
static void pack_kv(const uint16_t *k, const uint16_t *v, long ld, long n, long d, float *kp, float *vp) {
    const long nb = (n + KB - 1) / KB;
    for (long b = 0; b < nb; b++)
        for (long j = 0; j < KB; j++) {
            const long key = b * KB + j;
            for (long c = 0; c < d; c++) kp[(b * d + c) * KB + j] = key < n ? bf16_to_f(k[key * ld + c]) : 0.f;
        }
    for (long db = 0; db < d / KB; db++)
        for (long key = 0; key < n; key++) {
            _mm256_storeu_ps(vp + (db * n + key) * KB, ld8_bf16(v + key * ld + db * KB));
            _mm256_storeu_ps(vp + (db * n + key) * KB + 8, ld8_bf16(v + key * ld + db * KB + 8));
        }
}

/* acc[6][2] += a[t][6] (broadcast) x b[t][16] over t < len: the 6 x 16 register block. */
#define BLOCK_6x16(LEN, A, ASTRIDE, B, BSTRIDE)                                                    \
    for (long t = 0; t < (LEN); t++) {                                                             \
        const __m256 b0 = _mm256_loadu_ps((B) + t * (BSTRIDE)), b1 = _mm256_loadu_ps((B) + t * (BSTRIDE) + 8); \
        for (int i = 0; i < QB; i++) {                                                             \
            const __m256 a = _mm256_broadcast_ss((A) + t * (ASTRIDE) + i);                        \
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);                                         \
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);                                         \
        }                                                                                          \
    }

/* Query rows [i0, i0 + QB) of query head h (those past n are zero rows, not stored). s is a
 * [QB][keys] buffer, qp [d][QB], pt [keys][QB] (P transposed for the second product). */
static void attend_rows(const uint16_t *qkv, long ld, long n, long h, long d, float scale, const float *kp,
                        const float *vp, long i0, float *qp, float *s, float *pt, uint16_t *out, long ld_out) {
    const long mr = n - i0 < QB ? n - i0 : QB, nkeys = i0 + mr, nkb = (nkeys + KB - 1) / KB, width = nkb * KB;
    for (long c = 0; c < d; c++)
        for (int i = 0; i < QB; i++) qp[c * QB + i] = i < mr ? scale * bf16_to_f(qkv[(i0 + i) * ld + h * d + c]) : 0.f;
    for (long b = 0; b < nkb; b++) { /* scores of 16 keys */
        __m256 acc[QB][2];
        for (int i = 0; i < QB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        BLOCK_6x16(d, qp, QB, kp + b * d * KB, KB)
        for (int i = 0; i < QB; i++) {
            _mm256_storeu_ps(s + i * width + b * KB, acc[i][0]);
            _mm256_storeu_ps(s + i * width + b * KB + 8, acc[i][1]);
        }
    }
    float sum[QB];
    for (int i = 0; i < QB; i++) { /* the exact softmax of keys <= i0 + i; the others weigh 0 */
        float *row = s + i * width;
        const long live = i < mr ? i0 + i + 1 : 0;
        float mx = -INFINITY;
        for (long j = 0; j < live; j++) mx = row[j] > mx ? row[j] : mx;
        __m256 acc = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= live; j += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(row + j, e);
            acc = _mm256_add_ps(acc, e);
        }
        float tail = 0.f;
        for (; j < live; j++) tail += row[j] = fast_exp(row[j] - mx);
        for (; j < width; j++) row[j] = 0.f;
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        sum[i] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail;
    }
    for (long j = 0; j < nkeys; j++)
        for (int i = 0; i < QB; i++) pt[j * QB + i] = s[i * width + j];
    for (long db = 0; db < d / KB; db++) { /* 16 output columns */
        __m256 acc[QB][2];
        for (int i = 0; i < QB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        BLOCK_6x16(nkeys, pt, QB, vp + db * n * KB, KB)
        for (int i = 0; i < mr; i++) {
            float o[KB];
            const __m256 inv = _mm256_set1_ps(1.0f / sum[i]);
            _mm256_storeu_ps(o, _mm256_mul_ps(acc[i][0], inv));
            _mm256_storeu_ps(o + 8, _mm256_mul_ps(acc[i][1], inv));
            for (int c = 0; c < KB; c++) out[(i0 + i) * ld_out + h * d + db * KB + c] = f_to_bf16(o[c]);
        }
    }
}

int prefill_attention_avx2_bf16(const uint16_t *qkv, long ld, long n, long hq, long hk, long d, float scale,
                                uint16_t *out, long ld_out, int nthreads) {
    if (n < 1 || d % KB || hk < 1 || hq % hk) return 0;
    const long nkb = (n + KB - 1) / KB, group = hq / hk, nqb = (n + QB - 1) / QB;
    const uint16_t *k = qkv + hq * d, *v = qkv + (hq + hk) * d;
    float *kp = malloc((size_t)hk * nkb * KB * d * sizeof(float)), *vp = malloc((size_t)hk * n * d * sizeof(float));
    if (!kp || !vp) {
        free(kp), free(vp);
        return 0;
    }
    int ok = 1;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long kh = 0; kh < hk; kh++)
            pack_kv(k + kh * d, v + kh * d, ld, n, d, kp + kh * nkb * KB * d, vp + kh * n * d);
        float *qp = malloc(d * QB * sizeof(float)), *s = malloc((size_t)QB * nkb * KB * sizeof(float));
        float *pt = malloc((size_t)n * QB * sizeof(float));
        if (!qp || !s || !pt) {
#pragma omp atomic write
            ok = 0;
        }
        /* (head, query block) tasks, longest rows first: the causal rows grow with the block */
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < hq * nqb; t++) {
            if (!qp || !s || !pt) continue;
            const long qb = nqb - 1 - t / hq, h = t % hq, kh = h / group;
            attend_rows(qkv, ld, n, h, d, scale, kp + kh * nkb * KB * d, vp + kh * n * d, qb * QB, qp, s, pt, out, ld_out);
        }
        free(qp), free(s), free(pt);
    }
    free(kp), free(vp);
    return ok;
}
#else
int prefill_attention_avx2_bf16(const void *qkv, long ld, long n, long hq, long hk, long d, float scale, void *out,
                                long ld_out, int nthreads) {
    (void)qkv, (void)ld, (void)n, (void)hq, (void)hk, (void)d, (void)scale, (void)out, (void)ld_out, (void)nthreads;
    return 0;
}
#endif
