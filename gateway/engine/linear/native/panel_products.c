/* kvgate's row-invariant matrix product: y = x W^T (+ bias), W kept in panels of 16 columns.

Why a kernel of our own: a library's product (oneDNN, MKL) picks its kernel by the row count,
and another kernel may sum in another order, so a row kept its bits only from 2 rows up
(oneDNN) or 4 (MKL), and a decode step of one user multiplied 2 or 4 rows. Here the arithmetic
of an output number is fixed by construction: y[m][n] is

    acc = 0; for k = 0 .. K-1 in order: acc = fma(x[m][k], W[n][k], acc);  y = acc (+ bias[n])

one fused multiply-add per k, in order, whatever the row count, the tile a row lands in, the
thread that computes it or the vector width. A row's numbers are therefore its own (no padding
is needed: one row is multiplied as one row), and the same on every machine: fused multiply-add
is exactly rounded by definition, so the AVX-512, AVX2 and portable builds give the same bits
(only the speed differs). Compiled with -ffp-contract=off and without -ffast-math.

The layout: W [N][K] is stored as ceil(N / 16) panels, panel p holding columns 16p .. 16p+15
for every k, k-major: panels[p][k][c] = W[16p + c][k] (zero past N). A tile of R rows and C
panels keeps R x C x 16 accumulators in registers and reads each panel once, sequentially: a
step of few rows streams the weights from memory once, which is all a decode step is.
*/
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kvgate_lanes.h"

#define PANEL 16
#define MAX_PANELS 4

/* Reading ahead. A step of few rows streams every weight from memory once, and a tile's loop
   does too little work per byte for the CPU's own prefetcher to keep the stream going: measured
   on an Intel Xeon (2 cores), the bfloat16 weights of a 30-layer model read at 10 GB/s by a tile
   of 8 rows against 19 at one row. Asking for the next lines while the current ones are
   multiplied brought 8 rows to 15-16 GB/s. Speed only: what is read and computed is unchanged
   (a prefetch past the end of the weights reads nothing and cannot fault). fetch_ahead is
   always inlined: called, it made the compiler spill every accumulator around the call (the
   vector registers are the caller's to save), and the read-ahead gained nothing. */
#define WHOLE_AHEAD 32 /* inputs ahead in a whole panel (2 KB: one line an input) */

static inline __attribute__((always_inline)) void fetch_ahead(const void *start, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64)
        __builtin_prefetch((const char *)start + line, 0, 3);
}

#ifdef __AVX512F__
/* Tiles of up to 12 rows: 12 accumulators of 16 lanes, one panel's row of W, one x. */
#define MAX_ROWS 12
#else
/* Tiles of up to 6 rows: 12 accumulators of 8 lanes, two for each row of a panel. */
#define MAX_ROWS 6
#endif

/* The tile's sums stored: whole panels straight into y, the last one cut at N. */
static inline void store_tile(float out[MAX_ROWS][MAX_PANELS][PANEL], int R, int C,
                              const float *bias, float *y, int64_t y_stride, int64_t cols_left) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C && c * PANEL < cols_left; c++) {
            const int64_t n = cols_left - c * PANEL < PANEL ? cols_left - c * PANEL : PANEL;
            float *dst = y + r * y_stride + c * PANEL;
            if (bias == NULL)
                memcpy(dst, out[r][c], sizeof(float) * (size_t)n);
            else
                for (int64_t i = 0; i < n; i++) dst[i] = out[r][c][i] + bias[c * PANEL + i];
        }
}

/* A tile's 8-lane accumulators (two a panel's row) stored by store_tile. */
static inline __attribute__((always_inline)) void store_acc8(
        v8 acc[MAX_ROWS][MAX_PANELS][2], int R, int C, const float *bias, float *y,
        int64_t y_stride, int64_t cols_left) {
    float out[MAX_ROWS][MAX_PANELS][PANEL];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            memcpy(out[r][c], &acc[r][c][0], sizeof acc[r][c][0]);
            memcpy(out[r][c] + 8, &acc[r][c][1], sizeof acc[r][c][1]);
        }
    store_tile(out, R, C, bias, y, y_stride, cols_left);
}

#ifdef __AVX512F__
/* A tile's 16-lane accumulators (one a panel's row) stored by store_tile. */
static inline __attribute__((always_inline)) void store_acc16(
        v16 acc[MAX_ROWS][MAX_PANELS], int R, int C, const float *bias, float *y,
        int64_t y_stride, int64_t cols_left) {
    float out[MAX_ROWS][MAX_PANELS][PANEL];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) memcpy(out[r][c], &acc[r][c], sizeof acc[r][c]);
    store_tile(out, R, C, bias, y, y_stride, cols_left);
}
#endif

/* R rows x C panels with 8-lane vectors (R, C constants where it is inlined). */
static inline __attribute__((always_inline)) void tile8(
        const int R, const int C, const float *x, int64_t x_stride, const float *panels,
        int64_t K, const float *bias, float *y, int64_t y_stride, int64_t cols_left) {
    v8 acc[MAX_ROWS][MAX_PANELS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = splat8(0.0f);
    for (int64_t k = 0; k < K; k++) {
        v8 w[MAX_PANELS][2];
        for (int c = 0; c < C; c++) __builtin_prefetch(panels + (c * K + k + WHOLE_AHEAD) * PANEL, 0, 3);
        for (int c = 0; c < C; c++) {
            w[c][0] = load8(panels + (c * K + k) * PANEL);
            w[c][1] = load8(panels + (c * K + k) * PANEL + 8);
        }
        for (int r = 0; r < R; r++) {
            const v8 xr = splat8(x[r * x_stride + k]);
            for (int c = 0; c < C; c++) {
                acc[r][c][0] = fma8(xr, w[c][0], acc[r][c][0]);
                acc[r][c][1] = fma8(xr, w[c][1], acc[r][c][1]);
            }
        }
    }
    store_acc8(acc, R, C, bias, y, y_stride, cols_left);
}

#ifdef __AVX512F__
/* R rows x C panels with 16-lane vectors: the same operations per number as tile8. */
static inline __attribute__((always_inline)) void tile16(
        const int R, const int C, const float *x, int64_t x_stride, const float *panels,
        int64_t K, const float *bias, float *y, int64_t y_stride, int64_t cols_left) {
    v16 acc[MAX_ROWS][MAX_PANELS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = splat16(0.0f);
    for (int64_t k = 0; k < K; k++) {
        v16 w[MAX_PANELS];
        for (int c = 0; c < C; c++) __builtin_prefetch(panels + (c * K + k + WHOLE_AHEAD) * PANEL, 0, 3);
        for (int c = 0; c < C; c++) w[c] = load16(panels + (c * K + k) * PANEL);
        for (int r = 0; r < R; r++) {
            const v16 xr = splat16(x[r * x_stride + k]);
            for (int c = 0; c < C; c++) acc[r][c] = fma16(xr, w[c], acc[r][c]);
        }
    }
    store_acc16(acc, R, C, bias, y, y_stride, cols_left);
}
#endif

/* One tile. Measured on an AMD EPYC (AVX-512): 8-lane vectors read the weights faster for one
   or two rows, 16-lane ones compute faster for more (speed only: the same numbers). */
static inline __attribute__((always_inline)) void tile(
        const int R, const int C, const float *x, int64_t x_stride, const float *panels,
        int64_t K, const float *bias, float *y, int64_t y_stride, int64_t cols_left) {
#ifdef __AVX512F__
    if (R > 2) {
        tile16(R, C, x, x_stride, panels, K, bias, y, y_stride, cols_left);
        return;
    }
#endif
    tile8(R, C, x, x_stride, panels, K, bias, y, y_stride, cols_left);
}

/* Panels a tile of R rows takes at once: few rows get more panels, so that enough independent
   accumulators hide the multiply-add's latency (speed only). */
static inline int panels_for(int R) { return R <= 1 ? 4 : R <= 2 ? 2 : 1; }

#define TILE(R, C) tile(R, C, xp, x_stride, pp, K, bp, yp, y_stride, N - q * PANEL)
#define ROWS(R)                        \
    case R:                            \
        if (C == 4)                    \
            TILE(R, 4);                \
        else if (C == 2)               \
            TILE(R, 2);                \
        else                           \
            TILE(R, 1);                \
        break

/* y[m][n] for m < M, n < N (module comment). x is M rows of K, x_stride apart; y is M rows
   of N, y_stride apart; bias is N numbers or NULL. The threads split (panel group, row tile)
   pairs, panel-major, so a thread's consecutive tiles read the same panels from its cache. */
void kvgate_panel_product_f32(const float *x, int64_t M, int64_t K, int64_t x_stride,
                              const float *panels, int64_t N, const float *bias, float *y,
                              int64_t y_stride) {
    const int64_t P = (N + PANEL - 1) / PANEL, T = (M + MAX_ROWS - 1) / MAX_ROWS;
    const int group = panels_for((int)(M < MAX_ROWS ? M : MAX_ROWS));
    const int64_t G = (P + group - 1) / group;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < G * T; i++) {
        const int64_t g = i / T, m0 = (i % T) * MAX_ROWS;
        const int R = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
        const int64_t end = (g + 1) * group < P ? (g + 1) * group : P;
        int C = panels_for(R) < group ? panels_for(R) : group;
        for (int64_t q = g * group; q < end; q += C) {
            if (end - q < C) C = 1;
            const float *xp = x + m0 * x_stride, *pp = panels + q * K * PANEL;
            const float *bp = bias == NULL ? NULL : bias + q * PANEL;
            float *yp = y + m0 * y_stride + q * PANEL;
            switch (R) {
#if MAX_ROWS > 6
                ROWS(12);
                ROWS(11);
                ROWS(10);
                ROWS(9);
                ROWS(8);
                ROWS(7);
#endif
                ROWS(6);
                ROWS(5);
                ROWS(4);
                ROWS(3);
                ROWS(2);
                ROWS(1);
            }
        }
    }
}

/* ---- Panels kept in blocks of codes: the same products over fewer bytes. ----

A weight whose numbers are all of the form  w = code * scale + offset  (a float32 product and
sum, the product exact), with one scale and one offset per column and block of BLOCK inputs --
what a GGUF's Q4_1 and Q8_0 tensors dequantise to -- is kept as its codes: 4 bits (unsigned)
or 8 bits (signed) a number instead of 32. Each block of BLOCK inputs of a panel is
expanded into float32 in a small buffer (the same arithmetic that made the weight: a product,
then a sum, compiled without contraction) and multiplied by the same loop as whole panels: one
fused multiply-add per input, in order. The numbers multiplied are therefore the weight's own
bits, and so is every output number (the caller has checked, weight by weight, that expanding
the codes gives back every bit). Only the bytes read per step change: a decode step reads the
weights, and 4-bit codes are a fifth of them.

A weight whose numbers are all bfloat16s (a bfloat16 checkpoint's, served in float32) is kept
as those bfloat16s, 16 bits a number, widened exactly: "bits" 16, a block its BLOCK x 16
bfloat16s, input-major, without scale or offset.

A block of a panel: scale[16], offset[16] (float32), then the codes: 4-bit ones in BLOCK / 2
groups of 16 bytes, byte c of group j holding input 2j's code of column c in its low nibble and
input 2j+1's in its high one; 8-bit ones in BLOCK groups of 16 signed bytes. */

#define BLOCK 32

static inline int64_t block_bytes(int bits) {
    return bits == 16 ? BLOCK * PANEL * 2 : 2 * PANEL * 4 + BLOCK * PANEL * bits / 8;
}

/* A bfloat16's float32: its 16 bits above 16 zero bits (exact). */
static inline float widen_bfloat16(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float number;
    memcpy(&number, &wide, sizeof number);
    return number;
}

/* One block of one panel expanded: w[k][c] = code * scale[c] + offset[c], or the bfloat16
   widened. */
static inline void expand_block(const uint8_t *block, int bits, float w[BLOCK][PANEL]) {
    if (bits == 16) {
        uint16_t halves[BLOCK * PANEL];
        memcpy(halves, block, sizeof halves);
        for (int k = 0; k < BLOCK; k++)
            for (int c = 0; c < PANEL; c++) w[k][c] = widen_bfloat16(halves[k * PANEL + c]);
        return;
    }
    float scale[PANEL], offset[PANEL];
    memcpy(scale, block, sizeof scale);
    memcpy(offset, block + sizeof scale, sizeof offset);
    const uint8_t *codes = block + sizeof scale + sizeof offset;
    if (bits == 4) {
        for (int j = 0; j < BLOCK / 2; j++)
            for (int c = 0; c < PANEL; c++) {
                const uint8_t pair = codes[j * PANEL + c];
                w[2 * j][c] = (float)(pair & 15) * scale[c] + offset[c];
                w[2 * j + 1][c] = (float)(pair >> 4) * scale[c] + offset[c];
            }
    } else {
        const int8_t *signed_codes = (const int8_t *)codes;
        for (int k = 0; k < BLOCK; k++)
            for (int c = 0; c < PANEL; c++)
                w[k][c] = (float)signed_codes[k * PANEL + c] * scale[c] + offset[c];
    }
}

#ifdef __AVX512F__
/* Sixteen codes of one input expanded in registers (expand_block's arithmetic per lane). */
static inline __m512 expand16(__m512i codes, __m512 scale, __m512 offset) {
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(codes), scale), offset);
}

/* coded_tile with 16-lane vectors, each input's codes expanded in registers as it is used. */
static inline __attribute__((always_inline)) void coded_tile16(
        const int R, const int C, const float *x, int64_t x_stride, const uint8_t *panels,
        int bits, int64_t K, const float *bias, float *y, int64_t y_stride,
        int64_t cols_left) {
    const int64_t blocks = K / BLOCK, size = block_bytes(bits), stride = blocks * size;
    const __m512i low_nibble = _mm512_set1_epi32(15);
    v16 acc[MAX_ROWS][MAX_PANELS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = splat16(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        __m512 scale[MAX_PANELS], offset[MAX_PANELS];
        const uint8_t *codes[MAX_PANELS];
        for (int c = 0; c < C; c++) {
            const uint8_t *block = panels + c * stride + b * size;
            scale[c] = _mm512_loadu_ps(block);
            offset[c] = _mm512_loadu_ps(block + PANEL * 4);
            codes[c] = block + PANEL * 8;
        }
        if (b + 1 < blocks) /* the next block of each panel */
            for (int c = 0; c < C; c++) fetch_ahead(panels + c * stride + (b + 1) * size, size);
        const float *xb = x + b * BLOCK;
        if (bits == 16) {
            for (int k = 0; k < BLOCK; k++) {
                v16 w[MAX_PANELS];
                for (int c = 0; c < C; c++)
                    w[c] = (v16)_mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                            (const __m256i *)(panels + c * stride + b * size) + k)),
                        16));
                for (int r = 0; r < R; r++) {
                    const v16 xr = splat16(xb[r * x_stride + k]);
                    for (int c = 0; c < C; c++) acc[r][c] = fma16(xr, w[c], acc[r][c]);
                }
            }
        } else if (bits == 4) {
            for (int j = 0; j < BLOCK / 2; j++) {
                v16 even[MAX_PANELS], odd[MAX_PANELS];
                for (int c = 0; c < C; c++) {
                    const __m512i pairs = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(codes[c] + j * PANEL)));
                    even[c] = (v16)expand16(_mm512_and_si512(pairs, low_nibble), scale[c],
                                            offset[c]);
                    odd[c] = (v16)expand16(_mm512_srli_epi32(pairs, 4), scale[c], offset[c]);
                }
                for (int r = 0; r < R; r++) {
                    const v16 x0 = splat16(xb[r * x_stride + 2 * j]);
                    const v16 x1 = splat16(xb[r * x_stride + 2 * j + 1]);
                    for (int c = 0; c < C; c++) {
                        acc[r][c] = fma16(x0, even[c], acc[r][c]);
                        acc[r][c] = fma16(x1, odd[c], acc[r][c]);
                    }
                }
            }
        } else {
            for (int k = 0; k < BLOCK; k++) {
                v16 w[MAX_PANELS];
                for (int c = 0; c < C; c++)
                    w[c] = (v16)expand16(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                             (const __m128i *)(codes[c] + k * PANEL))),
                                         scale[c], offset[c]);
                for (int r = 0; r < R; r++) {
                    const v16 xr = splat16(xb[r * x_stride + k]);
                    for (int c = 0; c < C; c++) acc[r][c] = fma16(xr, w[c], acc[r][c]);
                }
            }
        }
    }
    store_acc16(acc, R, C, bias, y, y_stride, cols_left);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* Eight codes of one input expanded in registers (expand_block's arithmetic per lane). */
static inline v8 expand8(__m256i codes, __m256 scale, __m256 offset) {
    return (v8)_mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(codes), scale), offset);
}

static inline __m128i load_bytes8(const uint8_t *p) {
    return _mm_loadl_epi64((const __m128i *)p);
}

/* coded_tile with 8-lane vectors, two a panel, each input's codes expanded in registers as it
   is used (without AVX-512: a buffer's round trip cost more than it saved from 64 rows up). */
static inline __attribute__((always_inline)) void coded_tile8(
        const int R, const int C, const float *x, int64_t x_stride, const uint8_t *panels,
        int bits, int64_t K, const float *bias, float *y, int64_t y_stride,
        int64_t cols_left) {
    const int64_t blocks = K / BLOCK, size = block_bytes(bits), stride = blocks * size;
    const __m256i low_nibble = _mm256_set1_epi32(15);
    v8 acc[MAX_ROWS][MAX_PANELS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = splat8(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        __m256 scale[MAX_PANELS][2], offset[MAX_PANELS][2];
        const uint8_t *codes[MAX_PANELS];
        for (int c = 0; c < C; c++) {
            const uint8_t *block = panels + c * stride + b * size;
            for (int h = 0; h < 2; h++) {
                scale[c][h] = _mm256_loadu_ps((const float *)block + 8 * h);
                offset[c][h] = _mm256_loadu_ps((const float *)block + PANEL + 8 * h);
            }
            codes[c] = block + (bits == 16 ? 0 : PANEL * 8);
            if (b + 1 < blocks) fetch_ahead(block + size, size); /* the next block */
        }
        const float *xb = x + b * BLOCK;
        if (bits == 4) {
            for (int j = 0; j < BLOCK / 2; j++) {
                v8 even[MAX_PANELS][2], odd[MAX_PANELS][2];
                for (int c = 0; c < C; c++)
                    for (int h = 0; h < 2; h++) {
                        const __m256i pairs =
                            _mm256_cvtepu8_epi32(load_bytes8(codes[c] + j * PANEL + 8 * h));
                        even[c][h] = expand8(_mm256_and_si256(pairs, low_nibble), scale[c][h],
                                             offset[c][h]);
                        odd[c][h] = expand8(_mm256_srli_epi32(pairs, 4), scale[c][h],
                                            offset[c][h]);
                    }
                for (int r = 0; r < R; r++) {
                    const v8 x0 = splat8(xb[r * x_stride + 2 * j]);
                    const v8 x1 = splat8(xb[r * x_stride + 2 * j + 1]);
                    for (int c = 0; c < C; c++)
                        for (int h = 0; h < 2; h++) {
                            acc[r][c][h] = fma8(x0, even[c][h], acc[r][c][h]);
                            acc[r][c][h] = fma8(x1, odd[c][h], acc[r][c][h]);
                        }
                }
            }
        } else {
            for (int k = 0; k < BLOCK; k++) {
                v8 w[MAX_PANELS][2];
                for (int c = 0; c < C; c++)
                    for (int h = 0; h < 2; h++) {
                        if (bits == 16)
                            w[c][h] = (v8)_mm256_castsi256_ps(_mm256_slli_epi32(
                                _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                    (const __m128i *)(codes[c] + (k * PANEL + 8 * h) * 2))),
                                16));
                        else
                            w[c][h] = expand8(_mm256_cvtepi8_epi32(
                                                  load_bytes8(codes[c] + k * PANEL + 8 * h)),
                                              scale[c][h], offset[c][h]);
                    }
                for (int r = 0; r < R; r++) {
                    const v8 xr = splat8(xb[r * x_stride + k]);
                    for (int c = 0; c < C; c++)
                        for (int h = 0; h < 2; h++)
                            acc[r][c][h] = fma8(xr, w[c][h], acc[r][c][h]);
                }
            }
        }
    }
    store_acc8(acc, R, C, bias, y, y_stride, cols_left);
}
#endif

/* R rows x C panels over coded panels: block by block, each expanded into a buffer, then
   tile8's loop over its BLOCK inputs, the accumulators kept across blocks (the portable
   build); with AVX-512 coded_tile16, with AVX2 coded_tile8 (the same numbers). */
static inline __attribute__((always_inline)) void coded_tile(
        const int R, const int C, const float *x, int64_t x_stride, const uint8_t *panels,
        int bits, int64_t K, const float *bias, float *y, int64_t y_stride,
        int64_t cols_left) {
#if defined(__AVX512F__)
    coded_tile16(R, C, x, x_stride, panels, bits, K, bias, y, y_stride, cols_left);
    return;
#elif defined(__AVX2__) && defined(__FMA__)
    coded_tile8(R, C, x, x_stride, panels, bits, K, bias, y, y_stride, cols_left);
    return;
#endif
    const int64_t blocks = K / BLOCK, stride = blocks * block_bytes(bits);
    float w[MAX_PANELS][BLOCK][PANEL] __attribute__((aligned(64)));
    v8 acc[MAX_ROWS][MAX_PANELS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = splat8(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        for (int c = 0; c < C; c++)
            expand_block(panels + c * stride + b * block_bytes(bits), bits, w[c]);
        for (int k = 0; k < BLOCK; k++) {
            v8 wk[MAX_PANELS][2];
            for (int c = 0; c < C; c++) {
                wk[c][0] = load8(w[c][k]);
                wk[c][1] = load8(w[c][k] + 8);
            }
            for (int r = 0; r < R; r++) {
                const v8 xr = splat8(x[r * x_stride + b * BLOCK + k]);
                for (int c = 0; c < C; c++) {
                    acc[r][c][0] = fma8(xr, wk[c][0], acc[r][c][0]);
                    acc[r][c][1] = fma8(xr, wk[c][1], acc[r][c][1]);
                }
            }
        }
    }
    store_acc8(acc, R, C, bias, y, y_stride, cols_left);
}

#define CODED_TILE(R, C) \
    coded_tile(R, C, xp, x_stride, pp, bits, K, bp, yp, y_stride, N - q * PANEL)
#define CODED_ROWS(R)                  \
    case R:                            \
        if (C == 4)                    \
            CODED_TILE(R, 4);          \
        else if (C == 2)               \
            CODED_TILE(R, 2);          \
        else                           \
            CODED_TILE(R, 1);          \
        break

/* kvgate_panel_product_f32 over coded panels (above): K a multiple of BLOCK, bits 4, 8 or 16;
   the same threads' split and the same numbers as over whole panels of the same weight. */
void kvgate_coded_panel_product_f32(const float *x, int64_t M, int64_t K, int64_t x_stride,
                                    const uint8_t *panels, int bits, int64_t N,
                                    const float *bias, float *y, int64_t y_stride) {
    const int64_t P = (N + PANEL - 1) / PANEL, T = (M + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t panel_bytes = K / BLOCK * block_bytes(bits);
    const int group = panels_for((int)(M < MAX_ROWS ? M : MAX_ROWS));
    const int64_t G = (P + group - 1) / group;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < G * T; i++) {
        const int64_t g = i / T, m0 = (i % T) * MAX_ROWS;
        const int R = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
        const int64_t end = (g + 1) * group < P ? (g + 1) * group : P;
        int C = panels_for(R) < group ? panels_for(R) : group;
        for (int64_t q = g * group; q < end; q += C) {
            if (end - q < C) C = 1;
            const float *xp = x + m0 * x_stride;
            const uint8_t *pp = panels + q * panel_bytes;
            const float *bp = bias == NULL ? NULL : bias + q * PANEL;
            float *yp = y + m0 * y_stride + q * PANEL;
            switch (R) {
#if MAX_ROWS > 6
                CODED_ROWS(12);
                CODED_ROWS(11);
                CODED_ROWS(10);
                CODED_ROWS(9);
                CODED_ROWS(8);
                CODED_ROWS(7);
#endif
                CODED_ROWS(6);
                CODED_ROWS(5);
                CODED_ROWS(4);
                CODED_ROWS(3);
                CODED_ROWS(2);
                CODED_ROWS(1);
            }
        }
    }
}
