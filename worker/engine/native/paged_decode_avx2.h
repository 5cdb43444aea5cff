/* The AVX2 + FMA path of the paged decode kernel (f32 and bf16), included by paged_decode.c. Shapes and
 * layout: see paged_decode.c. */
/* ---- AVX2 + FMA path (f32 and bf16), compiled for avx2/fma whatever -march says and chosen at runtime
 * (__builtin_cpu_supports), so one library serves every x86 CPU. Same work items and two passes as the
 * portable loop; QK as 8-wide FMAs per (token, head) and one horizontal sum, softmax with an 8-wide exp,
 * PV as 8-wide FMAs into the fp32 accumulator (in L1). Needs D % 8 == 0. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma")
static inline __m256 ld8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* exp(x) for 8 lanes (Cephes expf polynomial, ~1 ulp; x clamped to [-87.3, 88.7]; 2^n built in the exponent) */
static inline __m256 vexp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.72f)), _mm256_set1_ps(-87.33f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    /* n in [-127, 128]: 2^n as two factors so that n = -127 or 128 stays representable */
    const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

/* One work item: sequence b, KV heads kh0 .. kh0 + hc - 1. Returns 1 if its scratch could not be allocated. */
#define DEFINE_AVX2_ITEM(NAME, T, LD8, LOAD, STORE)                                                    \
static int NAME(const T *q, const T *k, const T *v, const int64_t *tables, const int64_t *ctx, T *out,  \
                int b, int kh0, int H, int Hkv, int D, int bs, int M, float scale, int hc) {            \
    const int G = H / Hkv, nq = hc * G, nv = D / 8;                                                    \
    const int64_t n = ctx[b] > 0 ? ctx[b] : 0;                                                         \
    float *qf = (float *)malloc(sizeof(float) * ((size_t)nq * (2 * (size_t)D + (size_t)n + 2)));      \
    if (qf == NULL) return 1;                                                                          \
    float *acc = qf + (size_t)nq * D, *mx = acc + (size_t)nq * D, *z = mx + nq, *sc = z + nq;          \
    const T *qb = q + ((int64_t)b * H + (int64_t)kh0 * G) * D;                                         \
    for (int j = 0; j < nq * D; j++) { qf[j] = LOAD(qb[j]) * scale; acc[j] = 0.f; }                    \
    for (int h = 0; h < nq; h++) mx[h] = -FLT_MAX;                                                     \
    const int64_t *tb = tables + (int64_t)b * M;                                                       \
    for (int64_t t = 0; t < n; t++) {                                                                  \
        const T *kr = k + ((tb[t / bs] * bs + t % bs) * Hkv + kh0) * D; /* hc heads, contiguous */     \
        for (int h = 0; h < nq; h++) {                                                                 \
            const float *qh = qf + h * D;                                                              \
            const T *kh = kr + (h / G) * D;                                                            \
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                 \
            int c = 0;                                                                                 \
            for (; c + 1 < nv; c += 2) {                                                               \
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), LD8(kh + 8 * c), a0);               \
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c + 8), LD8(kh + 8 * c + 8), a1);        \
            }                                                                                          \
            if (c < nv) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), LD8(kh + 8 * c), a0);        \
            const float s = hsum8(_mm256_add_ps(a0, a1));                                              \
            sc[h * n + t] = s;                                                                         \
            if (s > mx[h]) mx[h] = s;                                                                  \
        }                                                                                              \
    }                                                                                                  \
    for (int h = 0; h < nq; h++) {                                                                     \
        float *sh = sc + h * n;                                                                        \
        const __m256 mv = _mm256_set1_ps(mx[h]);                                                       \
        __m256 zv = _mm256_setzero_ps();                                                               \
        int64_t t = 0;                                                                                 \
        for (; t + 8 <= n; t += 8) {                                                                   \
            const __m256 e = vexp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mv));                        \
            _mm256_storeu_ps(sh + t, e);                                                               \
            zv = _mm256_add_ps(zv, e);                                                                 \
        }                                                                                              \
        float zz = hsum8(zv);                                                                          \
        for (; t < n; t++) { sh[t] = expf(sh[t] - mx[h]); zz += sh[t]; }                               \
        z[h] = zz;                                                                                     \
    }                                                                                                  \
    for (int64_t t = 0; t < n; t++) {                                                                  \
        const T *vr = v + ((tb[t / bs] * bs + t % bs) * Hkv + kh0) * D;                                \
        for (int h = 0; h < nq; h++) {                                                                 \
            const __m256 p = _mm256_set1_ps(sc[h * n + t]);                                            \
            const T *vh = vr + (h / G) * D;                                                            \
            float *ah = acc + h * D;                                                                   \
            for (int c = 0; c < nv; c++)                                                               \
                _mm256_storeu_ps(ah + 8 * c, _mm256_fmadd_ps(p, LD8(vh + 8 * c), _mm256_loadu_ps(ah + 8 * c))); \
        }                                                                                              \
    }                                                                                                  \
    WRITE_OUT(T, STORE, acc, z) /* paged_decode.c */                                                   \
    free(qf);                                                                                          \
    return 0;                                                                                          \
}
DEFINE_AVX2_ITEM(avx2_item_f32, float, ld8_f32, ID, ID)
DEFINE_AVX2_ITEM(avx2_item_bf16, uint16_t, ld8_bf16, bf2f, f2bf)
#pragma GCC pop_options
#define HAVE_AVX2_PATH 1
#endif

#ifdef HAVE_AVX2_PATH
DEFINE_ITEM_KERNEL(avx2_f32, avx2_item_f32, float) /* paged_decode.c */
DEFINE_ITEM_KERNEL(avx2_bf16, avx2_item_bf16, uint16_t)
#endif

