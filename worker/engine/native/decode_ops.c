/* The small per-layer ops of a CPU decode step, one C call each instead of several torch ops (whose fixed
 * cost per op dominates at decode sizes): RMSNorm, RoPE + KV write, SiLU(gate) * up. Built by cpu_kernel.py
 * with -ffp-contract=off and without -fassociative-math, so each op rounds where torch's does (bf16 ops
 * computed in fp32 and rounded to nearest even, as torch's CPU kernels do): RoPE + KV write is
 * bit-identical to the torch ops; RMSNorm (order of the sum of squares) and SiLU (the exp polynomial) are
 * within ~1 ulp of fp32 of them.
 *
 * rope_kv: RoPE (rotate-half) of q and k, q copied out contiguous, k and v written to their KV slots.
 * qkv:       [B, (H + 2 Hkv) * D] contiguous (the qkv projection of one token per sequence), D even
 * cos, sin:  [P, D] RoPE tables (sin with rotate-half's sign folded into its first half); pos: [B] int64
 * slots:     [B] int64 flat KV slot of each sequence's token, < nslots (checked: never written outside)
 * q_out:     [B, H, D]; kpool, vpool: [nslots, Hkv, D] (one layer's K and V pools)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define ID(x) (x)
/* Threads (OpenMP, torch's libgomp): rows (or row chunks) split across ``nthreads`` once an op has at least
 * PAR_MIN elements (rope_kv: 8 rows); below that the fork costs more than it saves. Every element is
 * computed exactly as on one thread (no reduction crosses a thread), so results never depend on the thread
 * count. Built without OpenMP, the pragmas are ignored and everything runs on the calling thread. */
#define PAR_MIN 16384
#define CHUNK 1024
/* One head's D values: o = x * c + rot(x) * s, each op rounded to T. Inlined with D constant (64, 128)
 * where it can be, so the short loops vectorize without runtime checks. */
#define DEFINE_ROPE_HEAD(NAME, T, LOAD, STORE)                                                        \
static inline __attribute__((always_inline)) void NAME(const T *restrict x, const T *restrict c,      \
                                                       const T *restrict s, T *restrict o, int D) {   \
    const int half = D / 2;                                                                           \
    for (int d = 0; d < half; d++) /* first half: rot = x[half:] */                                   \
        o[d] = STORE(LOAD(STORE(LOAD(x[d]) * LOAD(c[d]))) + LOAD(STORE(LOAD(x[d + half]) * LOAD(s[d])))); \
    for (int d = half; d < D; d++) /* second half: rot = x[:half] */                                  \
        o[d] = STORE(LOAD(STORE(LOAD(x[d]) * LOAD(c[d]))) + LOAD(STORE(LOAD(x[d - half]) * LOAD(s[d])))); \
}
DEFINE_ROPE_HEAD(rope_head_f32, float, ID, ID)
DEFINE_ROPE_HEAD(rope_head_bf16, uint16_t, bf2f, f2bf)

/* One row: returns 1 (and writes nothing) if its position or slot is out of range. Inlined with D
 * constant (64, 128) where it can be. */
#define DEFINE_ROPE_KV(NAME, T, HEAD)                                                                 \
static inline __attribute__((always_inline)) int NAME##_row(                                          \
        const T *qkv, const T *cos, const T *sin, const int64_t *pos, const int64_t *slots, T *q_out,  \
        T *kpool, T *vpool, int b, int H, int Hkv, int D, int64_t P, int64_t nslots) {                \
    if (pos[b] < 0 || pos[b] >= P || slots[b] < 0 || slots[b] >= nslots) return 1;                   \
    const T *row = qkv + (int64_t)b * (H + 2 * Hkv) * D, *c = cos + pos[b] * D, *s = sin + pos[b] * D; \
    T *kd = kpool + slots[b] * Hkv * D;                                                               \
    for (int h = 0; h < H; h++) HEAD(row + h * D, c, s, q_out + ((int64_t)b * H + h) * D, D);         \
    for (int h = 0; h < Hkv; h++) HEAD(row + (H + h) * D, c, s, kd + h * D, D);                       \
    memcpy(vpool + slots[b] * Hkv * D, row + (H + Hkv) * D, sizeof(T) * Hkv * D);                     \
    return 0;                                                                                         \
}                                                                                                     \
/* Returns the number of rows left untouched because their position or slot was out of range (0 = ok).  \
 * Rows split across threads from 8 rows on: with nthreads > 1 the slots must be distinct (the caller  \
 * checks; two rows writing one slot would race). The parallel loop is here, not in the inlined row    \
 * function, so that each D branch keeps its constant. */                                             \
int NAME(const T *qkv, const T *cos, const T *sin, const int64_t *pos, const int64_t *slots, T *q_out,  \
         T *kpool, T *vpool, int B, int H, int Hkv, int D, int64_t P, int64_t nslots, int nthreads) {  \
    int bad = 0;                                                                                      \
    _Pragma("omp parallel for if (B >= 8) num_threads(nthreads) reduction(+ : bad)")                  \
    for (int b = 0; b < B; b++) {                                                                     \
        if (D == 64)                                                                                  \
            bad += NAME##_row(qkv, cos, sin, pos, slots, q_out, kpool, vpool, b, H, Hkv, 64, P, nslots); \
        else if (D == 128)                                                                            \
            bad += NAME##_row(qkv, cos, sin, pos, slots, q_out, kpool, vpool, b, H, Hkv, 128, P, nslots); \
        else                                                                                          \
            bad += NAME##_row(qkv, cos, sin, pos, slots, q_out, kpool, vpool, b, H, Hkv, D, P, nslots); \
    }                                                                                                 \
    return bad;                                                                                       \
}
DEFINE_ROPE_KV(rope_kv_f32, float, rope_head_f32)
DEFINE_ROPE_KV(rope_kv_bf16, uint16_t, rope_head_bf16)

/* RMSNorm of ``rows`` rows of n values, as transformers' LlamaRMSNorm: fp32 statistics, x * rsqrt(mean(x^2)
 * + eps) rounded to T, then times the weight in T. Not bit-identical to torch (the sum of squares runs in
 * 16 lanes, torch's in its own order: ~1 ulp of fp32 in the scale), like a different GEMM kernel.
 * x, out: [rows, n]; w: [n]. */
#define NLANES 16
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                         \
void NAME(const T *restrict x, const T *restrict w, T *restrict out, int rows, int n, float eps,       \
          int nthreads) {                                                                             \
    _Pragma("omp parallel for if ((int64_t)rows * n >= PAR_MIN) num_threads(nthreads)")               \
    for (int r = 0; r < rows; r++) {                                                                  \
        const T *restrict xr = x + (int64_t)r * n;                                                    \
        T *restrict orow = out + (int64_t)r * n;                                                      \
        float lane[NLANES] = {0.f};                                                                   \
        int i = 0;                                                                                    \
        for (; i + NLANES <= n; i += NLANES)                                                          \
            for (int j = 0; j < NLANES; j++) lane[j] += LOAD(xr[i + j]) * LOAD(xr[i + j]);            \
        float ss = 0.f;                                                                               \
        for (; i < n; i++) ss += LOAD(xr[i]) * LOAD(xr[i]);                                           \
        for (int j = 0; j < NLANES; j++) ss += lane[j];                                               \
        const float scale = 1.f / sqrtf(ss / (float)n + eps);                                         \
        for (int k = 0; k < n; k++) orow[k] = STORE(LOAD(w[k]) * LOAD(STORE(LOAD(xr[k]) * scale)));   \
    }                                                                                                 \
}
DEFINE_RMS_NORM(rms_norm_f32, float, ID, ID)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf2f, f2bf)

/* exp(x), Cephes expf polynomial (~1 ulp; inf above 88.72, which expf reaches at 88.7228; x clamped below at
 * -87.33; NaN stays NaN; 2^n as two factors so that n = 128 stays finite); plain C that the compiler
 * vectorizes (no libm call in the loop). */
static inline float exp_poly(float x0) {
    float x = x0 < -87.33f ? -87.33f : x0; /* not fminf / fmaxf: their NaN rules keep the loop scalar */
    x = x > 88.72f ? 88.72f : x;
    const float n = rintf(x * 1.44269504089f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + (r + 1.f);
    const int32_t ni = n == n ? (int32_t)n : 0, h = ni / 2; /* (int)NaN is undefined: NaN gives p = NaN */
    union { uint32_t u; float f; } f1 = {.u = (uint32_t)(h + 127) << 23}, f2 = {.u = (uint32_t)(ni - h + 127) << 23};
    return x0 > 88.72f ? INFINITY : (x0 != x0 ? x0 : p * f1.f * f2.f);
}

/* silu(gate) * up of a fused gate/up projection, as transformers' LlamaMLP in the model dtype: silu(g) =
 * g / (1 + exp(-g)) in fp32 rounded to T, times up rounded to T (within ~1 ulp of torch's exp). gate_up:
 * [rows, 2 * n] (gate then up); out: [rows, n]. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE)                                                         \
void NAME(const T *restrict gate_up, T *restrict out, int rows, int n, int nthreads) {                \
    const int nchunks = (n + CHUNK - 1) / CHUNK;                                                      \
    _Pragma("omp parallel for if ((int64_t)rows * n >= PAR_MIN) num_threads(nthreads)")               \
    for (int item = 0; item < rows * nchunks; item++) {                                               \
        const int r = item / nchunks, k0 = (item % nchunks) * CHUNK, k1 = k0 + CHUNK < n ? k0 + CHUNK : n; \
        const T *restrict g = gate_up + (int64_t)r * 2 * n, *restrict u = g + n;                        \
        T *restrict o = out + (int64_t)r * n;                                                         \
        for (int k = k0; k < k1; k++) {                                                               \
            const float x = LOAD(g[k]);                                                               \
            o[k] = STORE(LOAD(STORE(x / (1.f + exp_poly(-x)))) * LOAD(u[k]));                         \
        }                                                                                             \
    }                                                                                                 \
}
DEFINE_SILU_MUL(silu_mul_f32, float, ID, ID)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf2f, f2bf)

/* Greedy pick, as torch.argmax(dim=-1): per row the index of the first maximum, or of the first NaN if
 * any (torch treats NaN as the maximum). Exact (comparisons only). Two passes per row: the maximum (and
 * whether a NaN occurs), then the first position equal to it; SIMD where the build has AVX512 or AVX2 (the
 * compiler does not vectorize this reduction by itself), else plain loops. x: [rows, n]; out: [rows]. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define AM_W 16
typedef __m512 am_vec;
static inline am_vec am_load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline am_vec am_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline am_vec am_max(am_vec a, am_vec b) { return _mm512_max_ps(a, b); }
static inline uint32_t am_eq(am_vec a, am_vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline uint32_t am_nan(am_vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline float am_hmax(am_vec a) { return _mm512_reduce_max_ps(a); }
static inline am_vec am_set1(float x) { return _mm512_set1_ps(x); }
#elif defined(__AVX2__)
#include <immintrin.h>
#define AM_W 8
typedef __m256 am_vec;
static inline am_vec am_load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline am_vec am_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline am_vec am_max(am_vec a, am_vec b) { return _mm256_max_ps(a, b); }
static inline uint32_t am_eq(am_vec a, am_vec b) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
static inline uint32_t am_nan(am_vec a) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
static inline float am_hmax(am_vec a) {
    float t[8];
    _mm256_storeu_ps(t, a);
    float m = t[0];
    for (int j = 1; j < 8; j++) m = t[j] > m ? t[j] : m;
    return m;
}
static inline am_vec am_set1(float x) { return _mm256_set1_ps(x); }
#endif

#ifdef AM_W
/* The max of a NaN-free vector lane and a value: max_ps returns its second operand when either is NaN,
 * so NaNs never enter the running maximum; they are flagged apart. */
#define DEFINE_ARGMAX(NAME, T, LOAD, VLOAD)                                                           \
void NAME(const T *restrict x, int64_t *restrict out, int rows, int n, int nthreads) {               \
    _Pragma("omp parallel for if ((int64_t)rows * n >= PAR_MIN) num_threads(nthreads)")               \
    for (int r = 0; r < rows; r++) {                                                                  \
        const T *restrict xr = x + (int64_t)r * n;                                                    \
        am_vec mv = am_set1(-INFINITY);                                                               \
        uint32_t nan = 0;                                                                             \
        int i = 0;                                                                                    \
        for (; i + AM_W <= n; i += AM_W) {                                                            \
            const am_vec v = VLOAD(xr + i);                                                           \
            nan |= am_nan(v);                                                                         \
            mv = am_max(v, mv);                                                                       \
        }                                                                                             \
        float m = am_hmax(mv);                                                                        \
        for (int k = i; k < n; k++) { const float v = LOAD(xr[k]); nan |= v != v; m = v > m ? v : m; } \
        const am_vec target = am_set1(m);                                                             \
        int64_t found = 0;                                                                            \
        for (i = 0; i + AM_W <= n; i += AM_W) {                                                       \
            const am_vec v = VLOAD(xr + i);                                                           \
            const uint32_t hit = nan ? am_nan(v) : am_eq(v, target);                                  \
            if (hit) { found = i + __builtin_ctz(hit); goto done_##NAME; }                            \
        }                                                                                             \
        for (; i < n; i++) {                                                                          \
            const float v = LOAD(xr[i]);                                                              \
            if (nan ? v != v : v == m) { found = i; break; }                                          \
        }                                                                                             \
    done_##NAME:                                                                                      \
        out[r] = found;                                                                               \
    }                                                                                                 \
}
DEFINE_ARGMAX(argmax_f32, float, ID, am_load_f32)
DEFINE_ARGMAX(argmax_bf16, uint16_t, bf2f, am_load_bf16)
#else
#define DEFINE_ARGMAX(NAME, T, LOAD)                                                                  \
void NAME(const T *restrict x, int64_t *restrict out, int rows, int n, int nthreads) {               \
    _Pragma("omp parallel for if ((int64_t)rows * n >= PAR_MIN) num_threads(nthreads)")               \
    for (int r = 0; r < rows; r++) {                                                                  \
        const T *restrict xr = x + (int64_t)r * n;                                                    \
        int64_t best = 0;                                                                             \
        float m = LOAD(xr[0]);                                                                        \
        for (int k = 0; k < n && m == m; k++) {                                                       \
            const float v = LOAD(xr[k]);                                                              \
            if (v != v || v > m) { m = v; best = k; }                                                 \
        }                                                                                             \
        out[r] = best;                                                                                \
    }                                                                                                 \
}
DEFINE_ARGMAX(argmax_f32, float, ID)
DEFINE_ARGMAX(argmax_bf16, uint16_t, bf2f)
#endif
