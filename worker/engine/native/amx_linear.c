/* bf16 linear layers on AMX tiles (Intel Xeon with AMX-BF16): y = x @ w.T, batch-invariant by construction.
 * Built at runtime by cpu_kernel.py (gcc -O3 -march=native -fopenmp), called via ctypes; linear.py uses it.
 *
 * Why: oneDNN's bf16 kernels on AMX give a row other bits in calls of more than 32 rows, so batch invariance
 * cut every prefill matmul into 32-row calls, where oneDNN reaches a third of its large-call speed. Here every
 * output element is the same sum in the same order whatever the row count, the row's position or the thread
 * count: fp32 tiles accumulate K in steps of 32 (one TDPBF16PS each, in order), rows never interact, threads
 * split the output columns. So one call of any number of rows gives each row the bits it gets alone.
 *
 * x:      [M, K] bf16, row-major          w packed (amx_pack): [N / 16][K / 32][16][32] bf16, each 16 x 32 block
 * out:    [M, N] bf16                      the VNNI tile of columns n0..n0+15 and K k0..k0+31 (row r: K pairs 2r,
 * res:    [M, N] bf16 or NULL (out = res + y, rounded as torch's add of two bf16 tensors)   2r+1 of each column)
 * Needs N % 32 == 0 and K % 32 == 0 (linear.py checks); M >= 1 (rows past M in the last 16-row tile are zeros). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tile.h"

#define MB 128 /* rows per chunk: a chunk of x stays in L2 while each thread's column blocks pass over it */

/* The process's permission to use AMX tile data (Linux >= 5.16); 0 when granted. */
int amx_init(void) { return amx_request(); }

void amx_pack(const uint16_t *w, uint16_t *p, int N, int K) {
    for (int n0 = 0; n0 < N; n0 += 16)
        for (int k0 = 0; k0 < K; k0 += 32) {
            uint16_t *t = p + ((int64_t)(n0 / 16) * (K / 32) + k0 / 32) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    t[r * 32 + 2 * c] = w[(int64_t)(n0 + c) * K + k0 + 2 * r];
                    t[r * 32 + 2 * c + 1] = w[(int64_t)(n0 + c) * K + k0 + 2 * r + 1];
                }
        }
}

static void config(void) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; } /* C: 16 x 16 fp32, A: 16 x 32 bf16, B: VNNI */
    _tile_loadconfig(&cfg);
}

/* 16 bf16 -> 16 fp32 (exact). */
static inline __m512 widen16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

/* fp32 tile rows -> bf16 out rows (rows < m only), plus the residual as torch adds two bf16 tensors. */
static void write_rows(const float *c, uint16_t *out, const uint16_t *res, int64_t ld, int m) {
    for (int r = 0; r < m; r++) {
        __m512 v = _mm512_loadu_ps(c + r * 16);
        if (res != NULL) /* y rounded to bf16 first, then the sum in fp32 rounded again */
            v = _mm512_add_ps(widen16(_mm256_loadu_si256((const __m256i *)(res + r * ld))),
                              widen16((__m256i)_mm512_cvtneps_pbh(v)));
        _mm256_storeu_si256((__m256i *)(out + r * ld), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Rows m0 .. m0 + 31 (2 A tiles; the second unused when rows <= 16) x columns n0 .. n0 + 31 (2 B tiles). */
#define TILE_BLOCK(TWO_M)                                                                              \
    {                                                                                                  \
        _tile_zero(0); _tile_zero(1);                                                                  \
        if (TWO_M) { _tile_zero(2); _tile_zero(3); }                                                   \
        const uint16_t *b0 = wp + (int64_t)(n0 / 16) * kt * 512, *b1 = b0 + (int64_t)kt * 512;         \
        for (int k = 0; k < kt; k++) {                                                                 \
            _tile_loadd(4, a0 + k * 32, lda);                                                          \
            _tile_loadd(6, b0 + k * 512, 64);                                                          \
            _tile_loadd(7, b1 + k * 512, 64);                                                          \
            _tile_dpbf16ps(0, 4, 6);                                                                   \
            _tile_dpbf16ps(1, 4, 7);                                                                   \
            if (TWO_M) {                                                                               \
                _tile_loadd(5, a1 + k * 32, lda);                                                      \
                _tile_dpbf16ps(2, 5, 6);                                                               \
                _tile_dpbf16ps(3, 5, 7);                                                               \
            }                                                                                          \
        }                                                                                              \
        _tile_stored(0, cbuf, 64); _tile_stored(1, cbuf + 256, 64);                                    \
        if (TWO_M) { _tile_stored(2, cbuf + 512, 64); _tile_stored(3, cbuf + 768, 64); }               \
    }

int amx_linear(const uint16_t *x, const uint16_t *wp, const uint16_t *res, uint16_t *out, int M, int N, int K,
               int nthreads) {
    const int kt = K / 32, mfull = M / 16 * 16, tail = M - mfull;
    uint16_t *pad = NULL; /* the last rows, zero-padded to a whole 16-row tile (a tile load reads 16 rows) */
    if (tail) {
        pad = (uint16_t *)calloc((size_t)16 * K, sizeof(uint16_t));
        if (pad == NULL) return 1;
        memcpy(pad, x + (int64_t)mfull * K, (size_t)tail * K * sizeof(uint16_t));
    }
    const int nb = N / 32; /* column blocks of 32 */
    _Pragma("omp parallel num_threads(nthreads)")
    {
        config();
        float cbuf[1024] __attribute__((aligned(64)));
        for (int c0 = 0; c0 < M; c0 += MB) {
            const int c1 = c0 + MB < M ? c0 + MB : M;
            _Pragma("omp for schedule(static)")
            for (int j = 0; j < nb; j++) {
                const int n0 = j * 32;
                for (int m0 = c0; m0 < c1; m0 += 32) {
                    const uint16_t *a0 = m0 < mfull ? x + (int64_t)m0 * K : pad, *a1;
                    const int m1 = m0 + 16;
                    a1 = m1 < mfull ? x + (int64_t)m1 * K : pad;
                    const int64_t lda = (int64_t)K * 2;
                    const int rows0 = m0 + 16 <= M ? 16 : M - m0, rows1 = m1 >= M ? 0 : (m1 + 16 <= M ? 16 : M - m1);
                    if (rows1 > 0) TILE_BLOCK(1) else TILE_BLOCK(0)
                    for (int h = 0; h < 2; h++) {
                        write_rows(cbuf + h * 256, out + (int64_t)m0 * N + n0 + h * 16,
                                   res ? res + (int64_t)m0 * N + n0 + h * 16 : NULL, N, rows0);
                        if (rows1 > 0)
                            write_rows(cbuf + 512 + h * 256, out + (int64_t)m1 * N + n0 + h * 16,
                                       res ? res + (int64_t)m1 * N + n0 + h * 16 : NULL, N, rows1);
                    }
                }
            }
        }
        _tile_release();
    }
    free(pad);
    return 0;
}
