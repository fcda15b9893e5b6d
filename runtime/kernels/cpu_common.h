// What the compiled kernels of the runtime (cpu_ops.c, the generic kernels' library) and of a program (its
// `<program>.c`, generated from codegen_templates/kernels.c.jinja, a library of its own) share: the headers, the
// math functions that vectorize (deepdsl_math.h), the elementwise kernels' and per-channel sums' sizes, and a
// thread's share of a loop. Both libraries run on one OpenMP runtime (the process's libgomp): the thread count the
// generic library's `deepdsl_set_threads` sets is the one the program's kernels run on.
#ifndef DEEPDSL_CPU_COMMON_H
#define DEEPDSL_CPU_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "deepdsl_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* an elementwise kernel is a single pass: worth the team of threads only when it is long; from 2^16 elements (a
   ViT's 64 x 16 x 64 activations: each half in its own core's cache) rather than 2^18, the ViT's step at two
   threads ran 0.90-0.98x as long in four runs, LeNet's and MobileNet-v2's within noise */
#define DEEPDSL_EW_PARALLEL_MIN (1L << 16)
#define DEEPDSL_CSUM_BLOCK 256          /* channels a per-channel sum reads at a time, sample by sample */
#define DEEPDSL_CSUM_PLANE 256          /* planes of at most this many floats are summed position by position */
#define DEEPDSL_CSUM_ROW 64             /* ... but those of this many at least a row at a time (channel sums) */
#define DEEPDSL_CSUM_LANES 4096         /* floats of such sums' lanes (16 KB, on the stack) */
#define DEEPDSL_CSUM_SAMPLES 32         /* samples a lane sums in float32 before it is added in double */

// Whether a kernel's pass over `work` elements runs on the calling thread alone: below `least`, or where the kernels
// have one thread. Such a call enters no OpenMP region: one that runs on one thread (`#pragma omp parallel if` false)
// still costs 1.0-1.5 us to enter and leave, as much as the call into the library (a step makes hundreds of calls).
static inline int deepdsl_alone(long work, long least) {
#ifdef _OPENMP
    return work < least || omp_get_max_threads() < 2;
#else
    (void)work;
    (void)least;
    return 1;
#endif
}

// [*begin, *end): this thread's share of n items in an OpenMP team (all of them outside one), in whole blocks of
// `block` items (16 elements: a vector's worth; 1 row).
static inline void deepdsl_share(long n, long block, long* begin, long* end) {
#ifdef _OPENMP
    const long threads = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const long threads = 1, me = 0;
#endif
    const long blocks = (n + block - 1) / block, per = (blocks + threads - 1) / threads;
    *begin = me * per * block < n ? me * per * block : n;
    *end = (me + 1) * per * block < n ? (me + 1) * per * block : n;
}

// Keep a loaded vector in a register for all its uses. Without this, gcc folds the load into each fused
// multiply-add that uses it (a memory operand) when a tile's sums fill the registers: AVX2's blocked tile of three
// half blocks by 4 positions then made 16 loads for 12 multiply-adds instead of 7, and ran at 59 GFLOP/s instead of
// 88 (ResNet-50's 7x7 forward on one Zen 4 core). An empty asm statement that may change the value makes the
// compiler hold it in a vector register (any of AVX-512's 32). Without AVX it does nothing: no register holds the
// kernels' vectors of 8 floats there.
#if defined(__AVX512F__)
#define DEEPDSL_IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__AVX__)
#define DEEPDSL_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define DEEPDSL_IN_REGISTER(v) ((void)0)
#endif

// This thread's part of `size` floats of `scratch` in an OpenMP team (the whole of it outside one).
static inline float* deepdsl_thread_part(float* scratch, long size) {
#ifdef _OPENMP
    return scratch + omp_get_thread_num() * size;
#else
    (void)size;
    return scratch;
#endif
}

#endif
