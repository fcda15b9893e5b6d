// The generic kernels of the compiled CPU backend (deepdsl_runtime.cpu.native), included by every generated
// program's `<program>.c` before its own elementwise kernels; built with OpenMP into `<program>.<digest>.so`:
// the im2col copies and axis swaps of the convolutions.
//
// Each kernel computes exactly what the numpy kernel it replaces computes (runtime/cpu/), on the same memory: no
// scratch beyond what that kernel's plan gives (these need none), outputs never overlapping inputs (the Python
// side runs takeovers chunk by chunk, as for numpy). Loops are branch-free where it matters, threads split
// independent rows, and every thread writes only its own outputs: results do not depend on the thread count.
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define DEEPDSL_PARALLEL_MIN 16384      /* below this many elements a kernel runs on one thread */

void deepdsl_set_threads(int threads) {
#ifdef _OPENMP
    omp_set_num_threads(threads > 0 ? threads : 1);
#else
    (void)threads;
#endif
}

int deepdsl_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

// Output positions [*lo, *hi) whose input coordinate offset + stride * p - pad lies in [0, size).
static inline void deepdsl_valid(int offset, int size, int out, int stride, int pad, int* lo, int* hi) {
    int p0 = pad - offset > 0 ? (pad - offset + stride - 1) / stride : 0;
    int p1 = (size - 1 + pad - offset) / stride + 1;
    if (size - 1 + pad - offset < 0) p1 = 0;
    if (p1 > out) p1 = out;
    *lo = p0;
    *hi = p1 > p0 ? p1 : p0;
}

// cols[ch][i][j][s][p][q] = x[s][ch][i + stride*p - pad][j + stride*q - pad], 0 outside x: the im2col matrix of m
// samples as (C*kh*kw, m*Ho*Wo) rows, the layout runtime/cpu/conv.py multiplies.
void deepdsl_im2col(const float* x, int m, int c, int h, int w, int kh, int kw, int ho, int wo, int stride,
                    int pad, float* cols) {
    const long rows = (long)c * kh * kw;
    const long plane = (long)ho * wo;
#pragma omp parallel for collapse(2) schedule(static) if (rows * m * plane >= DEEPDSL_PARALLEL_MIN)
    for (long r = 0; r < rows; ++r) {
        for (int s = 0; s < m; ++s) {
            const int ch = (int)(r / ((long)kh * kw)), i = (int)((r / kw) % kh), j = (int)(r % kw);
            const float* src = x + ((long)s * c + ch) * h * w;
            float* dst = cols + (r * m + s) * plane;
            int q0, q1;
            deepdsl_valid(j, w, wo, stride, pad, &q0, &q1);
            for (int p = 0; p < ho; ++p) {
                float* d = dst + (long)p * wo;
                const int y = i + stride * p - pad;
                if (y < 0 || y >= h || q1 <= q0) {
                    memset(d, 0, sizeof(float) * wo);
                    continue;
                }
                const float* row = src + (long)y * w + j - pad;
                for (int q = 0; q < q0; ++q) d[q] = 0.0f;
                if (stride == 1) {
                    memcpy(d + q0, row + q0, sizeof(float) * (q1 - q0));
                } else {
                    for (int q = q0; q < q1; ++q) d[q] = row[(long)stride * q];
                }
                for (int q = q1; q < wo; ++q) d[q] = 0.0f;
            }
        }
    }
}

// dst[b][a][k] = src[a][b][k] for a < na, b < nb, k < inner (swapping the two outer axes).
void deepdsl_swap01(const float* src, long na, long nb, long inner, float* dst) {
#pragma omp parallel for collapse(2) schedule(static) if (na * nb * inner >= DEEPDSL_PARALLEL_MIN)
    for (long b = 0; b < nb; ++b)
        for (long a = 0; a < na; ++a)
            memcpy(dst + (b * na + a) * inner, src + (a * nb + b) * inner, sizeof(float) * inner);
}
