/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the block pool
 * (no gather copy). Built at runtime by cpu_kernel.py (gcc -O3 -march=native -fopenmp, no fast-math), called via ctypes.
 *
 * q:      [B, H, D]            (bf16 or f32)
 * k, v:   [NB + 1, bs, Hkv, D] (same dtype; one layer's pool)
 * tables: [B, M] int64 block ids; ctx: [B] int64 tokens to attend (incl. the current one)
 * out:    [B, H, D]; returns the number of work items that failed to allocate scratch memory (0 = ok)
 * Work item = (sequence, chunk of hc kv heads): each token's K (then V) row for those heads is one
 * contiguous read, shared by the G = H / Hkv query heads of each group. Two passes per item: scores for
 * all tokens (then softmax), then the probability-weighted V sum; fp32 accumulation throughout (the bf16
 * AVX-512 and AMX paths round the probabilities to bf16 first).
 * On CPUs with AVX-512 both entry points take an intrinsics path in tiles of 16 tokens (FMA, or vdpbf16ps
 * with AVX512-BF16, for QK; vector exp; FMA for PV, or vdpbf16ps over token pairs in bf16):
 * paged_decode_avx512.h. On CPUs with AMX-BF16, bf16 with
 * 4 <= G <= 16 query heads per KV head, D % 64 == 0 and D <= 256 takes tile matmuls for both passes, where
 * the process is granted the tile data (paged_decode_init): paged_decode_amx.h.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* The item's output rows (its nq query heads): acc [nq, D] / z [nq], 0 where z is 0 (no token attended). */
#define WRITE_OUT(T, STORE, acc, z)                                                                    \
    {                                                                                                  \
        T *ob = out + ((int64_t)b * H + (int64_t)kh0 * G) * D;                                         \
        for (int h = 0; h < nq; h++) {                                                                 \
            const float inv = (z)[h] > 0.f ? 1.f / (z)[h] : 0.f;                                       \
            for (int d = 0; d < D; d++) ob[h * D + d] = STORE((acc)[h * D + d] * inv);                 \
        }                                                                                              \
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
        WRITE_OUT(T, STORE, acc, sum)                                                                  \
        free(qf);                                                                                      \
    }                                                                                                  \
    return failed; /* work items that could not allocate their scratch (output left unset) */          \
}

#define ID(x) (x)
DEFINE_KERNEL(paged_decode_bf16_generic, uint16_t, bf2f, f2bf)
DEFINE_KERNEL(paged_decode_f32_generic, float, ID, ID)

/* A kernel whose work items, one per (sequence, chunk of hc KV heads), are calls of ITEM (the SIMD paths'
 * per-item functions), in parallel. The loop lives outside any target region (the items are called, not
 * inlined), so the OpenMP-outlined function never needs the items' target options. */
#define DEFINE_ITEM_KERNEL(NAME, ITEM, T)                                                              \
static int NAME(const T *q, const T *k, const T *v, const int64_t *tables, const int64_t *ctx, T *out, \
                int B, int H, int Hkv, int D, int bs, int M, float scale, int hc, int nthreads) {       \
    const int nchunks = Hkv / hc;                                                                      \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(+ : failed)")       \
    for (int item = 0; item < B * nchunks; item++)                                                     \
        failed += ITEM(q, k, v, tables, ctx, out, item / nchunks, (item % nchunks) * hc, H, Hkv, D, bs, M, \
                       scale, hc);                                                                     \
    return failed;                                                                                     \
}

/* Whether the fp32 AVX-512 path prefetches the next tile (PREFETCH_HEAD in paged_decode_avx512.h): on AMD CPUs,
 * where it measured faster, not on Intel, where it measured slower. Whether a whole-block tile is prefetched in
 * address order (prefetch_seq): on Intel, where it measured faster, not on AMD. Set once by paged_decode_init;
 * results are the same bits either way. */
static int prefetch_f32 = 0, prefetch_seq = 0;

#include "paged_decode_avx512.h" /* avx512_f32 (AVX512F builds), avx512_bf16 (AVX512-BF16 builds) */


#include "paged_decode_amx.h" /* amx_bf16, amx_granted, HAVE_AMX_PATH (AMX-BF16 builds) */
#include "paged_decode_avx2.h" /* avx2_f32, avx2_bf16, HAVE_AVX2_PATH (x86) */

/* ---- dispatch. isa_cap: the highest path allowed (tests and benchmarks lower it to compare paths):
 * 0 portable, 1 AVX2 + FMA, 2 AVX-512 (fp32: AVX512F; bf16: AVX512-BF16), 3 AMX (bf16, G >= 4). */
static int isa_cap = 3;
static int amx_ok = 0; /* paged_decode_init: the AMX path was built and this process may use the tile data */

/* Once per process before the first call (cpu_kernel.load): whether the AMX path can run here (and whether the
 * prefetches take, above). */
int paged_decode_init(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int amd = __builtin_cpu_is("amd"); /* both choices follow the vendor, measured per vendor */
    prefetch_f32 = amd;
    prefetch_seq = !amd;
#endif
#if HAVE_AMX_PATH
    amx_ok = amx_granted();
#endif
    return amx_ok;
}

void paged_decode_set_isa(int cap) { isa_cap = cap; }

static int have_avx2(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16_PATH 1
#else
#define HAVE_AVX512_BF16_PATH 0
#define avx512_bf16 paged_decode_bf16_generic /* never called: path() takes 2 only where it was built */
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512_F32_PATH 1
#else
#define HAVE_AVX512_F32_PATH 0
#define avx512_f32 paged_decode_f32_generic
#endif
#if !HAVE_AMX_PATH
#define amx_bf16 paged_decode_bf16_generic /* never called: amx_ok stays 0 */
#endif
#ifndef HAVE_AVX2_PATH
#define avx2_f32 paged_decode_f32_generic /* never called: have_avx2() is 0 */
#define avx2_bf16 paged_decode_bf16_generic
#endif

/* The path (3 AMX, 2 AVX-512, 1 AVX2 + FMA, 0 portable) the entry point of this dtype (1: bf16, 0: f32) takes
 * for head dim D and G query heads per KV head: the one choice the entry points and paged_decode_isa both read.
 * AMX from G = 4: at G = 2 its 2-row tiles lose to AVX-512 (0.80 vs 0.89 ms, 8 x 8/4 heads x 64); at G = 4, D =
 * 64 it wins 1.17x, at G = 8 1.4-1.5x, at G = 16 2x (one layer, bf16, Xeon model 207). */
static int path(int bf16, int D, int G) {
    if (isa_cap >= 3 && bf16 && amx_ok && G >= 4 && G <= 16 && D % 64 == 0 && D <= 256) return 3;
    if (isa_cap >= 2 && (bf16 ? HAVE_AVX512_BF16_PATH && D % 32 == 0 : HAVE_AVX512_F32_PATH && D % 16 == 0)) return 2;
    if (isa_cap >= 1 && D % 8 == 0 && have_avx2()) return 1;
    return 0;
}

/* The name of that path: "amx" (bf16), "avx512bf16" (bf16), "avx512" (fp32), "avx2" or "portable". */
const char *paged_decode_isa(int bf16, int D, int G) {
    switch (path(bf16, D, G)) {
    case 3: return "amx";
    case 2: return bf16 ? "avx512bf16" : "avx512";
    case 1: return "avx2";
    default: return "portable";
    }
}

#define DEFINE_ENTRY(NAME, T, BF16, AMX, AVX512, AVX2, GENERIC)                                       \
int NAME(const T *q, const T *k, const T *v, const int64_t *tables, const int64_t *ctx, T *out, int B, int H, \
         int Hkv, int D, int bs, int M, float scale, int hc, int nthreads) {                           \
    switch (path(BF16, D, H / Hkv)) {                                                                  \
    case 3: return AMX(q, k, v, tables, ctx, out, B, H, Hkv, D, bs, M, scale, hc, nthreads);           \
    case 2: return AVX512(q, k, v, tables, ctx, out, B, H, Hkv, D, bs, M, scale, hc, nthreads);        \
    case 1: return AVX2(q, k, v, tables, ctx, out, B, H, Hkv, D, bs, M, scale, hc, nthreads);          \
    default: return GENERIC(q, k, v, tables, ctx, out, B, H, Hkv, D, bs, M, scale, hc, nthreads);      \
    }                                                                                                  \
}
DEFINE_ENTRY(paged_decode_f32, float, 0, paged_decode_f32_generic, avx512_f32, avx2_f32, paged_decode_f32_generic)
DEFINE_ENTRY(paged_decode_bf16, uint16_t, 1, amx_bf16, avx512_bf16, avx2_bf16, paged_decode_bf16_generic)
