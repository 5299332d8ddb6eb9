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

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PANEL 16
#define MAX_PANELS 4

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* a * b + c, rounded once. */
static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__AVX__) && defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

#ifdef __AVX512F__
/* Tiles of up to 12 rows: 12 accumulators of 16 lanes, one panel's row of W, one x. */
#define MAX_ROWS 12
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline v16 splat16(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

static inline v16 fma16(v16 a, v16 b, v16 c) {
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
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

/* R rows x C panels with 8-lane vectors (R, C constants where it is inlined). */
static inline __attribute__((always_inline)) void tile8(
        const int R, const int C, const float *x, int64_t x_stride, const float *panels,
        int64_t K, const float *bias, float *y, int64_t y_stride, int64_t cols_left) {
    v8 acc[MAX_ROWS][MAX_PANELS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = splat8(0.0f);
    for (int64_t k = 0; k < K; k++) {
        v8 w[MAX_PANELS][2];
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
    float out[MAX_ROWS][MAX_PANELS][PANEL];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            memcpy(out[r][c], &acc[r][c][0], sizeof acc[r][c][0]);
            memcpy(out[r][c] + 8, &acc[r][c][1], sizeof acc[r][c][1]);
        }
    store_tile(out, R, C, bias, y, y_stride, cols_left);
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
        for (int c = 0; c < C; c++) w[c] = load16(panels + (c * K + k) * PANEL);
        for (int r = 0; r < R; r++) {
            const v16 xr = splat16(x[r * x_stride + k]);
            for (int c = 0; c < C; c++) acc[r][c] = fma16(xr, w[c], acc[r][c]);
        }
    }
    float out[MAX_ROWS][MAX_PANELS][PANEL];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) memcpy(out[r][c], &acc[r][c], sizeof acc[r][c]);
    store_tile(out, R, C, bias, y, y_stride, cols_left);
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
