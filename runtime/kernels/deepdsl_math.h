// The functions printed elementwise expressions call beyond <math.h>, for the compiled CPU kernels (cpu_ops.c) and
// the CUDA kernels (deepdsl_common.cuh, which defines DEEPDSL_HD first). Include <math.h> first.
//
// Max and Min as numpy's maximum and minimum compute them: a NaN operand gives NaN (fmaxf and fminf would return the
// other operand, hiding a NaN a ReLU receives), equal operands give the first. A comparison and a select: no call
// into libm (which fmaxf is on the CPU without -ffinite-math-only), so the loops that use them vectorize.
#pragma once

// (inlined always: a loop calling one of these, in the many elementwise kernels of a program, then vectorizes)
#ifndef DEEPDSL_HD
#define DEEPDSL_HD static inline __attribute__((always_inline))
#endif

DEEPDSL_HD float deepdsl_maxf(float a, float b) { return (a >= b || a != a) ? a : b; }
DEEPDSL_HD float deepdsl_minf(float a, float b) { return (a <= b || a != a) ? a : b; }

// a * b + c, one rounding where the processor has fused multiply-adds (as every processor with AVX2 has; the same
// bits on each), else a product and a sum. (fmaf elsewhere is a call into libm, which keeps a loop scalar.)
#if defined(__FMA__) || defined(__CUDA_ARCH__)
#define DEEPDSL_MADD(a, b, c) fmaf(a, b, c)
#else
#define DEEPDSL_MADD(a, b, c) ((a) * (b) + (c))
#endif

// exp(x) to within one ulp, branch-free so that loops of it vectorize: 2^n exp(r), n = round(x / ln 2), |r| <= ln 2 /
// 2 (ln 2 split in two so that n ln 2 is exact), exp(r) by a polynomial of degree 7 (fused multiply-adds); 2^n as
// two factors, both normal floats, over the whole range; 0 below log(FLT_MIN) (where the result would be
// subnormal), inf above log(FLT_MAX), NaN for NaN.
// DEEPDSL_EXP_REDUCED(x, t, y, MADD): y = exp(r) of x = t ln 2 + r, t the rounded x / ln 2 (float or vector `t`,
// `y` declared by the caller's types, MADD(a, b, c) = a * b + c on them: DEEPDSL_MADD for floats); shared with the
// eight-lane form of the compiled kernels (cpu_attention.c), which gives the same bits.
#define DEEPDSL_LOG2E 1.44269504088896341f
#define DEEPDSL_EXP_REDUCED(x, t, y, MADD)                                                                         \
    do {                                                                                                            \
        const __typeof__(x) r_ = MADD(t, 2.12194440e-4f, (x) - (t) * 0.693359375f);                                 \
        __typeof__(x) p_ = MADD(r_, 1.9875691500e-4f, 1.3981999507e-3f);                                            \
        p_ = MADD(p_, r_, 8.3334519073e-3f);                                                                        \
        p_ = MADD(p_, r_, 4.1665795894e-2f);                                                                        \
        p_ = MADD(p_, r_, 1.6666665459e-1f);                                                                        \
        p_ = MADD(p_, r_, 5.0000001201e-1f);                                                                        \
        (y) = MADD(MADD(p_, r_, 1.0f), r_, 1.0f);             /* 1 + r (1 + p r) */                                 \
    } while (0)
#define DEEPDSL_EXP_LOW -87.33654f     /* below: 0 (the result would be subnormal) */
#define DEEPDSL_EXP_HIGH 88.72283f     /* above: inf */

DEEPDSL_HD float deepdsl_expf_poly(float x) {
    const float t = rintf(x * DEEPDSL_LOG2E);
    float y;
    DEEPDSL_EXP_REDUCED(x, t, y, DEEPDSL_MADD);
    const int n = (int)t, half = n >> 1;
    union { unsigned i; float f; } a, b;
    a.i = (unsigned)(half + 127) << 23;
    b.i = (unsigned)(n - half + 127) << 23;
    float e = (y * a.f) * b.f;
    e = x < DEEPDSL_EXP_LOW ? 0.0f : e;
    e = x > DEEPDSL_EXP_HIGH ? INFINITY : e;
    return x != x ? x : e;
}

// exp as the elementwise kernels call it: the device's expf on the GPU, deepdsl_expf_poly on the CPU (libm's expf is a
// call per element, which keeps a loop scalar)
DEEPDSL_HD float deepdsl_expf(float x) {
#ifdef __CUDA_ARCH__
    return expf(x);
#else
    return deepdsl_expf_poly(x);
#endif
}

// erf(x) within 6 ulp (7 without fused multiply-adds), branch-free so that the compiled CPU kernels' loops
// vectorize (libm's erff is a call per element): x P(x^2) / Q(x^2) below 3.92 in magnitude, P of degree 6 and Q of
// degree 5 with Q(0) = 1 (a rational fit to erf(x) / x over x^2 in [0, 16], by least squares on the relative error
// linearized, reweighted towards its maximum: 2e-9 in float64; the rest is float32's rounding of the two
// polynomials, the product and the quotient), 1 (with the sign of x) from 3.92 on. One quotient and eleven
// multiply-adds (DEEPDSL_MADD), where a polynomial on each side of a seam, the larger one through exp, took three
// times as long. The CUDA kernels call the device's erff.
DEEPDSL_HD float deepdsl_erff(float x) {
#ifdef __CUDA_ARCH__
    return erff(x);
#else
    const float a = fabsf(x), z = a * a;
    float p = -1.3203229070631054e-08f;
    p = DEEPDSL_MADD(p, z, 4.684976694467868e-06f);
    p = DEEPDSL_MADD(p, z, 0.00037961608045203066f);
    p = DEEPDSL_MADD(p, z, 0.00384961973903867f);
    p = DEEPDSL_MADD(p, z, 0.054317036650762665f);
    p = DEEPDSL_MADD(p, z, 0.18520286620596413f);
    p = DEEPDSL_MADD(p, z, 1.1283791693768292f);
    float q = 6.31124729699134e-05f;
    q = DEEPDSL_MADD(q, z, 0.0013075812987931586f);
    q = DEEPDSL_MADD(q, z, 0.015462130876918622f);
    q = DEEPDSL_MADD(q, z, 0.11395842191193298f);
    q = DEEPDSL_MADD(q, z, 0.49746518058770905f);
    q = DEEPDSL_MADD(q, z, 1.0f);
    const float r = a < 3.92f ? x * p / q : copysignf(1.0f, x);
    return x != x ? x : r;
#endif
}

// The logistic function and softplus without overflow (deepdsl.ops.elementwise's Sigmoid and Softplus): expf(-x) is
// inf for x < -88, 1 / (1 + inf) the right 0; softplus as max(x, 0) + log1p(exp(-|x|)), never log(1 + inf).
DEEPDSL_HD float deepdsl_sigmoidf(float x) { return 1.0f / (1.0f + deepdsl_expf(-x)); }
DEEPDSL_HD float deepdsl_softplusf(float x) { return (x > 0.0f ? x : 0.0f) + log1pf(deepdsl_expf(-fabsf(x))); }

