/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the block pool
 * (no gather copy). Built at runtime by cpu_kernel.py (gcc -O3 -march=native -fopenmp, no fast-math), called via ctypes.
 *
 * q:      [B, H, D]            (bf16 or f32)
 * k, v:   [NB + 1, bs, Hkv, D] (same dtype; one layer's pool)
 * tables: [B, M] int64 block ids; ctx: [B] int64 tokens to attend (incl. the current one)
 * out:    [B, H, D]; returns the number of work items that failed to allocate scratch memory (0 = ok)
 * Work item = (sequence, chunk of hc kv heads): each token's K (then V) row for those heads is one
 * contiguous read, shared by the G = H / Hkv query heads of each group. Two passes per item: scores for
 * all tokens (then softmax), then the probability-weighted V sum; fp32 accumulation throughout.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf2f(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                            \
int NAME(const T *q, const T *k, const T *v, const int64_t *tables, const int64_t *ctx, T *out,       \
          int B, int H, int Hkv, int D, int bs, int M, float scale, int hc, int nthreads) {            \
    const int G = H / Hkv, nchunks = Hkv / hc, nq = hc * G;                                            \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(+ : failed)")       \
    for (int item = 0; item < B * nchunks; item++) {                                                   \
        const int b = item / nchunks, kh0 = (item % nchunks) * hc;                                     \
        const int64_t n = ctx[b] > 0 ? ctx[b] : 0;                                                     \
        float *qf = (float *)malloc(sizeof(float) * ((size_t)nq * (2 * D + (size_t)n + 2) + hc * D));  \
        if (qf == NULL) { failed++; continue; }                                                        \
        float *acc = qf + nq * D, *row = acc + nq * D, *mx = row + hc * D, *sum = mx + nq;             \
        float *sc = sum + nq; /* [nq, n] */                                                            \
        const T *qb = q + ((int64_t)b * H + (int64_t)kh0 * G) * D;                                     \
        for (int j = 0; j < nq * D; j++) { qf[j] = LOAD(qb[j]) * scale; acc[j] = 0.f; }                \
        for (int h = 0; h < nq; h++) { mx[h] = -FLT_MAX; sum[h] = 0.f; }                               \
        for (int64_t t = 0; t < n; t++) {                                                              \
            const int64_t slot = tables[(int64_t)b * M + t / bs] * bs + t % bs;                        \
            const T *kr = k + (slot * Hkv + kh0) * D; /* hc heads, contiguous */                       \
            for (int j = 0; j < hc * D; j++) row[j] = LOAD(kr[j]);                                     \
            for (int h = 0; h < nq; h++) {                                                             \
                const float *qh = qf + h * D, *kh = row + (h / G) * D;                                 \
                float s = 0.f;                                                                         \
                for (int d = 0; d < D; d++) s += qh[d] * kh[d];                                        \
                sc[h * n + t] = s;                                                                     \
                if (s > mx[h]) mx[h] = s;                                                              \
            }                                                                                          \
        }                                                                                              \
        for (int h = 0; h < nq; h++) {                                                                 \
            float *sh = sc + h * n, m = mx[h], z = 0.f;                                                \
            for (int64_t t = 0; t < n; t++) { sh[t] = expf(sh[t] - m); z += sh[t]; }                   \
            sum[h] = z;                                                                                \
        }                                                                                              \
        for (int64_t t = 0; t < n; t++) {                                                              \
            const int64_t slot = tables[(int64_t)b * M + t / bs] * bs + t % bs;                        \
            const T *vr = v + (slot * Hkv + kh0) * D;                                                  \
            for (int j = 0; j < hc * D; j++) row[j] = LOAD(vr[j]);                                     \
            for (int h = 0; h < nq; h++) {                                                             \
                const float p = sc[h * n + t], *vh = row + (h / G) * D;                                \
                float *ah = acc + h * D;                                                               \
                for (int d = 0; d < D; d++) ah[d] += p * vh[d];                                        \
            }                                                                                          \
        }                                                                                              \
        T *ob = out + ((int64_t)b * H + (int64_t)kh0 * G) * D;                                         \
        for (int h = 0; h < nq; h++) {                                                                 \
            const float inv = sum[h] > 0.f ? 1.f / sum[h] : 0.f;                                       \
            for (int d = 0; d < D; d++) ob[h * D + d] = STORE(acc[h * D + d] * inv);                   \
        }                                                                                              \
        free(qf);                                                                                      \
    }                                                                                                  \
    return failed; /* work items that could not allocate their scratch (output left unset) */          \
}

#define ID(x) (x)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf2f, f2bf)
DEFINE_KERNEL(paged_decode_f32, float, ID, ID)

