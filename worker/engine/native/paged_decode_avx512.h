/* The AVX512-BF16 path of the paged decode kernel (bf16 only), included by paged_decode.c when the build
 * has AVX512-BF16 (-march=native on such a CPU). Shapes and layout: see paged_decode.c. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
/* exp(x) for 16 lanes (Cephes expf polynomial, ~1 ulp; x clamped to [-87.3, 88.7]). */
static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.72f)), _mm512_set1_ps(-87.33f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

#define FAST_MAX_Q 64 /* (query heads of one item) x (D / 32) bf16 vectors of q kept in registers/stack */
/* bf16 fast path (AVX512-BF16): work item = (sequence, chunk of hc KV heads), each token's K (then V) row
 * for those heads one contiguous read. QK with vdpbf16ps (bf16 x bf16 products are exact in fp32, fp32
 * accumulation), softmax in fp32, PV with bf16 -> fp32 conversion and FMA; the G query heads of a group
 * share each K/V row. Needs D % 32 == 0 and hc * G * D / 32 <= FAST_MAX_Q. */
static int fast_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *tables,
                     const int64_t *ctx, uint16_t *out, int B, int H, int Hkv, int D, int bs, int M, float scale,
                     int hc, int nthreads) {
    const int G = H / Hkv, nc = D / 32, nf = D / 16, nchunks = Hkv / hc, nq = hc * G;
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(+ : failed)")
    for (int item = 0; item < B * nchunks; item++) {
        const int b = item / nchunks, kh0 = (item % nchunks) * hc;
        const int64_t n = ctx[b] > 0 ? ctx[b] : 0;
        float *sc = (float *)malloc(sizeof(float) * ((size_t)nq * (size_t)(n + 2) + (size_t)nq * D));
        if (sc == NULL) { failed++; continue; }
        float *acc = sc + (size_t)nq * (size_t)n, *mx = acc + (size_t)nq * D, *z = mx + nq; /* sc: [nq, n] */
        __m512bh qv[FAST_MAX_Q];
        const uint16_t *qb = q + ((int64_t)b * H + (int64_t)kh0 * G) * D;
        for (int h = 0; h < nq; h++) {
            for (int c = 0; c < nc; c++) qv[h * nc + c] = (__m512bh)_mm512_loadu_si512(qb + h * D + 32 * c);
            mx[h] = -FLT_MAX;
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t slot = tables[(int64_t)b * M + t / bs] * bs + t % bs;
            const uint16_t *kr = k + (slot * Hkv + kh0) * D; /* hc heads, contiguous */
            for (int h = 0; h < nq; h++) {
                const uint16_t *kh = kr + (h / G) * D;
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < nc; c++)
                    a = _mm512_dpbf16_ps(a, qv[h * nc + c], (__m512bh)_mm512_loadu_si512(kh + 32 * c));
                const float s = _mm512_reduce_add_ps(a) * scale;
                sc[h * n + t] = s;
                if (s > mx[h]) mx[h] = s;
            }
        }
        for (int h = 0; h < nq; h++) {
            float *sh = sc + h * n, m = mx[h], zz = 0.f;
            const __m512 mv = _mm512_set1_ps(m);
            __m512 zv = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 live = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
                const __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + t), mv));
                _mm512_mask_storeu_ps(sh + t, live, e);
                zv = _mm512_add_ps(zv, _mm512_maskz_mov_ps(live, e));
            }
            z[h] = zz + _mm512_reduce_add_ps(zv);
        }
        for (int j = 0; j < nq * D; j++) acc[j] = 0.f;
        for (int64_t t = 0; t < n; t++) {
            const int64_t slot = tables[(int64_t)b * M + t / bs] * bs + t % bs;
            const uint16_t *vr = v + (slot * Hkv + kh0) * D;
            for (int h = 0; h < nq; h++) {
                const uint16_t *vh = vr + (h / G) * D;
                const __m512 p = _mm512_set1_ps(sc[h * n + t]);
                float *ah = acc + h * D;
                for (int f = 0; f < nf; f++) {
                    const __m512 vf = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vh + 16 * f))), 16));
                    _mm512_storeu_ps(ah + 16 * f, _mm512_fmadd_ps(p, vf, _mm512_loadu_ps(ah + 16 * f)));
                }
            }
        }
        uint16_t *ob = out + ((int64_t)b * H + (int64_t)kh0 * G) * D;
        for (int h = 0; h < nq; h++) {
            const float inv = z[h] > 0.f ? 1.f / z[h] : 0.f;
            for (int d = 0; d < D; d++) ob[h * D + d] = f2bf(acc[h * D + d] * inv);
        }
        free(sc);
    }
    return failed;
}
#endif
