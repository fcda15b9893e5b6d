// The most a second thread can give on this machine: the speed-up of two threads over one for work the threads do
// not share, alternating the two counts round by round (a slow phase of a shared machine falls on both). A training
// step's kernels are bounded by it: their multiply-adds by the first line, their passes over tensors in a core's
// cache by the second, over tensors that outgrow the caches by the third.
//
//     gcc -O2 -march=native -fopenmp benchmarks/two_threads_ceiling.c -o /tmp/two_threads_ceiling
//     OMP_WAIT_POLICY=passive /tmp/two_threads_ceiling [ROUNDS]
//
// Prints, for each kind of work, the median over ROUNDS (default 21) of its milliseconds on one thread and on two
// (the same work, halved between the threads) and their ratio:
// - multiply-adds: 10 independent chains of vector fused multiply-adds per thread, in registers (no memory);
// - passes in cache: a thread's 128 KB array updated in place 1024 times over (each core's own L2 cache);
// - passes in memory: a thread's 32 MB array updated in place (from memory, the caches' size exceeded).
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

typedef float v8 __attribute__((vector_size(32)));

static float multiply_adds(long iterations) {
    v8 a[10];
    const v8 m = {0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f};
    const v8 c = m * 1e-7f;
    for (int j = 0; j < 10; ++j) a[j] = m + (float)j;
    for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 10
        for (int j = 0; j < 10; ++j) a[j] = a[j] * m + c;
    }
    float sum = 0.0f;
    for (int j = 0; j < 10; ++j) sum += a[j][0];
    return sum;
}

static void passes(float* array, long n, int times) {
    for (int t = 0; t < times; ++t)
        for (long i = 0; i < n; ++i) array[i] = array[i] * 0.5f + 1.0f;
}

static int by_value(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}

enum { KINDS = 3, MOST_ROUNDS = 101 };

int main(int argc, char** argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 21;
    rounds = rounds < 1 ? 1 : rounds > MOST_ROUNDS ? MOST_ROUNDS : rounds;
    const long iterations = 1L << 22, cached = 1L << 15, large = 1L << 23;  // floats: 128 KB and 32 MB a thread
    float* arrays[2];
    for (int t = 0; t < 2; ++t) {
        arrays[t] = aligned_alloc(64, large * sizeof(float));
        if (!arrays[t]) return 1;
        for (long i = 0; i < large; ++i) arrays[t][i] = 1.0f;
    }
    static double ms[KINDS][2][MOST_ROUNDS];
    volatile float sink = 0.0f;
    for (int r = 0; r < rounds; ++r)
        for (int k = 0; k < 2; ++k) {
            const int threads = (r + k) % 2 + 1;       // 1, 2 in even rounds; 2, 1 in odd ones
            for (int kind = 0; kind < KINDS; ++kind) {
                const double began = omp_get_wtime();
#pragma omp parallel num_threads(threads)
                {
                    float* mine = arrays[omp_get_thread_num()];
                    if (kind == 0) {
                        const float v = multiply_adds(iterations / threads);
#pragma omp atomic
                        sink += v;
                    } else if (kind == 1) {
                        passes(mine, cached, 1024 * 2 / threads);
                    } else {
                        passes(mine, large, 2 / threads);
                    }
                }
                ms[kind][threads - 1][r] = (omp_get_wtime() - began) * 1e3;
            }
        }
    const char* names[KINDS] = {"multiply-adds in registers", "passes over 128 KB in cache",
                                "passes over 32 MB in memory"};
    for (int kind = 0; kind < KINDS; ++kind) {
        for (int t = 0; t < 2; ++t) qsort(ms[kind][t], rounds, sizeof(double), by_value);
        const double one = ms[kind][0][rounds / 2], two = ms[kind][1][rounds / 2];
        printf("%-28s 1 thread %7.2f ms, 2 threads %7.2f ms: %.2fx\n", names[kind], one, two, one / two);
    }
    return sink == 12345.0f;
}
