/* The AMX path of the paged decode kernel (bf16; CPUs with AMX-BF16), included by paged_decode.c after the
 * AVX-512 paths (it uses their vexp, widen_bf16, transpose16, TILE_ROWS, PREFETCH_HEAD and probs_bf16). Shapes
 * and layout: see paged_decode.c. Taken (path() in paged_decode.c) for 4 <= G <= 16 query heads per KV head,
 * D % 64 == 0, D <= 256, where this process was granted the AMX tile data: a property of the process, so every
 * worker on one machine kind takes the same path and gives the same bits.
 *
 * Why: on the AVX-512 path a GQA model's attention spends about half its time on arithmetic (the QK pass one
 * vdpbf16ps per 32 multiply-adds, the PV pass one fp32 FMA per 16): the 1.1B shape's kernel took 14-18 ms a
 * decode step for ~140 MB of K/V, ~6 ms at the read bandwidth. Here both passes are tile matmuls per KV head
 * over its G query heads:
 * - QK, per 16-token tile: S [G x 16] += Q [G x 32 d] . K^T, the B tile (VNNI: row r = the d pair 2r, 2r + 1 of
 *   each of the 16 tokens) made from the K rows by a 16 x 16 dword transpose; scores land in sc [nq, ns].
 * - softmax per head in fp32; the probabilities rounded to bf16 (the A operand must be bf16; FlashAttention
 *   and vLLM's CPU kernels do the same) and z summed from the rounded values, so numerator and denominator
 *   agree.
 * - PV, per 32 tokens: O [G x 64 columns] (four fp32 tiles, in registers over all tokens) += P [G x 32] . V,
 *   each B tile (row r = tokens 2r, 2r + 1 of 16 columns) made from two V rows by one unpack: column c of B
 *   tile j is output column 32 (j / 2) + 8 (c / 4) + 4 (j % 2) + c % 4 of the 64, undone once at the end.
 * Every sum depends only on its own sequence (tiles start at its first token), so results are batch-invariant
 * as on the other paths, but not the bits of the AVX-512 path (other summation order, bf16 probabilities). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX_PATH 1
#include "amx_tile.h"

/* tmm0-3: O [G x 16 columns] fp32; tmm4: S [G x 16 tokens] fp32; tmm5: A [G x 32] bf16 (Q or P rows); tmm6: B
 * [16 pairs x 16 columns] bf16 (VNNI). Per thread; amx_linear.c configures its own on each call. */
static void amx_config(int G) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) { cfg.rows[t] = (uint8_t)G; cfg.colsb[t] = 64; }
    cfg.rows[6] = 16; cfg.colsb[6] = 64;
    _tile_loadconfig(&cfg);
}

/* The V rows of tokens 2r, 2r + 1 (r < 16) of a 32-token step: row[] for the first 16, row2[] the next. */
#define V_PAIR(r, i) ((r) < 8 ? row[2 * (r) + (i)] : row2[2 * (r) - 16 + (i)])

static int amx_item(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *tables, const int64_t *ctx,
                    uint16_t *out, int b, int kh0, int H, int Hkv, int D, int bs, int M, float scale, int hc) {
    const int G = H / Hkv, nq = hc * G;
    const int64_t n = ctx[b] > 0 ? ctx[b] : 0, ns = (n + 31) / 32 * 32; /* rows of sc and pb: ns, 0 past n */
    float *sc = (float *)malloc((size_t)nq * ((size_t)ns * 6 + (size_t)D * 4 + 4));
    if (sc == NULL) return 1;
    uint16_t *pb = (uint16_t *)(sc + (size_t)nq * ns); /* [nq, ns] bf16 */
    float *acc = (float *)(pb + (size_t)nq * ns), *z = acc + (size_t)nq * D;
    uint32_t kt[8 * 256] __attribute__((aligned(64))); /* D / 32 transposed 16 x 16 dword blocks of K */
    uint32_t vb[4 * 256] __attribute__((aligned(64))); /* the four B tiles of V */
    float cb[4 * 256] __attribute__((aligned(64)));    /* O tiles stored: [j][g][c] */
    const uint16_t *qb = q + ((int64_t)b * H + (int64_t)kh0 * G) * D;
    const int64_t *tb = tables + (int64_t)b * M;
    const uint16_t *row[TILE], *row2[TILE];
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int m = n - t0 < TILE ? (int)(n - t0) : TILE;
        TILE_ROWS(row, k, t0, m, 1)
        for (int kh = 0; kh < hc; kh++) {
            PREFETCH_HEAD(uint16_t, k, t0 + TILE, kh, 1)
            for (int w = 0; w < D / 32; w++) {
                __m512i o[16];
                for (int i = 0; i < TILE; i++) o[i] = _mm512_loadu_si512(row[i] + kh * D + 32 * w);
                transpose16(o);
                for (int i = 0; i < 16; i++) _mm512_store_si512(kt + w * 256 + 16 * i, o[i]);
            }
            _tile_zero(4);
            for (int w = 0; w < D / 32; w++) {
                _tile_loadd(5, qb + (int64_t)kh * G * D + 32 * w, D * 2);
                _tile_loadd(6, kt + w * 256, 64);
                _tile_dpbf16ps(4, 5, 6);
            }
            _tile_stored(4, sc + (int64_t)kh * G * ns + t0, ns * 4);
        }
    }
    for (int kh = 0; kh < hc; kh++) PREFETCH_HEAD(uint16_t, v, 0, kh, 1) /* the first V tile, during the softmax */
    const __m512 sv = _mm512_set1_ps(scale);
    for (int h = 0; h < nq; h++) {
        float *sh = sc + h * ns;
        uint16_t *ph = pb + h * ns;
        __m512 mv = _mm512_set1_ps(-FLT_MAX);
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 live = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
            const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sh + t), sv);
            _mm512_storeu_ps(sh + t, s);
            mv = _mm512_mask_max_ps(mv, live, mv, s);
        }
        z[h] = probs_bf16(sh, _mm512_reduce_max_ps(mv), n, ns, ph);
    }
    for (int kh = 0; kh < hc; kh++)
        for (int c0 = 0; c0 < D; c0 += 64) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t t0 = 0; t0 < n; t0 += 2 * TILE) {
                const int m = n - t0 < TILE ? (int)(n - t0) : TILE;
                TILE_ROWS(row, v, t0, m, 1)
                if (t0 + TILE < n) {
                    const int m2 = n - t0 - TILE < TILE ? (int)(n - t0 - TILE) : TILE;
                    TILE_ROWS(row2, v, t0 + TILE, m2, 1)
                } else
                    for (int i = 0; i < TILE; i++) row2[i] = row[0]; /* past n: probability 0, any finite row */
                PREFETCH_HEAD(uint16_t, v, t0 + 2 * TILE, kh, 0) /* one head over every tile: its own rows */
                PREFETCH_HEAD(uint16_t, v, t0 + 3 * TILE, kh, 0)
                for (int r = 0; r < 16; r++)
                    for (int half = 0; half < 2; half++) {
                        const int off = kh * D + c0 + 32 * half;
                        const __m512i a = _mm512_loadu_si512(V_PAIR(r, 0) + off), c = _mm512_loadu_si512(V_PAIR(r, 1) + off);
                        _mm512_store_si512(vb + (2 * half) * 256 + 16 * r, _mm512_unpacklo_epi16(a, c));
                        _mm512_store_si512(vb + (2 * half + 1) * 256 + 16 * r, _mm512_unpackhi_epi16(a, c));
                    }
                _tile_loadd(5, pb + (int64_t)kh * G * ns + t0, ns * 2);
                _tile_loadd(6, vb, 64); _tile_dpbf16ps(0, 5, 6);
                _tile_loadd(6, vb + 256, 64); _tile_dpbf16ps(1, 5, 6);
                _tile_loadd(6, vb + 512, 64); _tile_dpbf16ps(2, 5, 6);
                _tile_loadd(6, vb + 768, 64); _tile_dpbf16ps(3, 5, 6);
            }
            _tile_stored(0, cb, 64); _tile_stored(1, cb + 256, 64);
            _tile_stored(2, cb + 512, 64); _tile_stored(3, cb + 768, 64);
            for (int j = 0; j < 4; j++)
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < 16; c++)
                        acc[(kh * G + g) * D + c0 + 32 * (j / 2) + 8 * (c / 4) + 4 * (j % 2) + c % 4] = cb[j * 256 + g * 16 + c];
        }
    WRITE_OUT(uint16_t, f2bf, acc, z) /* paged_decode.c */
    free(sc);
    return 0;
}

static int amx_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *tables, const int64_t *ctx,
                    uint16_t *out, int B, int H, int Hkv, int D, int bs, int M, float scale, int hc, int nthreads) {
    const int nchunks = Hkv / hc;
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        amx_config(H / Hkv);
        _Pragma("omp for schedule(dynamic, 1) reduction(+ : failed)")
        for (int item = 0; item < B * nchunks; item++)
            failed += amx_item(q, k, v, tables, ctx, out, item / nchunks, (item % nchunks) * hc, H, Hkv, D, bs, M,
                               scale, hc);
        _tile_release();
    }
    return failed;
}

/* Whether this process may use AMX tile data (asked once, in paged_decode_init). */
static int amx_granted(void) { return amx_request() == 0; }
#else
#define HAVE_AMX_PATH 0
#endif
