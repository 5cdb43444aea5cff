/* The AVX-512 paths of the paged decode kernel, included by paged_decode.c when the build has AVX-512
 * (-march=native on such a CPU): fp32 with AVX512F, bf16 with AVX512-BF16. Shapes and layout: see
 * paged_decode.c. Needs D % 16 == 0 (fp32) or D % 32 == 0 (bf16).
 *
 * Same work items and two passes as the other paths, but tokens go in tiles of 16 (their K/V row addresses
 * computed once per tile, shared by every head of the item):
 * - QK: 16 tokens' dot products at once, one 16-lane fp32 accumulator per token (FMA, or vdpbf16ps whose bf16
 *   x bf16 products are exact in fp32), then one transposing reduction (sum16) gives the tile's 16 scores as
 *   one vector: ~3 shuffles/adds a score instead of a horizontal sum per (token, head). In bf16 with G % 4 == 0
 *   (GQA) a KV group's heads at once instead (QK_GROUPED).
 * - PV in fp32: per head and 16 columns, one fp32 accumulator register over the tile's tokens (one load and one
 *   store of the accumulator per tile instead of per token). In bf16: the probabilities rounded to bf16 and PV
 *   over token pairs with vdpbf16ps (paged_decode_pv_bf16.h).
 * Every score and output element is summed in a fixed order that depends only on its own sequence (the tile
 * boundaries are multiples of 16 from its first token), so a sequence's result does not depend on its
 * batchmates (batch invariance), as on the other paths. */
#if defined(__AVX512F__)
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

#define TILE 16
#define NSP(n) (((size_t)(n) + 31) / 32 * 32) /* a head's bf16 probabilities: n rounded up to 32 */
/* 16 bf16 -> 16 fp32 (exact: the bits shifted into the high half). */
static inline __m512 widen_bf16(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
typedef uint32_t __attribute__((may_alias)) u32_alias; /* q's bf16 pairs read as dwords */

/* a[i] -> lane i of the result: the horizontal sum of a[i] (a fixed tree of unpacks, 128-bit shuffles, adds). */
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = a[2i], y = a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: a[4i .. 4i+3]'s partial sums over that lane */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* [c[2i] lanes 0+1, c[2i] lanes 2+3, c[2i+1] lanes 0+1, c[2i+1] lanes 2+3] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The tile's row addresses of tokens t0 .. t0 + m - 1 in pool p (rows past m: the first row, a valid token's, so
 * finite: its scores are masked, and the AMX path multiplies it by probability 0). */
#define TILE_ROWS(row, p, t0, m, pad)                                                                  \
    for (int i = 0; i < ((pad) ? TILE : (m)); i++) {                                                   \
        const int64_t t = (t0) + (i < (m) ? i : 0);                                                    \
        row[i] = (p) + ((tb[t / bs] * bs + t % bs) * Hkv + kh0) * D;                                   \
    }

/* Software prefetch (into L2) of the next tile's rows of KV head kh (tokens t0 .. t0 + TILE - 1, no token past
 * n; D elements a row: 2 lines in bf16 at D = 64), issued as the item's head loop reaches that head: a sequence's
 * blocks lie anywhere in the pool, so the hardware prefetcher, which follows addresses within a page, starts over
 * at every block and the reads wait on memory. Spread so a tile's prefetches go out a few dozen at a time between
 * the arithmetic: one burst of the whole next tile at the top of the tile loop (hc x D a row: 384 lines for the
 * bench preset) fills the line-fill buffers and the loads behind it wait. Inside decode steps (bench preset, bf16,
 * 32 sequences of 300-500 tokens, Xeon model 207 with AMX, interleaved builds) the kernel took 32.1 / 36.3 ms a
 * step with the burst, 30.5 / 34.6 with no prefetch and 27.1 / 28.7 spread like this (the step 54.3 / 58.3 ->
 * 48.7 / 50.7 ms); two tiles ahead: the same as one. Taken by the bf16 path, and by the fp32 one on AMD only
 * (PF = prefetch_f32, paged_decode.c): on Xeons with AMX fp32 rows, twice as long, do better with the hardware
 * prefetcher alone (28.7 -> 31.5 ms a step as one burst a tile, 37.1 -> 39.1 spread), on EPYC Zen 4 the fp32
 * kernel inside bench-preset decode steps went 23.1 -> 19.0 ms with it (the step 67.7 -> 63.3 ms).
 * Where a work item holds every KV head (hc == Hkv), the tile fills rows of one block and the head loop runs inside
 * the tile loop (SHARE: a tile's heads in turn, so that over the loop every line of the tile goes out once), the same
 * number of lines goes out in address order instead (prefetch_seq: the head loop's kh-th share of the tile's
 * contiguous rows), on Intel only: on the AMX Xeon (model 207, huge pages) the bf16 kernel alone over 12 layers' pools 16.76 -> 16.12 and
 * 19.47 -> 18.63 ms (bench preset), 7.06 -> 6.67 ms (1.1B shape, AMX path); on EPYC Zen 4 with huge pages the same
 * order measured 2% slower (docs/BENCHMARKS_HISTORY.md 13m, 13o). */
#define PREFETCH_HEAD(T, p, t0, kh, SHARE) {                                                           \
    if ((SHARE) && prefetch_seq && hc == Hkv && bs % TILE == 0 && (t0) + TILE <= n) {              \
        /* the tile's TILE rows lie back to back in one block (t0 % TILE == 0): the kh-th share of them */ \
        const char *r = (const char *)((p) + (tb[(t0) / bs] * bs + (t0) % bs) * Hkv * D);              \
        for (int o = (kh) * TILE * D * (int)sizeof(T); o < ((kh) + 1) * TILE * D * (int)sizeof(T); o += 64) \
            _mm_prefetch(r + o, _MM_HINT_T1);                                                          \
    } else                                                                                             \
        for (int64_t t = (t0); t < (t0) + TILE && t < n; t++) {                                       \
            const char *r = (const char *)((p) + ((tb[t / bs] * bs + t % bs) * Hkv + kh0 + (kh)) * D); \
            for (int o = 0; o < D * (int)sizeof(T); o += 64) _mm_prefetch(r + o, _MM_HINT_T1);         \
        }                                                                                              \
}

/* The fp32 PV pass of an item: acc[h] += sum over tokens of p[h, t] x V row t, token by token in order (the same
 * sums in the same order whatever GB and CB, so the same bits). GB query heads of one KV group x CB 16-column
 * chunks at a time, GB x CB <= 8 accumulators held in registers: each V row chunk is widened once for the GB
 * heads that share it (GQA), and the GB x CB fma chains are independent (one accumulator at a time waited on
 * its own fma a token). Inside decode steps of the 1.1B shape (GQA 32/4, bf16, 16 x 300-500 tokens, Xeon
 * model 207 with AMX, interleaved builds, two runs) the kernel 19.7 / 21.5 -> 16.7 / 17.1 ms a step; MHA and
 * fp32 unchanged (they wait on memory). */
#define PV_PASS(PF, GB, CB)                                                                           \
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                                                 \
        const int m = n - t0 < TILE ? (int)(n - t0) : TILE;                                                    \
        TILE_ROWS(row, v, t0, m, 0)                                                                            \
        for (int kh = 0; kh < hc; kh++) {                                                                      \
            if (PF) PREFETCH_HEAD(float, v, t0 + TILE, kh, 1)                                                   \
            for (int g0 = 0; g0 < G; g0 += (GB)) {                                                             \
                const float *ph = sc + (int64_t)(kh * G + g0) * n + t0;                                        \
                float *ah = acc + (kh * G + g0) * D;                                                           \
                for (int c0 = 0; c0 < D; c0 += 16 * (CB)) {                                                    \
                    __m512 av[(GB) * (CB)]; /* [g][cc]: head g0 + g, columns c0 + 16 cc .. + 15 */             \
                    for (int j = 0; j < (GB) * (CB); j++)                                                      \
                        av[j] = _mm512_loadu_ps(ah + j / (CB) * D + c0 + 16 * (j % (CB)));                     \
                    for (int i = 0; i < m; i++) {                                                              \
                        const float *vr = row[i] + kh * D + c0;                                                \
                        __m512 vv[CB];                                                                         \
                        for (int cc = 0; cc < (CB); cc++) vv[cc] = _mm512_loadu_ps(vr + 16 * cc);              \
                        for (int j = 0; j < (GB) * (CB); j++)                                                  \
                            av[j] = _mm512_fmadd_ps(_mm512_set1_ps(ph[j / (CB) * n + i]), vv[j % (CB)], av[j]);\
                    }                                                                                          \
                    for (int j = 0; j < (GB) * (CB); j++)                                                      \
                        _mm512_storeu_ps(ah + j / (CB) * D + c0 + 16 * (j % (CB)), av[j]);                     \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }

/* fp32: softmax in place in sc (z: each head's sum), then PV_PASS. */
#define TAIL_F32(PF)                                                                                   \
    if (PF) /* the first V tile, during the softmax */                                                 \
        for (int kh = 0; kh < hc; kh++) PREFETCH_HEAD(float, v, 0, kh, 1)                              \
    for (int h = 0; h < nq; h++) {                                                                     \
        float *sh = sc + h * n;                                                                        \
        const __m512 mv = _mm512_set1_ps(mx[h]);                                                       \
        __m512 zv = _mm512_setzero_ps();                                                               \
        for (int64_t t = 0; t < n; t += 16) {                                                          \
            const __mmask16 live = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1); \
            const __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + t), mv));             \
            _mm512_mask_storeu_ps(sh + t, live, e);                                                    \
            zv = _mm512_add_ps(zv, _mm512_maskz_mov_ps(live, e));                                      \
        }                                                                                              \
        z[h] = _mm512_reduce_add_ps(zv);                                                               \
    }                                                                                                  \
    if (G % 8 == 0) PV_PASS(PF, 8, 1)                                                                      \
    else if (G % 4 == 0 && D % 32 == 0) PV_PASS(PF, 4, 2)                                                  \
    else if (G % 2 == 0 && D % 64 == 0) PV_PASS(PF, 2, 4)                                                  \
    else if (D % 64 == 0) PV_PASS(PF, 1, 4)                                                                \
    else PV_PASS(PF, 1, 1)

/* 16 x 16 dwords transposed in place: r[i] = row i -> r[c] = column c (lane i: dword c of row i). */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + j], 128-bit lane L: dword 4L + j of rows 4i .. 4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* the 4 x 4 transpose of 128-bit lanes among r[j], r[4 + j], r[8 + j], r[12 + j] */
        const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        r[j] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + j] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + j] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* Scores of head h over the tile (s: 16 lanes, one a token), scaled, stored, and the head's running max. */
#define QK_SCORES(h, s)                                                                                \
    {                                                                                                  \
        const __m512 sh_ = _mm512_mul_ps((s), sv);                                                     \
        _mm512_mask_storeu_ps(sc + (h) * n + t0, live, sh_);                                           \
        const float tm = _mm512_mask_reduce_max_ps(live, sh_);                                         \
        if (tm > mx[(h)]) mx[(h)] = tm;                                                                \
    }

/* QK of KV head kh's G query heads over the tile, GB heads at a time, lanes = tokens (bf16, GQA): the tile's K
 * rows transposed 16 dwords (32 elements) at a time, then per dword column one vdpbf16ps per head with that
 * head's dword of q broadcast. One transpose serves GB heads and no per-head reduction is left, where the
 * QK_STEP loop re-reads each K row per head and reduces 16 accumulators per head (sum16): inside decode steps of
 * the 1.1B shape (GQA 32/4, 16 x 300-500 tokens, Xeon model 207, AMX path capped off, interleaved builds) the
 * kernel 18.3 -> 16.8 ms a step. In fp32, which waits on memory, it is slower: not taken there. */
#define QK_GROUPED(QKT, GB)                                                                            \
    for (int g0 = 0; g0 < G; g0 += (GB)) {                                                             \
        const int W = D / 2; /* dwords a row */                                                        \
        const u32_alias *qg = (const u32_alias *)(qb + (int64_t)(kh * G + g0) * D);                    \
        __m512 s[GB];                                                                                  \
        for (int j = 0; j < (GB); j++) s[j] = _mm512_setzero_ps();                                     \
        for (int w0 = 0; w0 < W; w0 += 16) {                                                           \
            __m512i o[16];                                                                             \
            for (int i = 0; i < TILE; i++) o[i] = _mm512_loadu_si512((const uint32_t *)(row[i] + kh * D) + w0); \
            transpose16(o);                                                                            \
            for (int c = 0; c < 16; c++)                                                               \
                for (int j = 0; j < (GB); j++) s[j] = QKT(s[j], qg[j * W + w0 + c], o[c]);             \
        }                                                                                              \
        for (int j = 0; j < (GB); j++) QK_SCORES(kh * G + g0 + j, s[j])                                \
    }

/* One work item: sequence b, KV heads kh0 .. kh0 + hc - 1. QW: elements of one QK step (QK_STEP(a, q, k)
 * adds q[0 .. QW) . k[0 .. QW) into the 16 lanes of a); GQ: 1 to take QK_GROUPED (with QKT as its step) where
 * G % 4 == 0, 0 for the QK_STEP loop at every G; PF: nonzero to prefetch the next tile as the head loop goes
 * (PREFETCH_HEAD); TAIL: softmax and PV (TAIL_F32, TAIL_BF16). Scratch: the scores sc [nq, n], acc [nq, D], mx and
 * z [nq], then (bf16) the probabilities [nq, NSP(n)]. Returns 1 if its scratch could not be allocated. */
#define DEFINE_AVX512_ITEM(NAME, T, QW, QK_STEP, GQ, QKT, STORE, PF, TAIL)                                  \
static int NAME(const T *q, const T *k, const T *v, const int64_t *tables, const int64_t *ctx, T *out,  \
                int b, int kh0, int H, int Hkv, int D, int bs, int M, float scale, int hc) {            \
    const int G = H / Hkv, nq = hc * G;                                                                \
    const int64_t n = ctx[b] > 0 ? ctx[b] : 0;                                                         \
    const size_t pbf_ = sizeof(T) == 2 ? NSP(n) / 2 : 0; /* floats a head for bf16 probabilities */     \
    float *sc = (float *)malloc(sizeof(float) * ((size_t)nq * ((size_t)n + 2 + (size_t)D + pbf_)));              \
    if (sc == NULL) return 1;                                                                          \
    float *acc = sc + (size_t)nq * (size_t)n, *mx = acc + (size_t)nq * D, *z = mx + nq; /* sc: [nq, n] */ \
    const T *qb = q + ((int64_t)b * H + (int64_t)kh0 * G) * D;                                         \
    for (int j = 0; j < nq * D; j++) acc[j] = 0.f;                                                     \
    for (int h = 0; h < nq; h++) mx[h] = -FLT_MAX;                                                     \
    const int64_t *tb = tables + (int64_t)b * M;                                                       \
    const T *row[TILE];                                                                                \
    const __m512 sv = _mm512_set1_ps(scale);                                                           \
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {                                                         \
        const int m = n - t0 < TILE ? (int)(n - t0) : TILE;                                            \
        TILE_ROWS(row, k, t0, m, 1)                                                                    \
        const __mmask16 live = (__mmask16)((1u << m) - 1);                                             \
        for (int kh = 0; kh < hc; kh++) {                                                              \
            if (PF) PREFETCH_HEAD(T, k, t0 + TILE, kh, 1)                                              \
            if (GQ && G % 8 == 0) QK_GROUPED(QKT, 8)                                                   \
            else if (GQ && G % 4 == 0) QK_GROUPED(QKT, 4)                                              \
            else for (int h = kh * G; h < (kh + 1) * G; h++) {                                         \
                const T *qh = qb + h * D;                                                              \
                __m512 a[TILE];                                                                        \
                for (int i = 0; i < TILE; i++) a[i] = _mm512_setzero_ps();                             \
                for (int c = 0; c < D; c += QW) {                                                      \
                    _Pragma("GCC unroll 16")                                                           \
                    for (int i = 0; i < TILE; i++) a[i] = QK_STEP(a[i], qh + c, row[i] + kh * D + c);   \
                }                                                                                      \
                QK_SCORES(h, sum16(a))                                                                 \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    TAIL(PF)                                                                                           \
    WRITE_OUT(T, STORE, acc, z) /* paged_decode.c */                                                   \
    free(sc);                                                                                          \
    return 0;                                                                                          \
}

#define QK_F32(a, qp, kp) _mm512_fmadd_ps(_mm512_loadu_ps(qp), _mm512_loadu_ps(kp), a)
#define QKT_NONE(a, qd, kt) (a) /* GQ = 0: never taken */
DEFINE_AVX512_ITEM(avx512_item_f32, float, 16, QK_F32, 0, QKT_NONE, ID, prefetch_f32, TAIL_F32)
DEFINE_ITEM_KERNEL(avx512_f32, avx512_item_f32, float) /* paged_decode.c */
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define QKT_BF16(a, qd, kt) _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32((int)(qd)), (__m512bh)(kt))
#define QK_BF16(a, qp, kp) _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qp), (__m512bh)_mm512_loadu_si512(kp))
#include "paged_decode_pv_bf16.h" /* TAIL_BF16 */
DEFINE_AVX512_ITEM(avx512_item_bf16, uint16_t, 32, QK_BF16, 1, QKT_BF16, f2bf, 1, TAIL_BF16)
DEFINE_ITEM_KERNEL(avx512_bf16, avx512_item_bf16, uint16_t)
#endif
