/* RMSNorm over rows in one fixed order of operations (gateway/engine/linear/row_norms.py).

Why C: a layer's norm was eight small torch operations (a cast, a square, a mean, an add, a
reciprocal square root, two products, a cast back), each a call through the dispatcher and some
a parallel region that wakes the other core: ~1,000 calls of a Qwen3 decode step, whose rows
are a few vectors of 576 or 64 floats. Here a norm is one call on the calling thread.

Its numbers, for a row x of n floats and the norm's weight w:
  - the sum of squares runs in eight lanes (lane l sums x[l]^2, x[l+8]^2, ... with fused
    multiply-adds, in order), the lanes then added in a fixed tree, then the last n % 8
    squares added one by one (fused);
  - scale = 1 / sqrt(sum / n + eps), each operation rounded once (IEEE division and square
    root are exactly rounded);
  - out[i] = w[i] * (x[i] * scale).
Fused multiply-add is exactly rounded by definition, so the numbers are the same on every
machine (AVX2 or not: only the speed differs). Compiled with -ffp-contract=off and without
-ffast-math: the compiler may not fuse or reorder.
*/
#include "kvgate_lanes.h"

/* Each of `rows` rows of `width` floats (row r at x + r * x_stride) normalised into out
   (row r at out + r * out_stride) with the norm's `weight` and `eps`. */
void kvgate_rms_norm_f32(const float *x, int64_t rows, int64_t width, int64_t x_stride,
                         const float *weight, float eps, float *out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        float *o = out + r * out_stride;
        v8 lanes = splat8(0.0f);
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            const v8 v = load8(row + i);
            lanes = fma8(v, v, lanes);
        }
        float sum = tree8(lanes);
        for (; i < width; i++) sum = fmaf(row[i], row[i], sum);
        const float scale = 1.0f / sqrtf(sum / (float)width + eps);
        const v8 s = splat8(scale);
        for (i = 0; i + 8 <= width; i += 8) store8(o + i, load8(weight + i) * (load8(row + i) * s));
        for (; i < width; i++) o[i] = weight[i] * (row[i] * scale);
    }
}
