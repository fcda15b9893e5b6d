// The functions printed elementwise expressions call beyond <math.h>, for the compiled CPU kernels (cpu_ops.c) and
// the CUDA kernels (deepdsl_common.cuh, which defines DEEPDSL_HD first). Include <math.h> first.
//
// Max and Min as numpy's maximum and minimum compute them: a NaN operand gives NaN (fmaxf and fminf would return the
// other operand, hiding a NaN a ReLU receives), equal operands give the first. A comparison and a select: no call
// into libm (which fmaxf is on the CPU without -ffinite-math-only), so the loops that use them vectorize.
#pragma once

#ifndef DEEPDSL_HD
#define DEEPDSL_HD static inline
#endif

DEEPDSL_HD float deepdsl_maxf(float a, float b) { return (a >= b || a != a) ? a : b; }
DEEPDSL_HD float deepdsl_minf(float a, float b) { return (a <= b || a != a) ? a : b; }

// The logistic function and softplus without overflow (deepdsl.ops.elementwise's Sigmoid and Softplus): expf(-x) is
// inf for x < -88, 1 / (1 + inf) the right 0; softplus as max(x, 0) + log1p(exp(-|x|)), never log(1 + inf).
DEEPDSL_HD float deepdsl_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
DEEPDSL_HD float deepdsl_softplusf(float x) { return (x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x))); }
