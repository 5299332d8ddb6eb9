/* The vector helpers every kvgate kernel computes with (gateway/engine/native/build.py puts
   this directory on the include path and digests this file into every library's name, so a
   change here rebuilds every kernel).

Eight lanes everywhere (v8), sixteen where the CPU has AVX-512 (v16). Their arithmetic is IEEE
and exactly rounded: fma8/fma16 are fused multiply-adds, one rounding each, whether the
instruction or the C library's fmaf computes them; tree8 adds a vector's lanes in one fixed
tree. A kernel built with or without the vector flags therefore computes the same numbers;
only the speed differs.
*/
#ifndef KVGATE_LANES_H
#define KVGATE_LANES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

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

/* The lanes added in a fixed tree. */
static inline float tree8(v8 a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat16(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* a * b + c, rounded once, sixteen lanes. */
static inline v16 fma16(v16 a, v16 b, v16 c) {
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#endif

#endif
