/* Attention over paged K/V, read in place through block tables (gateway/engine/attention/paged.py).

Why C: torch's CPU kernels take one contiguous K and V per sequence, so every step gathered each
sequence's pages into a transient copy, layer by layer: ~20 ms of a 135 ms decode step of eight
1.5k-token sequences of SmolLM2. This reads the pages where they are.

Why every operation is spelled out: a query row's bits must depend on that row alone (its query,
its position, its own sequence's keys and values up to that position), never on the other rows
of the call, on how its prompt was chunked, or on the machine. So each row is computed by the
same sequence of IEEE operations, whatever else is in the call:
  - a score is a dot product over head_dim in eight lanes (lane l sums dims l, l+8, ... with
    fused multiply-adds, in order), the lanes then added in a fixed tree;
  - with a logit soft-cap (Gemma 2), a score s becomes cap * tanh(s / cap), computed in double
    with the C library's tanh and rounded to float once (soft_cap: one score at a time, so
    its bits depend on that score alone);
  - the maximum is exact (any order);
  - a weight is exp(max(score - max, EXP_FLOOR)) by a fixed polynomial (exp_lanes), the same
    code for every lane, so a weight's bits do not depend on which lane computed it;
  - the sum of weights runs in eight lanes (lane j % 8 sums keys j, j+8, ... in order), then
    the fixed tree; the weighted values are fused multiply-adds over keys in order;
  - the output is that sum divided by the weight sum;
  - with attention sinks (gpt-oss: one learned logit per query head, a key with no value), the
    maximum is over the scores and the head's sink, and the sink's weight (the same exp) is
    added to the weight sum after the lanes' tree.
Keys after the row's position are never read, nor, with a sliding window, keys before it
(position - window < key <= position): they weigh exactly 0, and a page wholly before the window
is skipped (which keys a row reads depends on its position alone). Fused multiply-add is exactly rounded by
definition, so the hardware instruction and the C library's fmaf give the same bits: the
numbers are the same on every machine, with or without AVX2/FMA (only the speed differs).
Compiled with -ffp-contract=off and without -ffast-math: the compiler may not fuse or reorder.
*/
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvgate_lanes.h"

#define EXP_FLOOR (-80.0f)

#if defined(__AVX512F__)
/* AVX-512's paths (built where the CPU has it): sixteen lanes where eight did the same work
   side by side -- two keys' or two heads' lanes in one register, or sixteen of a value's
   dimensions -- every lane computing exactly what its eight-lane twin computes, in the same
   order. Only the speed differs; tests compare these builds with the portable one bit for
   bit. */
#define WIDE 1

/* Eight floats at p in both halves. */
static inline v16 twice8(const float *p) {
    return (v16)_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)p)));
}

/* Two eight-lane vectors as the halves of one. */
static inline v16 halves(v8 low, v8 high) {
    return (v16)_mm512_insertf64x4(_mm512_castpd256_pd512((__m256d)low), (__m256d)high, 1);
}

static inline v8 low8(v16 a) { return (v8)_mm512_castps512_ps256((__m512)a); }

static inline v8 high8(v16 a) { return (v8)_mm512_extractf64x4_pd((__m512d)a, 1); }
#else
#define WIDE 0
#endif

/* exp(x) for x in [EXP_FLOOR, 0]: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two parts so
   n ln2 is exact), then e^r = 1 + r + r^2 P(r) (Cephes' expf polynomial, ~1 ulp), times 2^n
   built in the exponent bits (n >= -116: always a normal float). One body for eight lanes and
   for sixteen, so a lane's operations are the same whichever computes it. */
#define EXP_LANES(name, V, I, splat, fma)                                                   \
    static inline V name(V x) {                                                             \
        const V log2e = splat(1.44269504088896341f);                                        \
        V t = x * log2e - splat(0.5f);                                                      \
        I n = __builtin_convertvector(t, I); /* truncation toward zero: nearest, x <= 0 */  \
        V nf = __builtin_convertvector(n, V);                                               \
        V r = fma(nf, splat(-0.693359375f), x);                                             \
        r = fma(nf, splat(2.12194440e-4f), r);                                              \
        V p = splat(1.9875691500e-4f);                                                      \
        p = fma(p, r, splat(1.3981999507e-3f));                                             \
        p = fma(p, r, splat(8.3334519073e-3f));                                             \
        p = fma(p, r, splat(4.1665795894e-2f));                                             \
        p = fma(p, r, splat(1.6666665459e-1f));                                             \
        p = fma(p, r, splat(5.0000001201e-1f));                                             \
        V rr = r * r;                                                                       \
        p = fma(p, rr, r) + splat(1.0f);                                                    \
        I bits = (n + 127) << 23;                                                           \
        V scale;                                                                            \
        memcpy(&scale, &bits, sizeof scale);                                                \
        return p * scale;                                                                   \
    }

EXP_LANES(exp_lanes, v8, i8, splat8, fma8)
#if WIDE
EXP_LANES(exp_lanes16, v16, i16, splat16, fma16)
#endif

#define MAX_ROWS 4
/* Rows attended together: consecutive rows of one sequence (a prefill chunk's), or the lone rows
   of several sequences (decode rows). They walk their tables page by page in lockstep, so a
   page they share -- a system prompt many sequences hold through the cache -- is read from
   memory once for all of them, while every row's numbers are computed exactly as if alone. */

/* The score of one query row against four keys, side by side (four independent chains). */
static inline void scores4(const float *qh, const float *key, int head_dim, float *out) {
    v8 a0 = splat8(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < head_dim / 8; c++) {
        const v8 qc = load8(qh + 8 * c);
        a0 = fma8(qc, load8(key + 8 * c), a0);
        a1 = fma8(qc, load8(key + head_dim + 8 * c), a1);
        a2 = fma8(qc, load8(key + 2 * head_dim + 8 * c), a2);
        a3 = fma8(qc, load8(key + 3 * head_dim + 8 * c), a3);
    }
    out[0] = tree8(a0);
    out[1] = tree8(a1);
    out[2] = tree8(a2);
    out[3] = tree8(a3);
}

/* tree8 of eight vectors at once, out[i] = tree8(a[i]) bit for bit: the same additions of the
   same pairs (a sum's bits do not depend on the order of its two operands), done across
   vectors instead of lane by lane: (l, l+4), then (l, l+2) of those, then the last two. */
static inline void tree8x8(const v8 *a, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 pairs[4];
    for (int i = 0; i < 4; i++) {
        const __m256 x = (__m256)a[2 * i], y = (__m256)a[2 * i + 1];
        pairs[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20),
                                 _mm256_permute2f128_ps(x, y, 0x31));
    }
    /* pairs[i]: a[2i]'s (0+4, 1+5, 2+6, 3+7) in the low half, a[2i+1]'s in the high half. */
    const __m256 quads0 = _mm256_add_ps(
        _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 quads1 = _mm256_add_ps(
        _mm256_shuffle_ps(pairs[2], pairs[3], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm256_shuffle_ps(pairs[2], pairs[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* quads: per vector, (0+4)+(2+6) then (1+5)+(3+7); low halves a[0], a[2] | a[4], a[6]. */
    const __m256 sums = _mm256_add_ps(
        _mm256_shuffle_ps(quads0, quads1, _MM_SHUFFLE(2, 0, 2, 0)),
        _mm256_shuffle_ps(quads0, quads1, _MM_SHUFFLE(3, 1, 3, 1)));
    /* sums: a[0], a[2], a[4], a[6], a[1], a[3], a[5], a[7]. */
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3,
                                                                           7)));
#else
    for (int i = 0; i < 8; i++) out[i] = tree8(a[i]);
#endif
}

/* The score of one query row against eight keys, side by side (eight independent chains, each
   the one score1 computes). */
static inline void scores8(const float *qh, const float *key, int head_dim, float *out) {
    v8 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = splat8(0.0f);
    for (int c = 0; c < head_dim / 8; c++) {
        const v8 qc = load8(qh + 8 * c);
        for (int i = 0; i < 8; i++) acc[i] = fma8(qc, load8(key + i * head_dim + 8 * c), acc[i]);
    }
    tree8x8(acc, out);
}

static inline float score1(const float *qh, const float *key, int head_dim) {
    v8 acc = splat8(0.0f);
    for (int c = 0; c < head_dim / 8; c++) acc = fma8(load8(qh + 8 * c), load8(key + 8 * c), acc);
    return tree8(acc);
}

/* A score soft-capped: cap * tanh(score / cap), in double, rounded to float once. */
static inline float soft_cap(float score, float cap) {
    return (float)((double)cap * tanh((double)score / (double)cap));
}

/* The largest of s[lo..n-1] (n > lo). Exact, so the order the scores are compared in cannot
   change it: eight lanes side by side where the CPU has them (a NaN score makes its row NaN
   either way). */
static inline float max_of(const float *s, int64_t lo, int64_t n) {
    float max = s[lo];
    int64_t j = lo + 1;
#if defined(__AVX__)
    if (n - j >= 32) {
        __m256 m[4];
        for (int i = 0; i < 4; i++) m[i] = _mm256_loadu_ps(s + j + 8 * i);
        for (j += 32; j + 32 <= n; j += 32)
            for (int i = 0; i < 4; i++) m[i] = _mm256_max_ps(_mm256_loadu_ps(s + j + 8 * i), m[i]);
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]),
                                              _mm256_max_ps(m[2], m[3])));
        for (int l = 0; l < 8; l++) max = lanes[l] > max ? lanes[l] : max;
    }
#endif
    for (; j < n; j++) max = s[j] > max ? s[j] : max;
    return max;
}

/* Scores into weights in place: each of keys lo..n-1 soft-capped first where softcap > 0, then
   w = exp(max(s - max, EXP_FLOOR)) for keys lo..n-1, 0 from n to `padded` and before lo (a
   sliding window; 0 without one); returns the weights' sum (eight lanes by key index, then the
   fixed tree). Lanes before lo's group of eight are never read. With a `sink` (NULL: none), the
   max includes it and its weight joins the sum last; a sink is a logit of its own, never
   soft-capped (only the scores are). */
static float weigh(float *s, int64_t lo, int64_t n, int64_t padded, float softcap,
                   const float *sink) {
    if (softcap > 0.0f)
        for (int64_t j = lo; j < n; j++) s[j] = soft_cap(s[j], softcap);
    float max = max_of(s, lo, n);
    if (sink != NULL) max = *sink > max ? *sink : max;
    for (int64_t j = n; j < padded; j++) s[j] = -INFINITY;
    v8 lanes = splat8(0.0f);
    const v8 mv = splat8(max), floor = splat8(EXP_FLOOR);
    for (int64_t j = lo / 8 * 8; j < padded; j += 8) {
#if WIDE
        if (j >= lo && j + 16 <= n) { /* sixteen keys all seen: two groups of eight at once */
            const v16 mv16 = splat16(max), floor16 = splat16(EXP_FLOOR);
            v16 x = load16(s + j) - mv16;
            v16 hidden = (v16)(x < floor16);
            x = (v16)(((i16)x & ~(i16)hidden) | ((i16)floor16 & (i16)hidden));
            v16 w = exp_lanes16(x);
            store16(s + j, w);
            lanes = lanes + low8(w);
            lanes = lanes + high8(w);
            j += 8;
            continue;
        }
#endif
        v8 x = load8(s + j) - mv;
        v8 hidden = (v8)(x < floor);
        x = (v8)(((i8)x & ~(i8)hidden) | ((i8)floor & (i8)hidden));
        v8 w = exp_lanes(x);
        if (j + 8 > n || j < lo) {
            for (int l = 0; l < 8; l++)
                if (j + l >= n || j + l < lo) w[l] = 0.0f;
        }
        store8(s + j, w);
        lanes = lanes + w;
    }
    if (sink == NULL) return tree8(lanes);
    const float x = *sink - max < EXP_FLOOR ? EXP_FLOOR : *sink - max;
    return tree8(lanes) + exp_lanes(splat8(x))[0];
}

#if WIDE
/* tree8x8 of both halves of eight sixteen-lane vectors: out0[i] = tree8(low8(a[i])) and
   out1[i] = tree8(high8(a[i])) bit for bit -- the same additions of the same pairs, (l, l+4),
   then (l, l+2) of those, then the last two -- done on whole 512-bit registers: ~25
   instructions where splitting the halves into two eight-lane trees took ~45, most of them
   shuffles on the port the multiply-adds need. */
static inline __attribute__((always_inline)) void tree8x8_halves(const v16 *a, float *out0,
                                                                 float *out1) {
    /* s[j]'s four 128-bit lanes: a[2j]'s low half, a[2j]'s high half, a[2j+1]'s low half,
       a[2j+1]'s high half, each as lanes l + (l + 4), l = 0..3. */
    __m512 s[4];
    for (int j = 0; j < 4; j++) {
        const __m512 x = (__m512)a[2 * j], y = (__m512)a[2 * j + 1];
        s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    /* t[j]'s 128-bit lane m: s[2j]'s lane m, then s[2j+1]'s, each as its (0, 2) and (1, 3). */
    __m512 t[2];
    for (int j = 0; j < 2; j++)
        t[j] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* sums' 128-bit lane m, element j: the tree of s[j]'s lane m. */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 ordered = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), sums);
    _mm256_storeu_ps(out0, _mm512_castps512_ps256(ordered));
    _mm256_storeu_ps(out1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ordered), 1)));
}

/* The scores of two query heads against eight keys: the two heads' lanes side by side in one
   register (each key's eight floats in both halves), each half the chains scores8 computes for
   its head. qq: the two heads' query chunks, paired (head_dim / 8 of them). */
static inline __attribute__((always_inline)) void
scores8x2(const v16 *qq, const float *key, int head_dim, float *out0, float *out1) {
    v16 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = splat16(0.0f);
    for (int c = 0; c < head_dim / 8; c++)
        for (int i = 0; i < 8; i++) acc[i] = fma16(qq[c], twice8(key + i * head_dim + 8 * c), acc[i]);
    tree8x8_halves(acc, out0, out1);
}

#define WIDE_PARTS 16 /* sixteen-lane accumulators the weighted values keep in registers */

/* Weighted values of keys first..count-1 of one page for `heads` query heads of one KV head
   (heads * head_dim / 16 <= WIDE_PARTS): each accumulator lane is one dimension of one head,
   summing its keys in order by the fused multiply-adds the eight-lane loop does. w[h]: head h's
   weights of the page's keys; a[h]: its accumulator (head_dim floats). */
static inline __attribute__((always_inline)) void
values16(const float *vp, int64_t first, int64_t count, int head_dim, int heads,
         const float *const *w, float *const *a) {
    const int parts = head_dim / 16;
    v16 part[WIDE_PARTS];
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < parts; c++) part[h * parts + c] = load16(a[h] + 16 * c);
    for (int64_t t = first; t < count; t++) {
        const float *value = vp + t * head_dim;
        for (int h = 0; h < heads; h++) {
            const v16 wt = splat16(w[h][t]);
            for (int c = 0; c < parts; c++)
                part[h * parts + c] = fma16(wt, load16(value + 16 * c), part[h * parts + c]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < parts; c++) store16(a[h] + 16 * c, part[h * parts + c]);
}
#endif

/* One query row's scores (qh: head_dim floats) against keys from..count-1 of one page, into
   s[from..count-1]: each key's the chain score1 computes. */
static inline __attribute__((always_inline)) void
score_one(const float *qh, const float *kp, int64_t from, int64_t count, int head_dim, float *s) {
    int64_t t = from;
    for (; t + 8 <= count; t += 8) scores8(qh, kp + t * head_dim, head_dim, s + t);
    for (; t + 4 <= count; t += 4) scores4(qh, kp + t * head_dim, head_dim, s + t);
    for (; t < count; t++) s[t] = score1(qh, kp + t * head_dim, head_dim);
}

#if WIDE
/* Two query rows' scores (two heads of one row, or one head of two rows reading the same page)
   against keys 0..count-1 of one page, side by side in one register: each key's the chain
   score1 computes for each (head_dim <= 128). */
static inline __attribute__((always_inline)) void
score_two(const float *q0, const float *q1, const float *kp, int64_t count, int head_dim,
          float *s0, float *s1) {
    v16 qq[16];
    for (int c = 0; c < head_dim / 8; c++) qq[c] = halves(load8(q0 + 8 * c), load8(q1 + 8 * c));
    int64_t t = 0;
    for (; t + 8 <= count; t += 8) scores8x2(qq, kp + t * head_dim, head_dim, s0 + t, s1 + t);
    score_one(q0, kp, t, count, head_dim, s0);
    score_one(q1, kp, t, count, head_dim, s1);
}
#endif

/* Row r's query for head h, and its scores, in attend_rows' scratch. */
#define QUERY(r, h) (q + ((int64_t)(r) * rep + (h)) * head_dim)
#define SCORES(r, h) (scores + ((int64_t)(r) * rep + (h)) * padded)

/* `rows` consecutive query rows of one sequence (rows <= MAX_ROWS), for the `rep` query heads
   of one KV head.

   q: rows * rep rows of head_dim (already scaled); k_head/v_head: this KV head's pages
   ([pages, page_tokens, head_dim]); table[r]: row r's sequence's page ids; n[r]: keys row r sees (its
   position + 1); lo[r]: its first key (0, or with a window position + 1 - window); scores: scratch of rows * rep * `padded` floats, padded >= every n[r] rounded
   up to 8; acc: scratch of rows * rep * head_dim floats; out[r]: row r's output, rep rows of
   head_dim; sinks: the rep query heads' sinks, or NULL. */
static inline __attribute__((always_inline)) void
attend_rows(const float *q, int rows, int rep, int head_dim, const float *k_head,
            const float *v_head, int64_t page_stride, int page_tokens,
            const int64_t *const *table, const int64_t *lo, const int64_t *n, int64_t padded, float softcap, float *scores,
            float *acc, float *denominator, float *const *out, const float *sinks) {
    int64_t longest = 0;
    for (int r = 0; r < rows; r++) longest = n[r] > longest ? n[r] : longest;
    const int chunks = head_dim / 8;
    /* Scores, page by page: a page's keys are read from memory once for every row holding it. */
    for (int64_t start = 0; start < longest; start += page_tokens) {
#if WIDE
        /* With an odd number of heads, each row's last one waits for another row's that reads
           the same page (a prefill's rows all do) to share a register with. */
        int waiting = -1;
        const float *waiting_kp = NULL;
        int64_t waiting_count = 0;
#endif
        for (int r = 0; r < rows; r++) {
            if (start >= n[r] || start + page_tokens <= lo[r]) continue;
            const float *kp = k_head + table[r][start / page_tokens] * page_stride;
            const int64_t count = n[r] - start < page_tokens ? n[r] - start : page_tokens;
            int h = 0;
#if WIDE
            if (head_dim <= 128) {
                for (; h + 2 <= rep; h += 2) /* two heads a register */
                    score_two(QUERY(r, h), QUERY(r, h + 1), kp, count, head_dim,
                              SCORES(r, h) + start, SCORES(r, h + 1) + start);
                if (h < rep) {
                    if (waiting >= 0 && waiting_kp == kp) {
                        const int64_t both = count < waiting_count ? count : waiting_count;
                        score_two(QUERY(waiting, h), QUERY(r, h), kp, both, head_dim,
                                  SCORES(waiting, h) + start, SCORES(r, h) + start);
                        score_one(QUERY(waiting, h), kp, both, waiting_count, head_dim,
                                  SCORES(waiting, h) + start);
                        score_one(QUERY(r, h), kp, both, count, head_dim, SCORES(r, h) + start);
                        waiting = -1;
                    } else {
                        if (waiting >= 0)
                            score_one(QUERY(waiting, h), waiting_kp, 0, waiting_count, head_dim,
                                      SCORES(waiting, h) + start);
                        waiting = r;
                        waiting_kp = kp;
                        waiting_count = count;
                    }
                    h = rep;
                }
            }
#endif
            for (; h < rep; h++)
                score_one(QUERY(r, h), kp, 0, count, head_dim, SCORES(r, h) + start);
        }
#if WIDE
        if (waiting >= 0)
            score_one(QUERY(waiting, rep - 1), waiting_kp, 0, waiting_count, head_dim,
                      SCORES(waiting, rep - 1) + start);
#endif
    }
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < rep; h++)
            denominator[r * rep + h] = weigh(scores + ((int64_t)r * rep + h) * padded, lo[r],
                                             n[r], (n[r] + 7) / 8 * 8, softcap,
                                             sinks == NULL ? NULL : sinks + h);
    /* Weighted values, page by page; each accumulator sums its keys in order across pages. */
    memset(acc, 0, sizeof(float) * (size_t)rows * rep * head_dim);
    for (int64_t start = 0; start < longest; start += page_tokens) {
        for (int r = 0; r < rows; r++) {
            if (start >= n[r] || start + page_tokens <= lo[r]) continue;
            const float *vp = v_head + table[r][start / page_tokens] * page_stride;
            const int64_t count = n[r] - start < page_tokens ? n[r] - start : page_tokens;
            const int64_t first = lo[r] > start ? lo[r] - start : 0; /* the window's first key */
#if WIDE
            if (head_dim % 16 == 0 && head_dim <= 16 * WIDE_PARTS) {
                /* Several heads at once: each value row is loaded once for all of them. */
                const int group = WIDE_PARTS / (head_dim / 16);
                for (int h0 = 0; h0 < rep; h0 += group) {
                    const float *w[WIDE_PARTS];
                    float *a[WIDE_PARTS];
                    const int heads = rep - h0 < group ? rep - h0 : group;
                    for (int h = 0; h < heads; h++) {
                        w[h] = scores + ((int64_t)r * rep + h0 + h) * padded + start;
                        a[h] = acc + ((int64_t)r * rep + h0 + h) * head_dim;
                    }
                    /* The head count as a constant, so the accumulators stay in registers. */
                    switch (heads) {
                    case 1: values16(vp, first, count, head_dim, 1, w, a); break;
                    case 2: values16(vp, first, count, head_dim, 2, w, a); break;
                    case 3: values16(vp, first, count, head_dim, 3, w, a); break;
                    case 4: values16(vp, first, count, head_dim, 4, w, a); break;
                    default:
                        for (int h = 0; h < heads; h++)
                            values16(vp, first, count, head_dim, 1, w + h, a + h);
                    }
                }
                continue;
            }
#endif
            for (int h = 0; h < rep; h++) {
                const float *w = scores + ((int64_t)r * rep + h) * padded + start;
                float *a = acc + ((int64_t)r * rep + h) * head_dim;
                for (int c0 = 0; c0 < chunks; c0 += 8) {
                    const int cn = chunks - c0 < 8 ? chunks - c0 : 8;
                    v8 part[8];
                    for (int c = 0; c < cn; c++) part[c] = load8(a + 8 * (c0 + c));
                    for (int64_t t = first; t < count; t++) {
                        const v8 wt = splat8(w[t]);
                        const float *value = vp + t * head_dim + 8 * c0;
                        for (int c = 0; c < cn; c++) part[c] = fma8(wt, load8(value + 8 * c), part[c]);
                    }
                    for (int c = 0; c < cn; c++) store8(a + 8 * (c0 + c), part[c]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < rep; h++) {
            const v8 d = splat8(denominator[r * rep + h]);
            const float *a = acc + ((int64_t)r * rep + h) * head_dim;
            float *o = out[r] + (int64_t)h * head_dim;
            for (int c = 0; c < chunks; c++) store8(o + 8 * c, load8(a + 8 * c) / d);
        }
}

/* Whether row r is its item's only row (the items' rows are consecutive). */
static inline int is_lone(const int64_t *row_item, int64_t rows, int64_t r) {
    return (r == 0 || row_item[r - 1] != row_item[r])
           && (r + 1 == rows || row_item[r + 1] != row_item[r]);
}

/* Every row of a layer's step, in one call.

   keys/values: one layer's K and V storage, [kv_heads, pages, page_tokens, head_dim] with
   `head_stride` floats between KV heads; tables: [items, table_stride] page ids; queries/out:
   [rows, kv_heads * rep, head_dim], contiguous; row_item/row_position: per row (an item's rows
   consecutive); window: the layer's sliding window (keys position - window < key <= position),
   0 for none; softcap: the layer's logit soft-cap of the scaled scores, 0 for none; sinks: the
   layer's attention sinks, one logit per query head ([kv_heads * rep]), or NULL for none.
   Returns 0, or -1 when scratch memory could not be had. */
int kvgate_paged_attention_f32(const float *keys, const float *values, int64_t head_stride,
                               int kv_heads, int rep, int page_tokens, int head_dim,
                               const int64_t *tables, int64_t table_stride,
                               const float *queries, const int64_t *row_item,
                               const int64_t *row_position, int64_t rows, float scale,
                               int64_t window, float softcap, float *out, const float *sinks) {
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++)
        if (row_position[r] + 1 > longest) longest = row_position[r] + 1;
    const int64_t padded = (longest + 7) / 8 * 8;
    const int64_t page_stride = (int64_t)page_tokens * head_dim;
    const int heads = kv_heads * rep;
    /* Blocks of up to MAX_ROWS consecutive rows of one item, or of up to `lone` consecutive
       rows that are each their item's only one (decode rows) and whose tables begin with the
       same page (a shared prefix: rows of unrelated sequences gain nothing together): as many
       together as still leaves every thread two tasks or more. */
    int64_t *block_start = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (block_start == NULL) return -1;
    int64_t lone_rows = 0;
    for (int64_t r = 0; r < rows; r++) lone_rows += is_lone(row_item, rows, r);
    int64_t lone = lone_rows * kv_heads / (2 * (int64_t)omp_get_max_threads());
    lone = lone < 1 ? 1 : lone > MAX_ROWS ? MAX_ROWS : lone;
    int64_t blocks = 0;
    for (int64_t r = 0; r < rows;) {
        block_start[blocks++] = r;
        int64_t end = r + 1;
        if (is_lone(row_item, rows, r))
            while (end < rows && end - r < lone && is_lone(row_item, rows, end)
                   && tables[row_item[end] * table_stride] == tables[row_item[r] * table_stride])
                end++;
        else
            while (end < rows && end - r < MAX_ROWS && row_item[end] == row_item[r]) end++;
        r = end;
    }
    block_start[blocks] = rows;
    /* Head-major: the threads take blocks of one KV head at once, so rows of different blocks
       that share a page read it at about the same time (once from memory, then from the
       shared cache). */
    const int64_t tasks = blocks * kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        /* NOTE: every thread reaches the loop (a work-sharing loop must be met by all of
           them); one without scratch takes its share and skips it, and the call fails. */
        const size_t per_row = (size_t)rep * (size_t)(padded + 2 * head_dim + 1);
        float *scratch = malloc(sizeof(float) * per_row * MAX_ROWS);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scratch == NULL) continue;
            const int64_t first = block_start[task % blocks];
            const int count = (int)(block_start[task % blocks + 1] - first);
            const int g = (int)(task / blocks);
            float *scores = scratch;
            float *acc = scores + (size_t)MAX_ROWS * rep * padded;
            float *q = acc + (size_t)MAX_ROWS * rep * head_dim;
            float *denominator = q + (size_t)MAX_ROWS * rep * head_dim;
            int64_t n[MAX_ROWS], lo[MAX_ROWS];
            float *row_out[MAX_ROWS];
            const int64_t *table[MAX_ROWS];
            for (int r = 0; r < count; r++) {
                const int64_t row = first + r;
                const float *src = queries + (row * heads + (int64_t)g * rep) * head_dim;
                for (int i = 0; i < rep * head_dim; i++) q[r * rep * head_dim + i] = src[i] * scale;
                n[r] = row_position[row] + 1;
                lo[r] = window > 0 && n[r] > window ? n[r] - window : 0;
                row_out[r] = out + (row * heads + (int64_t)g * rep) * head_dim;
                table[r] = tables + row_item[row] * table_stride;
            }
            const float *k_head = keys + g * head_stride, *v_head = values + g * head_stride;
            const float *head_sinks = sinks == NULL ? NULL : sinks + (int64_t)g * rep;
            /* The common head sizes as constants: the compiler then keeps the accumulators in
               registers and the keys' offsets in the instructions (speed only: every path runs
               the same operations in the same order). */
            if (head_dim == 64)
                attend_rows(q, count, rep, 64, k_head, v_head, page_stride, page_tokens, table, lo,
                            n, padded, softcap, scores, acc, denominator, row_out, head_sinks);
            else if (head_dim == 128)
                attend_rows(q, count, rep, 128, k_head, v_head, page_stride, page_tokens, table,
                            lo, n, padded, softcap, scores, acc, denominator, row_out,
                            head_sinks);
            else
                attend_rows(q, count, rep, head_dim, k_head, v_head, page_stride, page_tokens,
                            table, lo, n, padded, softcap, scores, acc, denominator, row_out,
                            head_sinks);
        }
        free(scratch);
    }
    free(block_start);
    return failed ? -1 : 0;
}
