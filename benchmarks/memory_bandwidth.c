// How fast this machine reads memory that is not in its caches, on one thread and on two: what bounds the
// elementwise kernels, the sums and the convolutions' copying passes of a training step whose tensors outgrow the
// caches (a pass over such a tensor runs at memory speed, not at the speed of the same pass timed alone, warm).
//
//     gcc -O3 -march=native -fopenmp benchmarks/memory_bandwidth.c -o /tmp/memory_bandwidth && /tmp/memory_bandwidth
//
// Prints, for 1 and 2 threads, the best of 5 sums over a 1 GiB array of floats (each thread a contiguous half),
// in GB/s read; then the mean microseconds of summing 400 KB (a batch of 8 x 256 x 7 x 7 floats) at a random place
// in it, one thread.
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
    const long n = 1L << 28;
    float* a = aligned_alloc(64, n * sizeof(float));
    if (!a) return 1;
    memset(a, 0, n * sizeof(float));
    float keep = 0.0f;
    for (int threads = 1; threads <= 2; ++threads) {
        double best = 1e9;
        for (int round = 0; round < 5; ++round) {
            const double began = omp_get_wtime();
            float sum = 0.0f;
#pragma omp parallel for simd num_threads(threads) reduction(+ : sum)
            for (long i = 0; i < n; ++i) sum += a[i];
            const double took = omp_get_wtime() - began;
            if (took < best) best = took;
            keep += sum;
        }
        printf("%d thread%s: %.1f GB/s read\n", threads, threads > 1 ? "s" : "", n * sizeof(float) / best / 1e9);
    }
    const long chunk = 8 * 256 * 7 * 7;
    const int rounds = 2000;
    double total = 0.0;
    srand(1);
    for (int round = 0; round < rounds; ++round) {
        const long at = (rand() % (n / chunk - 1)) * chunk;
        const double began = omp_get_wtime();
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (long i = at; i < at + chunk; ++i) sum += a[i];
        total += omp_get_wtime() - began;
        keep += sum;
    }
    printf("%ld floats from memory: %.1f us, one thread\n", chunk, total / rounds * 1e6);
    free(a);
    return keep == 1.0f;    // (the sums are used)
}
