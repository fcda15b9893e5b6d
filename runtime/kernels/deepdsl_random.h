// Dropout's masks, for the compiled CPU kernels (cpu_ops.c) and the CUDA kernels (deepdsl_common.cuh, which defines
// DEEPDSL_HD first): the same per-group function on both, written in the C both compilers take.
//
// Philox4x64-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) is the counter-based
// generator numpy's np.random.Philox implements. A mask keyed by (seed, stream = step * 65536 + key) is what
// np.random.Generator(np.random.Philox(key=[seed, stream])).random(dtype=np.float32) < keep gives
// (deepdsl_runtime.contract.mask_generator): float e of the stream uses 32 bits of 64-bit draw e / 2 (the low half
// first), (bits >> 8) * 2^-24, and draw d comes from counter 1 + d / 4. One group is one Philox block: four 64-bit
// draws, eight mask bytes. Every byte is a function of its index alone, so the result does not depend on how the
// groups are shared among threads.
#pragma once

#ifndef DEEPDSL_HD
#define DEEPDSL_HD static inline __attribute__((always_inline))
#endif

typedef unsigned long long deepdsl_u64;
typedef struct {
    deepdsl_u64 v[4];
} deepdsl_philox4x64;

// the high 64 bits of a * b. On a host with AVX-512's 64-bit vector products, from 32-bit halves, which vectorize (a
// loop over groups of the CPU kernel runs eight at a time); elsewhere one 64 x 64 -> 128-bit product of a scalar
// register (AVX2's vectors would emulate the low 64 bits of a product too: the scalar products take half the time)
#if defined(__AVX512DQ__) || !defined(__SIZEOF_INT128__)
#define DEEPDSL_PHILOX_VECTORS 1
#else
#define DEEPDSL_PHILOX_VECTORS 0
#endif
DEEPDSL_HD deepdsl_u64 deepdsl_mulhi64(deepdsl_u64 a, deepdsl_u64 b) {
#ifdef __CUDA_ARCH__
    return __umul64hi(a, b);
#elif !DEEPDSL_PHILOX_VECTORS
    return (deepdsl_u64)(((unsigned __int128)a * b) >> 64);
#else
    const deepdsl_u64 a0 = a & 0xffffffffULL, a1 = a >> 32, b0 = b & 0xffffffffULL, b1 = b >> 32;
    const deepdsl_u64 low = a0 * b0, middle = a1 * b0, other = a0 * b1;
    const deepdsl_u64 cross = (low >> 32) + (middle & 0xffffffffULL) + other;
    return a1 * b1 + (middle >> 32) + (cross >> 32);
#endif
}

#define DEEPDSL_PHILOX_M0 0xD2E7470EE14C6C93ULL
#define DEEPDSL_PHILOX_M1 0xCA5A826395121157ULL
#define DEEPDSL_PHILOX_W0 0x9E3779B97F4A7C15ULL
#define DEEPDSL_PHILOX_W1 0xBB67AE8584CAA73BULL

// the high 64 bits of a * b, its low 64 bits in *lo: one 128-bit product where a scalar register makes it (GCC made
// a second product for the low half)
DEEPDSL_HD deepdsl_u64 deepdsl_mulhilo64(deepdsl_u64 a, deepdsl_u64 b, deepdsl_u64* lo) {
#if !defined(__CUDA_ARCH__) && !DEEPDSL_PHILOX_VECTORS
    const unsigned __int128 product = (unsigned __int128)a * b;
    *lo = (deepdsl_u64)product;
    return (deepdsl_u64)(product >> 64);
#else
    *lo = a * b;
    return deepdsl_mulhi64(a, b);
#endif
}

// one round of Philox4x64 on the counter (c0, c1, c2, c3) with the round's key (k0, k1)
DEEPDSL_HD void deepdsl_philox_round(deepdsl_u64* c0, deepdsl_u64* c1, deepdsl_u64* c2, deepdsl_u64* c3,
                                     deepdsl_u64 k0, deepdsl_u64 k1) {
    deepdsl_u64 lo0, lo1;
    const deepdsl_u64 hi0 = deepdsl_mulhilo64(DEEPDSL_PHILOX_M0, *c0, &lo0);
    const deepdsl_u64 hi1 = deepdsl_mulhilo64(DEEPDSL_PHILOX_M1, *c2, &lo1);
    *c0 = hi1 ^ *c1 ^ k0;
    *c1 = lo1;
    *c2 = hi0 ^ *c3 ^ k1;
    *c3 = lo0;
}

DEEPDSL_HD deepdsl_philox4x64 deepdsl_philox4x64_10(deepdsl_philox4x64 ctr, deepdsl_u64 k0, deepdsl_u64 k1) {
    for (int round = 0; round < 10; ++round)
        deepdsl_philox_round(&ctr.v[0], &ctr.v[1], &ctr.v[2], &ctr.v[3], k0 + round * DEEPDSL_PHILOX_W0,
                             k1 + round * DEEPDSL_PHILOX_W1);
    return ctr;
}

// 1 where the uniform of 32 random bits is below keep
DEEPDSL_HD unsigned char deepdsl_bernoulli_bit(unsigned bits, float keep) {
    return (float)(bits >> 8) * (1.0f / 16777216.0f) < keep ? 1 : 0;
}

// Mask bytes group * 8 .. group * 8 + 7 (those below n) of the mask keyed by (seed, stream).
DEEPDSL_HD void deepdsl_bernoulli_group(unsigned long long group, unsigned long long n, deepdsl_u64 seed,
                                        deepdsl_u64 stream, float keep, unsigned char* out) {
    deepdsl_philox4x64 ctr;
    ctr.v[0] = group + 1;
    ctr.v[1] = ctr.v[2] = ctr.v[3] = 0;
    const deepdsl_philox4x64 r = deepdsl_philox4x64_10(ctr, seed, stream);
    for (unsigned t = 0; t < 8 && group * 8 + t < n; ++t) {
        const deepdsl_u64 draw = r.v[t >> 1];
        out[group * 8 + t] = deepdsl_bernoulli_bit((unsigned)((t & 1) ? (draw >> 32) : (draw & 0xffffffffULL)), keep);
    }
}
