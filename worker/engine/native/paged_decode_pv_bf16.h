/* The bf16 softmax and PV of the AVX-512 path (AVX512-BF16 builds), included by paged_decode_avx512.h, whose item
 * (DEFINE_AVX512_ITEM) supplies sc (scaled scores [nq, n]), mx, z, acc, row[], tb and the shapes.
 *
 * The probabilities are rounded to bf16 (as on the AMX path, in FlashAttention and in vLLM's CPU kernels; z is
 * summed from the rounded values, so numerator and denominator agree), which lets PV run on vdpbf16ps over token
 * pairs: per 32 columns, V rows t and t + 1 interleaved by one unpack per half, times the pair (p_t, p_t+1)
 * broadcast as one dword. 7 instructions per token and head at D = 64 where widening each V element to fp32 and
 * one FMA per 16 took 17. Kernel alone (EPYC Zen 4, 2 threads, interleaved, K/V from memory): bench preset 32 x 300
 * 4-12% faster, the 1.1B shape (GQA 32/4) 5-10%; inside decode steps 2-4% (bench preset, K/V read from memory).
 * Column order: dword k of the low half's accumulator is column 8 (k / 4) + k % 4 of those 32, of the high half's
 * that + 4 (unpacklo / unpackhi work per 128-bit lane); acc keeps that order until the end of the item. Tokens are
 * summed in pairs from the sequence's first token, so the order depends only on the sequence (batch invariance). */
/* A head's probabilities: exp(s[t] - m) for t < n rounded to bf16 into p[0, ns) (0 from n on; ns a multiple of
 * 32). Returns their sum, of the rounded values. Shared with the AMX path (paged_decode_amx.h). */
static inline float probs_bf16(const float *s, float m, int64_t n, int64_t ns, uint16_t *p) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 zv = _mm512_setzero_ps();
    for (int64_t t = 0; t < ns; t += 32) {
        __m512 e[2];
        for (int i = 0; i < 2; i++) {
            const int64_t ti = t + 16 * i;
            const __mmask16 live = n - ti >= 16 ? (__mmask16)0xffff
                                   : (n > ti ? (__mmask16)((1u << (n - ti)) - 1) : (__mmask16)0);
            e[i] = _mm512_maskz_mov_ps(live, vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + ti), mv)));
        }
        const __m512i pv = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]); /* tokens t .. t + 31 */
        _mm512_storeu_si512(p + t, pv);
        zv = _mm512_add_ps(zv, widen_bf16(_mm512_castsi512_si256(pv)));
        zv = _mm512_add_ps(zv, widen_bf16(_mm512_extracti64x4_epi64(pv, 1)));
    }
    return _mm512_reduce_add_ps(zv);
}

#define PV_PAIRS(GB) /* GB query heads of one KV group at a time: 2 GB accumulators per 32 columns */         \
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                                         \
        const int m = n - t0 < TILE ? (int)(n - t0) : TILE;                                            \
        TILE_ROWS(row, v, t0, m, 1) /* row m (odd m): a valid token's, times probability 0 */         \
        for (int kh = 0; kh < hc; kh++) {                                                              \
            PREFETCH_HEAD(uint16_t, v, t0 + TILE, kh, 1)                                               \
            for (int g0 = 0; g0 < G; g0 += (GB)) {                                                     \
                const u32_alias *pp = (const u32_alias *)(pb + (int64_t)(kh * G + g0) * ns + t0);      \
                float *ah = acc + (kh * G + g0) * D;                                                   \
                for (int c0 = 0; c0 < D; c0 += 32) {                                                   \
                    __m512 lo[GB], hi[GB];                                                             \
                    for (int j = 0; j < (GB); j++) {                                                   \
                        lo[j] = _mm512_loadu_ps(ah + j * D + c0);                                      \
                        hi[j] = _mm512_loadu_ps(ah + j * D + c0 + 16);                                 \
                    }                                                                                  \
                    for (int i = 0; i < m; i += 2) {                                                   \
                        const __m512i a = _mm512_loadu_si512(row[i] + kh * D + c0);                    \
                        const __m512i c = _mm512_loadu_si512(row[i + 1] + kh * D + c0);                \
                        const __m512bh ul = (__m512bh)_mm512_unpacklo_epi16(a, c);                     \
                        const __m512bh uh = (__m512bh)_mm512_unpackhi_epi16(a, c);                     \
                        for (int j = 0; j < (GB); j++) {                                               \
                            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[j * (ns / 2) + i / 2]); \
                            lo[j] = _mm512_dpbf16_ps(lo[j], ul, p);                                    \
                            hi[j] = _mm512_dpbf16_ps(hi[j], uh, p);                                    \
                        }                                                                              \
                    }                                                                                  \
                    for (int j = 0; j < (GB); j++) {                                                   \
                        _mm512_storeu_ps(ah + j * D + c0, lo[j]);                                      \
                        _mm512_storeu_ps(ah + j * D + c0 + 16, hi[j]);                                 \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }

/* Softmax into bf16 probabilities pb [nq, ns] (0 past n), PV_PAIRS, then acc's columns back in order. */
#define TAIL_BF16(PF) /* PF: unused, the bf16 path always prefetches */                          \
    const int64_t ns = (int64_t)NSP(n);                                                                \
    uint16_t *pb = (uint16_t *)(z + nq);                                                               \
    for (int kh = 0; kh < hc; kh++) PREFETCH_HEAD(uint16_t, v, 0, kh, 1) /* the first V tile */        \
    for (int h = 0; h < nq; h++) z[h] = probs_bf16(sc + h * n, mx[h], n, ns, pb + h * ns);            \
    if (G % 8 == 0) PV_PAIRS(8)                                                                        \
    else if (G % 4 == 0) PV_PAIRS(4)                                                                   \
    else if (G % 2 == 0) PV_PAIRS(2)                                                                   \
    else PV_PAIRS(1)                                                                                   \
    for (int h = 0; h < nq; h++)                                                                       \
        for (int c0 = 0; c0 < D; c0 += 32) {                                                           \
            float tmp[32];                                                                             \
            for (int k = 0; k < 16; k++) {                                                             \
                tmp[8 * (k / 4) + k % 4] = acc[h * D + c0 + k];                                        \
                tmp[8 * (k / 4) + 4 + k % 4] = acc[h * D + c0 + 16 + k];                               \
            }                                                                                          \
            memcpy(acc + h * D + c0, tmp, sizeof tmp);                                                 \
        }
