// How long an idle OpenMP thread spins before it sleeps, and what a parallel region costs after it slept: the
// region's time after the master thread worked alone for a gap of G microseconds.
//
//     gcc -O2 -fopenmp benchmarks/omp_wake.c -o /tmp/omp_wake
//     OMP_WAIT_POLICY=passive GOMP_SPINCOUNT=10000 OMP_NUM_THREADS=2 /tmp/omp_wake
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void) {  // microseconds
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
int main(void) {
    volatile double sink = 0;
#pragma omp parallel
    { sink += 1; }  // the team's threads start here, not in the first timed region
    const int gaps[] = {5, 20, 50, 100, 150, 200, 300, 500, 1000, 3000};
    for (int g = 0; g < 10; ++g) {
        double total = 0; int reps = 200;
        for (int r = 0; r < reps; ++r) {
#pragma omp parallel
            { sink += 1; }
            double t0 = now(); while (now() - t0 < gaps[g]) {}
            double a = now();
#pragma omp parallel
            { sink += 1; }
            total += now() - a;
        }
        printf("gap %5d us: region %.1f us\n", gaps[g], total / reps);
    }
    return 0;
}
