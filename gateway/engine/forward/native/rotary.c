/* Llama's rotate-half rotary embedding in one call (gateway/engine/forward/rotary.py).

Why C: through torch a rotation of q or k is six small operations (two slices, a negation, a
concatenation, two products and a sum), each a dispatch: ~360 calls of a decode step of
SmolLM2's shape, whose rows are a few heads of 64 floats.

Its numbers are torch's, bit for bit: for d < half, out[d] = x[d] * cos[d] + (-x[d + half]) *
sin[d], and out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half], each product
and the sum rounded once, as torch's elementwise product and sum round them (negation is
exact). Compiled with -ffp-contract=off and without -ffast-math, so the compiler may not fuse
a product into the sum: the same numbers on every machine, vector units or not.
*/
#include "kvgate_lanes.h"

/* x: rows x heads x dim floats (row r, head h at x + r * row_stride + h * head_stride, its dim
   floats contiguous); cos/sin: one table row per x row (at r * table_stride), dim floats;
   out: rows x heads x dim, contiguous. dim is even. */
void kvgate_rotate_halves_f32(const float *x, int64_t rows, int64_t heads, int64_t dim,
                              int64_t row_stride, int64_t head_stride, const float *cos,
                              const float *sin, int64_t table_stride, float *out) {
    const int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * table_stride, *s = sin + r * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *a = x + r * row_stride + h * head_stride, *b = a + half;
            float *o = out + (r * heads + h) * dim;
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const v8 low = load8(a + d), high = load8(b + d);
                store8(o + d, low * load8(c + d) + (-high) * load8(s + d));
                store8(o + half + d, high * load8(c + half + d) + low * load8(s + half + d));
            }
            for (; d < half; d++) {
                o[d] = a[d] * c[d] + (-b[d]) * s[d];
                o[half + d] = b[d] * c[half + d] + a[d] * s[half + d];
            }
        }
    }
}
