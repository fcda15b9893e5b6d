// The generic kernels of the compiled CPU backend (deepdsl_runtime.cpu.native), built with OpenMP into one library
// every program on this machine shares, `deepdsl_cpu.<digest>.so` (a program's own elementwise kernels are a
// library of their own, `<program>.<digest>.so`; what both include is cpu_common.h):
// the im2col copies and col2im additions of the convolutions (cpu_columns.c), their axis swaps, thin convolutions
// and their filter gradients (cpu_conv.c, included at the end), direct convolutions of many channels on blocked
// copies (cpu_blocked.c), max pooling with its argmax, and its gradient,
// attention and its gradient (cpu_attention.c).
//
// Each kernel computes what the numpy kernel it replaces computes (runtime/cpu/; exactly, but for the sums of thin
// convolutions' filter gradients and LRN's power with beta 0.75, which round differently), on the same memory: no
// scratch beyond what that kernel's plan gives (these need none, but for arrays of a fixed size on the stack),
// outputs never overlapping inputs (the Python side runs takeovers chunk by chunk, as for numpy). Loops are
// branch-free where it matters, threads split independent rows, and every thread writes only its own outputs:
// results do not depend on the thread count.
#include "cpu_common.h"
#include "deepdsl_random.h"
#if defined(__FMA__) || defined(__AVX__)
#include <immintrin.h>
#endif

// Vectors of 8 and 4 floats (GCC's vector extensions: SIMD code on any target, AVX2 here), where the compiler does
// not vectorize a loop by itself. A comparison gives a mask of all ones or zeros per lane; `select` blends by it.
typedef float deepdsl_v8f __attribute__((vector_size(32)));
typedef int deepdsl_v8i __attribute__((vector_size(32)));
typedef uint8_t deepdsl_v8b __attribute__((vector_size(8)));
typedef float deepdsl_v4f __attribute__((vector_size(16)));
typedef int deepdsl_v4i __attribute__((vector_size(16)));
typedef uint8_t deepdsl_v4b __attribute__((vector_size(4)));
#define DEEPDSL_SELECT(VF, VI, mask, a, b) ((VF)(((VI)(a) & (mask)) | ((VI)(b) & ~(mask))))

// the 8 floats at p, a vector's load from any address
static inline __attribute__((always_inline)) deepdsl_v8f deepdsl_load8(const float* p) {
    deepdsl_v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

// Masked vectors of 8 floats (AVX: masked-off lanes are neither read nor written, so a vector may reach past the
// ends of an array): rows whose ends fall inside a vector (padding, short output rows).
#if defined(__AVX__)
#define DEEPDSL_MASKED 1
// The lanes l of a vector whose position first + l lies in [0, size): all ones, else zeros.
static inline __attribute__((always_inline)) deepdsl_v8i deepdsl_inside(int first, int size) {
    const deepdsl_v8i at = (deepdsl_v8i){0, 1, 2, 3, 4, 5, 6, 7} + first;
    return (at >= 0) & (at < size);
}
// from[l] where mask lane l is set, else 0; masked-off lanes are not read (they may lie outside the array). With
// AVX-512 the mask goes to a mask register: AVX's own masked stores are slow on AMD's processors.
#if defined(__AVX512VL__)
static inline __attribute__((always_inline)) __mmask8 deepdsl_lanes(deepdsl_v8i mask) {
    return _mm256_cmplt_epi32_mask((__m256i)mask, _mm256_setzero_si256());
}
static inline __attribute__((always_inline)) deepdsl_v8f deepdsl_load(const float* from, deepdsl_v8i mask) {
    return (deepdsl_v8f)_mm256_maskz_loadu_ps(deepdsl_lanes(mask), from);
}
static inline __attribute__((always_inline)) void deepdsl_store(float* to, deepdsl_v8i mask, deepdsl_v8f v) {
    _mm256_mask_storeu_ps(to, deepdsl_lanes(mask), (__m256)v);
}
#else
static inline __attribute__((always_inline)) deepdsl_v8f deepdsl_load(const float* from, deepdsl_v8i mask) {
    return (deepdsl_v8f)_mm256_maskload_ps(from, (__m256i)mask);
}
static inline __attribute__((always_inline)) void deepdsl_store(float* to, deepdsl_v8i mask, deepdsl_v8f v) {
    _mm256_maskstore_ps(to, (__m256i)mask, (__m256)v);
}
#endif
// The 8 floats at `from`, element j of a row of `size` (j a multiple of 8): a plain load where all 8 lie inside the
// row, else deepdsl_load's of those inside (AVX2's masked moves cost several times a plain one on AMD's processors:
// only a row's last, partial vector takes one); and the store alike.
static inline __attribute__((always_inline)) deepdsl_v8f deepdsl_load_in(const float* from, long j, long size) {
    return j + 8 > size ? deepdsl_load(from, deepdsl_inside((int)j, (int)size)) : deepdsl_load8(from);
}
static inline __attribute__((always_inline)) void deepdsl_store_in(float* to, long j, long size, deepdsl_v8f v) {
    if (j + 8 > size)
        deepdsl_store(to, deepdsl_inside((int)j, (int)size), v);
    else
        memcpy(to, &v, sizeof v);
}
#else
#define DEEPDSL_MASKED 0
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

// Row loops called from parallel regions are functions of their own: their arguments are locals (inside a region a
// variable the threads share is read again after every store through a pointer), so their loops vectorize: by
// explicit vectors or `omp simd` (at -O2 gcc vectorizes no loop whose count it does not know by itself).
#define DEEPDSL_ROW static __attribute__((noinline))

// Output positions [*lo, *hi) whose input coordinate offset + stride * p - pad lies in [0, size).
static inline void deepdsl_valid(int offset, int size, int out, int stride, int pad, int* lo, int* hi) {
    int p0 = pad - offset > 0 ? (pad - offset + stride - 1) / stride : 0;
    int p1 = (size - 1 + pad - offset) / stride + 1;
    if (size - 1 + pad - offset < 0) p1 = 0;
    if (p1 > out) p1 = out;
    *lo = p0;
    *hi = p1 > p0 ? p1 : p0;
}

// v[i][k] <-> v[k][i]: 8 x 8 floats transposed in registers (pairs interleaved, then quads, then halves swapped).
static inline __attribute__((always_inline)) void deepdsl_transpose8(deepdsl_v8f v[8]) {
    const deepdsl_v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const deepdsl_v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const deepdsl_v8i first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    deepdsl_v8f t[8], u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(v[i], v[i + 1], lo);
        t[i + 1] = __builtin_shuffle(v[i], v[i + 1], hi);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i += 4) {
        u[i] = __builtin_shuffle(t[i], t[i + 2], lo2);
        u[i + 1] = __builtin_shuffle(t[i], t[i + 2], hi2);
        u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], lo2);
        u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], hi2);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 4; i++) {
        v[i] = __builtin_shuffle(u[i], u[i + 4], first);
        v[i + 4] = __builtin_shuffle(u[i], u[i + 4], second);
    }
}

// v[i] = the 8 floats at from + i * ld, and the 8 floats at to + i * ld = v[i], for i < 8: the rows of a transposition
// in registers (as a loop gcc left rolled, the vectors went through the stack in halves, and read back whole each
// waited on the halves' stores: 57 % of a depthwise convolution's time, a vector's channels at a time).
static inline __attribute__((always_inline)) void deepdsl_load8x8(deepdsl_v8f v[8], const float* from, long ld) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) memcpy(&v[i], from + i * ld, sizeof v[i]);
}

static inline __attribute__((always_inline)) void deepdsl_store8x8(float* to, long ld, const deepdsl_v8f v[8]) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) memcpy(to + i * ld, &v[i], sizeof v[i]);
}

// a (rows, cols; rows lda apart) -> to (cols, rows; rows ldt apart, zeros from column `rows` to ldt): blocks of
// 8 x 8 transposed in registers, a row of blocks of `to` at a time (its lines written whole), the edges one float at
// a time in order (stores a row apart would fall in few cache sets). Attention's units transposed; a strip of a b
// read transposed packed for the products' tiles, where one float at a time, each store 256 bytes past the one
// before, the packing cost more than the tiles' products on it (LeNet's second filter gradient, 50 x 4096 by 4096
// x 500 read transposed: 2.2 ms at one thread with AVX-512, 1.0 with b stored by rows).
static inline void deepdsl_transpose_into(const float* a, long rows, long cols, long lda, float* to, long ldt) {
    long r8 = 0, c8 = 0;
#if DEEPDSL_MASKED
    r8 = rows / 8 * 8, c8 = cols / 8 * 8;
    for (long c = 0; c < c8; c += 8)
        for (long r = 0; r < r8; r += 8) {
            deepdsl_v8f v[8];
            deepdsl_load8x8(v, a + r * lda + c, lda);
            deepdsl_transpose8(v);
            deepdsl_store8x8(to + c * ldt + r, ldt, v);
        }
#endif
    for (long c = 0; c < cols; ++c) {
        for (long r = c < c8 ? r8 : 0; r < rows; ++r) to[c * ldt + r] = a[r * lda + c];
        for (long r = rows; r < ldt; ++r) to[c * ldt + r] = 0.0f;
    }
}

// dst[k] = src[k] for k < n, the arrays apart: short runs (a convolution's output rows, often 4 to 32 floats) copied
// inline, which a call of memcpy per run costs several times over; 8 floats at a time, the last 8 (or 4) again where
// n is not a multiple of them (over floats already copied: a loop of single floats after the vectors made a row of
// 14 floats cost twice memcpy's time on a Zen 3).
static inline __attribute__((always_inline)) void deepdsl_copy_floats(float* dst, const float* src, long n) {
    if (n < 8) {
        if (n >= 4) {
            memcpy(dst, src, 4 * sizeof(float));
            memcpy(dst + n - 4, src + n - 4, 4 * sizeof(float));
        } else {
            for (long k = 0; k < n; ++k) dst[k] = src[k];
        }
        return;
    }
    deepdsl_v8f v;
    long k = 0;
    for (; k + 8 <= n; k += 8) {
        memcpy(&v, src + k, sizeof v);
        memcpy(dst + k, &v, sizeof v);
    }
    if (k < n) {
        memcpy(&v, src + n - 8, sizeof v);
        memcpy(dst + n - 8, &v, sizeof v);
    }
}

// depthwise convolutions: plane by plane, or 16 channels at a time
#include "cpu_depthwise.c"

// d[k] += s[k] for k < n (the arrays do not overlap).
static inline __attribute__((always_inline)) void deepdsl_add_floats(float* restrict d, const float* restrict s,
                                                                    long n) {
#pragma omp simd
    for (long k = 0; k < n; ++k) d[k] += s[k];
}

#include "cpu_columns.c"

DEEPDSL_ROW void deepdsl_copy_row(float* dst, const float* src, long n, float add) {
#pragma omp simd
    for (long k = 0; k < n; ++k) dst[k] = src[k] + add;
}

// dst[b][a][k] = src[a][b][k] (+ bias[a] when `bias` is not NULL) for a < na, b < nb, k < inner: the two outer
// axes swapped (a convolution's (O, samples, Ho*Wo) product regrouped by sample, its bias added on the way).
void deepdsl_swap01(const float* src, long na, long nb, long inner, const float* bias, float* dst) {
#pragma omp parallel for collapse(2) schedule(static) if (na * nb * inner >= DEEPDSL_PARALLEL_MIN)
    for (long b = 0; b < nb; ++b)
        for (long a = 0; a < na; ++a) {
            if (bias) deepdsl_copy_row(dst + (b * na + a) * inner, src + (a * nb + b) * inner, inner, bias[a]);
            else deepdsl_copy_floats(dst + (b * na + a) * inner, src + (a * nb + b) * inner, inner);
        }
}

// dst (P, B, M, A, R) = src (P, A, M, B, R): two axes of a tensor swapped (attention's heads and tokens), rows of R
// floats copied, the threads taking whole rows of dst.
void deepdsl_swap_axes(const float* src, long p, long a, long m, long b, long r, float* dst) {
#pragma omp parallel for collapse(2) schedule(static) if (p * a * m * b * r >= DEEPDSL_PARALLEL_MIN)
    for (long pi = 0; pi < p; ++pi)
        for (long bi = 0; bi < b; ++bi)
            for (long mi = 0; mi < m; ++mi)
                for (long ai = 0; ai < a; ++ai)
                    deepdsl_copy_floats(dst + (((pi * b + bi) * m + mi) * a + ai) * r,
                                        src + (((pi * a + ai) * m + mi) * b + bi) * r, r);
}

// dst[k] = src[k] for k < n, the arrays apart: the copies a kernel's Python makes around the library's calls (a
// sample staged through scratch, a product moved before its regrouping), on the kernels' threads in parts of
// DEEPDSL_COPY_PART floats.
#define DEEPDSL_COPY_PART 16384
void deepdsl_copy(const float* src, long n, float* dst) {
    const long parts = (n + DEEPDSL_COPY_PART - 1) / DEEPDSL_COPY_PART;
#pragma omp parallel for schedule(static) if (n >= DEEPDSL_PARALLEL_MIN)
    for (long p = 0; p < parts; ++p) {
        const long start = p * DEEPDSL_COPY_PART, end = start + DEEPDSL_COPY_PART < n ? start + DEEPDSL_COPY_PART : n;
        memcpy(dst + start, src + start, sizeof(float) * (end - start));
    }
}

// dst[k] += src[k] for k < n, the arrays apart (a chunk's filter gradient added to the sum of the chunks before),
// as deepdsl_copy's parts.
void deepdsl_accumulate(const float* src, long n, float* dst) {
    const long parts = (n + DEEPDSL_COPY_PART - 1) / DEEPDSL_COPY_PART;
#pragma omp parallel for schedule(static) if (n >= DEEPDSL_PARALLEL_MIN)
    for (long p = 0; p < parts; ++p) {
        const long start = p * DEEPDSL_COPY_PART, end = start + DEEPDSL_COPY_PART < n ? start + DEEPDSL_COPY_PART : n;
        deepdsl_add_floats(dst + start, src + start, end - start);
    }
}

// out (planes, h + 2 pad, w + 2 pad) = the h x w planes of x with `pad` zeros around each (a thin layer's input
// padded for its filter gradient), a plane per thread at a time.
void deepdsl_pad_planes(const float* x, long planes, long h, long w, long pad, float* out) {
    const long wp = w + 2 * pad, plane = (h + 2 * pad) * wp;
#pragma omp parallel for schedule(static) if (planes * plane >= DEEPDSL_PARALLEL_MIN)
    for (long k = 0; k < planes; ++k) {
        float* to = out + k * plane;
        memset(to, 0, sizeof(float) * (pad * wp + pad));
        for (long y = 0; y < h; ++y) {
            deepdsl_copy_floats(to + (y + pad) * wp + pad, x + (k * h + y) * w, w);
            // (the right margin of this row and the left margin of the next: 2 pad floats, or the last rows')
            memset(to + (y + pad) * wp + pad + w, 0, sizeof(float) * (y + 1 < h ? 2 * pad : pad + pad * wp));
        }
    }
}

// x[s][c][k] += bias[c] for s < n, c < channels, k < inner (a convolution's bias).
void deepdsl_add_bias(float* x, long n, long channels, long inner, const float* bias) {
#pragma omp parallel for collapse(2) schedule(static) if (n * channels * inner >= DEEPDSL_PARALLEL_MIN)
    for (long s = 0; s < n; ++s)
        for (long c = 0; c < channels; ++c) {
            float* row = x + (s * channels + c) * inner;
            deepdsl_copy_row(row, row, inner, bias[c]);
        }
}

// ---------------------------------------------------------------------------------------------------------------
// local response normalization (runtime/cpu/norm.py): the same float32 operations in the same order, each (sample,
// channel) row a thread's, in two passes with a barrier between them (the second may overwrite the input the first
// read: lrn in place over x, lrn_bwd over g)

// row[p] += src[p]^2 (`square`) or src[p]
static inline __attribute__((always_inline)) void deepdsl_add_row(float* row, const float* src, long hw, int square) {
    if (!square) {
        deepdsl_add_floats(row, src, hw);
        return;
    }
#pragma omp simd
    for (long p = 0; p < hw; ++p) row[p] += src[p] * src[p];
}

// row[p] = the sum over channel window [ch - front, ch + back] (clipped to [0, channels)) of a(ch', p), in numpy's
// order: a(ch) first, then ch - 1, ch - 2, ..., then ch + 1, ch + 2, ...; a(ch', p) = x[ch'][p]^2 (`square`) or
// v[ch'][p] (rows `hw` apart).
DEEPDSL_ROW void deepdsl_window_sum_row(const float* v, long channels, long hw, long ch, int front, int back,
                                        int square, float* row) {
    const float* at = v + ch * hw;
    if (square) {
#pragma omp simd
        for (long p = 0; p < hw; ++p) row[p] = at[p] * at[p];
    } else {
        memcpy(row, at, sizeof(float) * hw);
    }
    for (long d = -1; d >= -front && ch + d >= 0; --d) deepdsl_add_row(row, v + (ch + d) * hw, hw, square);
    for (long d = 1; d <= back && ch + d < channels; ++d) deepdsl_add_row(row, v + (ch + d) * hw, hw, square);
}

// s^-0.75, the usual LRN exponent (beta 0.75), as 1 / (s^1/2 * s^1/4): correctly rounded square roots, which
// loops compute eight at a time where powf is a call per element (a few ulp from powf's result; the other
// exponents call powf). Never s * sqrt(s), which overflows or underflows long before s^-0.75 does.
static inline float deepdsl_power_three_quarters(float s) {
    const float root = sqrtf(s);
    return 1.0f / (root * sqrtf(root));
}

// LRN of m samples (channels x hw each): s (m, channels, hw) = (window sum of x^2 * scale + k)^power (power =
// -beta), then out = x * s. `out` may be `x`.
void deepdsl_lrn(const float* x, long m, long channels, long hw, int size, float scale, float k, float power,
                 float* s, float* out) {
    const long rows = m * channels;
#pragma omp parallel if (rows * hw >= DEEPDSL_PARALLEL_MIN)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < rows; ++r) {
            float* row = s + r * hw;
            deepdsl_window_sum_row(x + (r / channels) * channels * hw, channels, hw, r % channels, size / 2,
                                   (size - 1) / 2, 1, row);
            if (power == -0.75f) {
#pragma omp simd
                for (long p = 0; p < hw; ++p) row[p] = deepdsl_power_three_quarters(row[p] * scale + k);
            } else {
                for (long p = 0; p < hw; ++p) row[p] = powf(row[p] * scale + k, power);
            }
        }
#pragma omp for schedule(static)
        for (long r = 0; r < rows; ++r)
#pragma omp simd
            for (long p = 0; p < hw; ++p) out[r * hw + p] = x[r * hw + p] * s[r * hw + p];
    }
}

// The gradient of LRN: with s = window sum of x^2 * scale + k, inner a = s^(power - 1) * g * x and t = s^power * g
// (power = -beta; into `t`, `a`: (m, channels, hw) each), then out = t - (mirrored window sum of a) * x * coef
// (coef = 2 alpha beta / size). `out` may be `g`: the second pass reads t, a and x only. The exponents come as
// float32 values computed as numpy's kernel computes them.
void deepdsl_lrn_bwd(const float* g, const float* x, long m, long channels, long hw, int size, float scale, float k,
                     float power, float power_inner, float coef, float* t, float* a, float* out) {
    const long rows = m * channels;
#pragma omp parallel if (rows * hw >= DEEPDSL_PARALLEL_MIN)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < rows; ++r) {
            float* tr = t + r * hw;
            float* ar = a + r * hw;
            const float* gr = g + r * hw;
            const float* xr = x + r * hw;
            deepdsl_window_sum_row(x + (r / channels) * channels * hw, channels, hw, r % channels, size / 2,
                                   (size - 1) / 2, 1, tr);
            if (power == -0.75f) {          /* power_inner = -1.75: s^-0.75 / s */
#pragma omp simd
                for (long p = 0; p < hw; ++p) {
                    const float sv = tr[p] * scale + k, s34 = deepdsl_power_three_quarters(sv);
                    ar[p] = s34 / sv * gr[p] * xr[p];
                    tr[p] = s34 * gr[p];
                }
            } else {
                for (long p = 0; p < hw; ++p) {
                    const float sv = tr[p] * scale + k;
                    ar[p] = powf(sv, power_inner) * gr[p] * xr[p];
                    tr[p] = powf(sv, power) * gr[p];
                }
            }
        }
#pragma omp for schedule(static)
        for (long r = 0; r < rows; ++r) {
            float* o = out + r * hw;
            const float* tr = t + r * hw;
            const float* xr = x + r * hw;
            /* the window sum lands in the output row, then becomes t - sum * x * coef element by element */
            deepdsl_window_sum_row(a + (r / channels) * channels * hw, channels, hw, r % channels, (size - 1) / 2,
                                   size / 2, 0, o);
#pragma omp simd
            for (long p = 0; p < hw; ++p) o[p] = tr[p] - o[p] * xr[p] * coef;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// layer normalization (runtime/cpu/norm.py): rows of `features` floats, each normalized on its own, its sums in
// float in the lanes below, as numpy's version computes them; the weight's and bias's sums add fixed parts of the
// rows in double, then the parts in order. No result depends on the thread count or the vector width.

// Sums over a row, in the same order on any vector width (and in numpy's version, `norm._lane_sums`): element k goes
// to lane k mod 16, each lane adds its elements in order, then the lanes are halved (lane i + lane i + half) down to
// one.
#define DEEPDSL_SUM_LANES 16
#define DEEPDSL_LANE_SUM(n, lanes, k, value)                                                                       \
    do {                                                                                                            \
        for (int l_ = 0; l_ < DEEPDSL_SUM_LANES; ++l_) (lanes)[l_] = 0.0f;                                          \
        long b_ = 0;                                                                                                \
        for (; b_ + DEEPDSL_SUM_LANES <= (n); b_ += DEEPDSL_SUM_LANES) {                                            \
            _Pragma("omp simd") for (int l_ = 0; l_ < DEEPDSL_SUM_LANES; ++l_) {                                    \
                const long k = b_ + l_;                                                                             \
                (lanes)[l_] += (value);                                                                             \
            }                                                                                                       \
        }                                                                                                           \
        for (int l_ = 0; b_ + l_ < (n); ++l_) {                                                                     \
            const long k = b_ + l_;                                                                                 \
            (lanes)[l_] += (value);                                                                                 \
        }                                                                                                           \
    } while (0)

// the lanes halved down to one: vectors of 8 and 4 (a register's halves, not a trip through memory per add)
static inline __attribute__((always_inline)) float deepdsl_lane_total(const float* a) {
    deepdsl_v8f low, high;
    memcpy(&low, a, sizeof low);
    memcpy(&high, a + 8, sizeof high);
    const deepdsl_v8f eight = low + high;
    deepdsl_v4f front, back;
    memcpy(&front, &eight, sizeof front);
    memcpy(&back, (const float*)&eight + 4, sizeof back);
    const deepdsl_v4f four = front + back;
    return (four[0] + four[2]) + (four[1] + four[3]);
}

#if DEEPDSL_MASKED
// DEEPDSL_LANE_SUM's sums held in two vectors (lanes 0-7 and 8-15) instead of an array, then halved as
// deepdsl_lane_total halves them: the same additions in the same order, the same bits, but no chain of stores and
// loads through the array (a row's sums waited on it: a layer norm of rows of 64 floats ran at 3 cycles a float).
// VECTOR: the values of the 8 elements from j (deepdsl_load8's); SCALAR: element k's, for a last block of
// fewer than 16, lane by lane as DEEPDSL_LANE_SUM adds them.
// deepdsl_lane_total of the lanes held in lo (0-7) and hi (8-15), in registers
static inline __attribute__((always_inline)) float deepdsl_lane_total8(deepdsl_v8f lo, deepdsl_v8f hi) {
    const __m256 eight = (__m256)(lo + hi);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));          // (four[0] + four[2], four[1] + four[3])
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#define DEEPDSL_LANE_TOTAL(n, total, j, k, VECTOR, SCALAR)                                                          \
    do {                                                                                                            \
        deepdsl_v8f lo_ = {0}, hi_ = {0};                                                                           \
        long b_ = 0;                                                                                                \
        for (; b_ + DEEPDSL_SUM_LANES <= (n); b_ += DEEPDSL_SUM_LANES) {                                            \
            { const long j = b_; lo_ += (VECTOR); }                                                                 \
            { const long j = b_ + 8; hi_ += (VECTOR); }                                                             \
        }                                                                                                           \
        if (b_ < (n)) {                                                                                             \
            float lanes_[DEEPDSL_SUM_LANES];                                                                        \
            memcpy(lanes_, &lo_, sizeof lo_);                                                                       \
            memcpy(lanes_ + 8, &hi_, sizeof hi_);                                                                   \
            for (int l_ = 0; b_ + l_ < (n); ++l_) {                                                                 \
                const long k = b_ + l_;                                                                             \
                lanes_[l_] += (SCALAR);                                                                             \
            }                                                                                                       \
            memcpy(&lo_, lanes_, sizeof lo_);                                                                       \
            memcpy(&hi_, lanes_ + 8, sizeof hi_);                                                                   \
        }                                                                                                           \
        (total) = deepdsl_lane_total8(lo_, hi_);                                                                    \
    } while (0)
#else
#define DEEPDSL_LANE_TOTAL(n, total, j, k, VECTOR, SCALAR)                                                          \
    do {                                                                                                            \
        float lanes_[DEEPDSL_SUM_LANES];                                                                            \
        DEEPDSL_LANE_SUM(n, lanes_, k, SCALAR);                                                                     \
        (total) = deepdsl_lane_total(lanes_);                                                                       \
    } while (0)
#endif

// a row's mean and 1 / sqrt(var + eps), the biased variance of its deviations from the rounded mean
static inline __attribute__((always_inline)) void deepdsl_layer_norm_stats(const float* x, long features, float eps,
                                                                           float* mean, float* rstd) {
    float total;
    DEEPDSL_LANE_TOTAL(features, total, j, k, deepdsl_load8(x + j), x[k]);
    const float m = total / (float)features;
    DEEPDSL_LANE_TOTAL(features, total, j, k, (deepdsl_load8(x + j) - m) * (deepdsl_load8(x + j) - m),
                       (x[k] - m) * (x[k] - m));
    *mean = m;
    *rstd = 1.0f / sqrtf(total / (float)features + eps);
}

// out = (x - mean) * rstd [* w + b] row by row (w and b NULL: not affine)
void deepdsl_layer_norm(const float* x, const float* w, const float* b, long rows, long features, float eps,
                        float* out) {
#pragma omp parallel for schedule(static) if (rows * features >= DEEPDSL_PARALLEL_MIN)
    for (long r = 0; r < rows; ++r) {
        const float* xr = x + r * features;
        float* o = out + r * features;
        float mean, rstd;
        deepdsl_layer_norm_stats(xr, features, eps, &mean, &rstd);
        if (w) {
#pragma omp simd
            for (long j = 0; j < features; ++j) o[j] = ((xr[j] - mean) * rstd) * w[j] + b[j];
        } else {
#pragma omp simd
            for (long j = 0; j < features; ++j) o[j] = (xr[j] - mean) * rstd;
        }
    }
}

// g times the weight (g itself without one)
static inline __attribute__((always_inline)) float deepdsl_weighted(const float* g, const float* w, long j) {
    return w ? g[j] * w[j] : g[j];
}

// a row of dx (inlined twice: with the weight, and with w NULL, where the selects fold away)
static inline __attribute__((always_inline)) void deepdsl_layer_norm_grad_row(const float* xr, const float* gr,
                                                                              const float* w, long features,
                                                                              float eps, float* o) {
    float mean, rstd, total;
    deepdsl_layer_norm_stats(xr, features, eps, &mean, &rstd);
#define DEEPDSL_GW(j) (w ? deepdsl_load8(gr + (j)) * deepdsl_load8(w + (j)) : deepdsl_load8(gr + (j)))
    DEEPDSL_LANE_TOTAL(features, total, j, k, DEEPDSL_GW(j), deepdsl_weighted(gr, w, k));
    const float a = total / (float)features;
    DEEPDSL_LANE_TOTAL(features, total, j, k, DEEPDSL_GW(j) * ((deepdsl_load8(xr + j) - mean) * rstd),
                       deepdsl_weighted(gr, w, k) * ((xr[k] - mean) * rstd));
#undef DEEPDSL_GW
    const float c = total / (float)features;
#pragma omp simd
    for (long j = 0; j < features; ++j) {
        const float gw = deepdsl_weighted(gr, w, j), xhat = (xr[j] - mean) * rstd;
        o[j] = rstd * ((gw - a) - xhat * c);
    }
}

// dx = rstd (gw - mean(gw) - xhat mean(gw xhat)) row by row, gw = g * w (w NULL: g). `out` may be `g`: a row of g is
// read whole (the sums) before that row of dx is written, each element read before it is overwritten.
void deepdsl_layer_norm_grad(const float* x, const float* g, const float* w, long rows, long features, float eps,
                             float* out) {
#pragma omp parallel for schedule(static) if (rows * features >= DEEPDSL_PARALLEL_MIN)
    for (long r = 0; r < rows; ++r) {
        if (w)
            deepdsl_layer_norm_grad_row(x + r * features, g + r * features, w, features, eps, out + r * features);
        else
            deepdsl_layer_norm_grad_row(x + r * features, g + r * features, NULL, features, eps, out + r * features);
    }
}

#define DEEPDSL_LN_STATS_ROWS 8

// out[0][j] = sum over rows of g * xhat, out[1][j] = sum of g: each part of `part_rows` rows summed in double into
// parts[part] (2 x features doubles) by one thread, then the parts added in order, a column per thread's share.
void deepdsl_layer_norm_param_grad(const float* x, const float* g, long rows, long features, float eps,
                                   long part_rows, double* parts, float* out) {
    const long count = (rows + part_rows - 1) / part_rows;
#pragma omp parallel if (rows * features >= DEEPDSL_PARALLEL_MIN)
    {
        long begin, end;
        deepdsl_share(count, 1, &begin, &end);
        for (long p = begin; p < end; ++p) {
            double* dw = parts + p * 2 * features;
            double* db = dw + features;
            for (long j = 0; j < features; ++j) dw[j] = db[j] = 0.0;
            const long last = (p + 1) * part_rows < rows ? (p + 1) * part_rows : rows;
            // the statistics of a few rows, then their sums (each row's statistics a chain of dependent steps:
            // several in flight, rather than one between stores to the sums)
            for (long r0 = p * part_rows; r0 < last; r0 += DEEPDSL_LN_STATS_ROWS) {
                const long n = last - r0 < DEEPDSL_LN_STATS_ROWS ? last - r0 : DEEPDSL_LN_STATS_ROWS;
                float mean[DEEPDSL_LN_STATS_ROWS], rstd[DEEPDSL_LN_STATS_ROWS];
                for (long i = 0; i < n; ++i)
                    deepdsl_layer_norm_stats(x + (r0 + i) * features, features, eps, &mean[i], &rstd[i]);
                for (long i = 0; i < n; ++i) {
                    const float* xr = x + (r0 + i) * features;
                    const float* gr = g + (r0 + i) * features;
                    const float m = mean[i], s = rstd[i];
#pragma omp simd
                    for (long j = 0; j < features; ++j) {
                        dw[j] += gr[j] * ((xr[j] - m) * s);
                        db[j] += gr[j];
                    }
                }
            }
        }
#pragma omp barrier
        deepdsl_share(features, 16, &begin, &end);
        for (long j = begin; j < end; ++j) {
            double dw = 0.0, db = 0.0;
            for (long p = 0; p < count; ++p) {
                dw += parts[p * 2 * features + j];
                db += parts[p * 2 * features + features + j];
            }
            out[j] = (float)dw;
            out[features + j] = (float)db;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// max pooling: numpy's results (runtime/cpu/pool.py) -- the maximum by np.maximum's rule (NaN wins; of equal values
// the first stays), the argmax the offset row * kernel + column of the first position holding it (the last
// position when none does: NaN windows), positions outside the plane -inf -- window by window, branch-free

static inline __attribute__((always_inline)) void deepdsl_window_max(const float* at, long w, int K, float* best_out, uint8_t* index_out) {
    float best = at[0];
    int nan = best != best;
    for (int i = 0; i < K; ++i)
        for (int j = 0; j < K; ++j) {
            const float v = at[i * w + j];
            best = v > best ? v : best;
            nan |= v != v;
        }
    best = nan ? NAN : best;
    int index = K * K - 1;
    for (int k = K * K - 2; k >= 0; --k) index = at[(k / K) * w + k % K] == best ? k : index;
    *best_out = best;
    *index_out = (uint8_t)index;
}

// Per-plane work is in functions of their own (not inlined into the parallel regions, where every variable shared
// by the threads would be read again after each store through a pointer): their arguments are plain locals.
#define DEEPDSL_PLANE static __attribute__((noinline))

// A 2x2 window, written out: the first position holding the maximum is the count of those before it that do not
// (integer arithmetic on the comparisons, so the compiler emits no branch: which one wins is unpredictable).
static inline __attribute__((always_inline)) void deepdsl_window_max2(const float* at, long w, float* best_out,
                                                                     uint8_t* index_out) {
    const float a = at[0], b = at[1], c = at[w], d = at[w + 1];
    float best = a;
    best = b > best ? b : best;
    best = c > best ? c : best;
    best = d > best ? d : best;
    best = (__builtin_isunordered(a, b) | __builtin_isunordered(c, d)) ? NAN : best;
    const int na = a != best, nb = b != best, nc = c != best;
    *best_out = best;
    *index_out = (uint8_t)(na + (na & nb) + (na & nb & nc));
}


// The 2x2 windows of stride 2, the most common pooling, in vectors: the branch-free rule of deepdsl_window_max2 on
// N windows at once, their columns separated by shuffles.
// Windows q .. q+N-1 of rows r0, r1 (2x2, stride 2) into o and am; N = 8 or 4, EVEN/ODD the shuffles that take the
// even and odd columns of 2N consecutive floats.
#define DEEPDSL_WINDOWS2(VF, VI, VB, N, EVEN, ODD)                                                               \
    do {                                                                                                         \
        VF t0, t1, u0, u1;                                                                                       \
        memcpy(&t0, r0 + 2 * q, sizeof t0);                                                                      \
        memcpy(&t1, r0 + 2 * q + N, sizeof t1);                                                                  \
        memcpy(&u0, r1 + 2 * q, sizeof u0);                                                                      \
        memcpy(&u1, r1 + 2 * q + N, sizeof u1);                                                                  \
        const VF a = __builtin_shuffle(t0, t1, EVEN), b = __builtin_shuffle(t0, t1, ODD);                        \
        const VF c = __builtin_shuffle(u0, u1, EVEN), d = __builtin_shuffle(u0, u1, ODD);                        \
        VF best = a;                                                                                             \
        best = DEEPDSL_SELECT(VF, VI, b > best, b, best);                                                        \
        best = DEEPDSL_SELECT(VF, VI, c > best, c, best);                                                        \
        best = DEEPDSL_SELECT(VF, VI, d > best, d, best);                                                        \
        best = DEEPDSL_SELECT(VF, VI, (a != a) | (b != b) | (c != c) | (d != d), (VF){0} + NAN, best);           \
        const VI na = a != best, nb = b != best, nc = c != best;  /* -1 where not the maximum */                \
        const VB index = __builtin_convertvector(-(na + (na & nb) + (na & nb & nc)), VB);                         \
        memcpy(o + q, &best, sizeof best);                                                                       \
        memcpy(am + q, &index, sizeof index);                                                                    \
    } while (0)

// Rows of 2x2 windows of stride 2 (`ho` x `wo` windows inside the plane, its rows `w` apart) into out and argmax:
// 8 windows at a time, then 4, then one by one (the first position holding the maximum: the count of those before
// it that do not).
DEEPDSL_PLANE void deepdsl_max_pool_plane2(const float* src, long w, int ho, int wo, float* out, uint8_t* argmax) {
    for (int p = 0; p < ho; ++p) {
        const float* r0 = src + (long)p * 2 * w;
        const float* r1 = r0 + w;
        float* o = out + (long)p * wo;
        uint8_t* am = argmax + (long)p * wo;
        int q = 0;
        for (; q + 8 <= wo; q += 8)
            DEEPDSL_WINDOWS2(deepdsl_v8f, deepdsl_v8i, deepdsl_v8b, 8, ((deepdsl_v8i){0, 2, 4, 6, 8, 10, 12, 14}),
                             ((deepdsl_v8i){1, 3, 5, 7, 9, 11, 13, 15}));
        for (; q + 4 <= wo; q += 4)
            DEEPDSL_WINDOWS2(deepdsl_v4f, deepdsl_v4i, deepdsl_v4b, 4, ((deepdsl_v4i){0, 2, 4, 6}),
                             ((deepdsl_v4i){1, 3, 5, 7}));
        for (; q < wo; ++q) deepdsl_window_max2(r0 + 2 * q, w, o + q, am + q);
    }
}

// Rows of 3x3 windows of stride 2 (AlexNet's and ResNet's pooling) into out and/or argmax (either may be NULL):
// eight windows at a time while their 17 columns lie in the row, their columns separated by shuffles, the rule of
// deepdsl_window_max on each (the maximum by `>` from the first position, NaN where any position is NaN; the argmax
// the first position equal to it, the last where none is); the rest of a row one window at a time.
DEEPDSL_PLANE void deepdsl_max_pool_plane3(const float* src, long w, int ho, int wo, float* out, uint8_t* argmax) {
    const deepdsl_v8i even = {0, 2, 4, 6, 8, 10, 12, 14}, odd = even + 1, next = {2, 4, 6, 8, 10, 12, 14, 0};
    for (int p = 0; p < ho; ++p) {
        const float* r = src + (long)p * 2 * w;
        int q = 0;
        for (; q + 8 <= wo && 2 * q + 17 <= w; q += 8) {
            deepdsl_v8f v[9];
            for (int i = 0; i < 3; ++i) {
                const float* at = r + i * w + 2 * q;
                deepdsl_v8f t0, t1;
                memcpy(&t0, at, sizeof t0);
                memcpy(&t1, at + 8, sizeof t1);
                v[3 * i] = __builtin_shuffle(t0, t1, even);
                v[3 * i + 1] = __builtin_shuffle(t0, t1, odd);
                v[3 * i + 2] = __builtin_shuffle(t0, t1, next);
                v[3 * i + 2][7] = at[16];
            }
            deepdsl_v8f best = v[0];
            deepdsl_v8i nan = v[0] != v[0];
            for (int k = 1; k < 9; ++k) {
                best = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, v[k] > best, v[k], best);
                nan |= v[k] != v[k];
            }
            best = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, nan, (deepdsl_v8f){0} + NAN, best);
            deepdsl_v8i index = (deepdsl_v8i){0} + 8;
            for (int k = 7; k >= 0; --k)
                index = DEEPDSL_SELECT(deepdsl_v8i, deepdsl_v8i, v[k] == best, (deepdsl_v8i){0} + k, index);
            if (out) memcpy(out + (long)p * wo + q, &best, sizeof best);
            if (argmax) {
                const deepdsl_v8b bytes = __builtin_convertvector(index, deepdsl_v8b);
                memcpy(argmax + (long)p * wo + q, &bytes, sizeof bytes);
            }
        }
        for (; q < wo; ++q) {
            float best;
            uint8_t index;
            deepdsl_window_max(r + 2 * q, w, 3, &best, &index);
            if (out) out[(long)p * wo + q] = best;
            if (argmax) argmax[(long)p * wo + q] = index;
        }
    }
}

// The windows of one plane whose windows all lie inside it (rows `w` apart); `out` or `argmax` may be NULL.
DEEPDSL_PLANE void deepdsl_max_pool_plane(const float* src, long w, int ho, int wo, int K, int stride, float* out,
                                          uint8_t* argmax) {
    float best;
    uint8_t index;
    if (K == 2 && stride == 2 && out && argmax) {   /* the most common case: vectors */
        deepdsl_max_pool_plane2(src, w, ho, wo, out, argmax);
        return;
    }
    if (K == 3 && stride == 2) {                    /* AlexNet's and ResNet's: vectors */
        deepdsl_max_pool_plane3(src, w, ho, wo, out, argmax);
        return;
    }
    if (K == 2 && out && argmax) {                  /* without a test per window */
        for (int p = 0; p < ho; ++p) {
            const float* row = src + (long)p * stride * w;
            for (int q = 0; q < wo; ++q) {
                deepdsl_window_max2(row + (long)q * stride, w, &best, &index);
                out[(long)p * wo + q] = best;
                argmax[(long)p * wo + q] = index;
            }
        }
        return;
    }
    for (int p = 0; p < ho; ++p) {
        const float* row = src + (long)p * stride * w;
        for (int q = 0; q < wo; ++q) {
            if (K == 2) deepdsl_window_max2(row + (long)q * stride, w, &best, &index);
            else if (K == 3) deepdsl_window_max(row + (long)q * stride, w, 3, &best, &index);
            else deepdsl_window_max(row + (long)q * stride, w, K, &best, &index);
            if (out) out[(long)p * wo + q] = best;
            if (argmax) argmax[(long)p * wo + q] = index;
        }
    }
}

// padded (hp x wp) = the plane src (h x w) at (pad, pad), -inf around it.
DEEPDSL_PLANE void deepdsl_pad_plane(const float* src, int h, int w, int hp, int wp, int pad, float* padded) {
    for (int y = 0; y < hp; ++y)
        for (int c = 0; c < wp; ++c) {
            const int sy = y - pad, sx = c - pad;
            padded[(long)y * wp + c] = (sy >= 0 && sy < h && sx >= 0 && sx < w) ? src[(long)sy * w + sx] : -INFINITY;
        }
}

// Max pooling of `planes` (N*C) planes h x w into ho x wo (`out` and/or `argmax`, either may be NULL), windows
// kernel x kernel with `stride` and `pad`. A plane some window leaves (padding, ceil mode) is first copied with a
// -inf border into `scratch`, which holds `scratch_planes` padded planes: one per thread (no more threads run).
void deepdsl_max_pool(const float* x, long planes, int h, int w, int ho, int wo, int kernel, int stride, int pad,
                      float* out, uint8_t* argmax, float* scratch, int scratch_planes) {
    const int hp = (ho - 1) * stride + kernel, wp = (wo - 1) * stride + kernel;
    const int inside = pad == 0 && hp <= h && wp <= w;
    int threads = deepdsl_threads();
    if (!inside && threads > scratch_planes) threads = scratch_planes > 0 ? scratch_planes : 1;
#pragma omp parallel num_threads(threads) if (planes * h * w >= DEEPDSL_PARALLEL_MIN)
    {
        float* padded = inside ? 0 : deepdsl_thread_part(scratch, (long)hp * wp);
#pragma omp for schedule(static)
        for (long pl = 0; pl < planes; ++pl) {
            const float* src = x + pl * h * w;
            long width = w;
            if (!inside) {
                deepdsl_pad_plane(src, h, w, hp, wp, pad, padded);
                src = padded;
                width = wp;
            }
            deepdsl_max_pool_plane(src, width, ho, wo, kernel, stride, out ? out + pl * ho * wo : 0,
                                   argmax ? argmax + pl * ho * wo : 0);
        }
    }
}

// One input row of a tiling pooling's gradient: position q * K + j of the row gets g[q] where the window's argmax
// is row i, column j, else g[q] * 0 (numpy's product by the 0/1 mask: NaN stays NaN).
static inline __attribute__((always_inline)) void deepdsl_grad_row(float* dst, const float* g, const uint8_t* argmax, int wo, int K, int i) {
    for (int q = 0; q < wo; ++q) {
        const float grad = g[q], zero = grad * 0.0f;
        const int at = argmax[q] - i * K;
        for (int j = 0; j < K; ++j) dst[q * K + j] = at == j ? grad : zero;
    }
}

// row[2q] += g[q] * (argmax[q] == k) for q from `q` on, eight windows at a time while the 16 positions they span
// lie in [0, limit) of `row` (the rest is the caller's); the positions in between get + 0.0f, which changes no value
// there (the plane starts at +0.0 and sums of such products are never -0.0). Returns the first window left.
static inline __attribute__((always_inline)) int deepdsl_add_every_other(float* row, const float* g,
                                                                        const uint8_t* argmax, int k, int q, int q1,
                                                                        int limit) {
    const deepdsl_v8f zero = {0}, one = zero + 1.0f;
    for (; q + 8 <= q1 && 2 * q + 16 <= limit; q += 8) {
        deepdsl_v8f grad, low, high;
        deepdsl_v8b index;
        memcpy(&grad, g + q, sizeof grad);
        memcpy(&index, argmax + q, sizeof index);
        const deepdsl_v8i hit = __builtin_convertvector(index, deepdsl_v8i) == k;
        const deepdsl_v8f part = grad * DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, hit, one, zero);
        memcpy(&low, row + 2 * q, sizeof low);
        memcpy(&high, row + 2 * q + 8, sizeof high);
        low += __builtin_shuffle(part, zero, ((deepdsl_v8i){0, 8, 1, 9, 2, 10, 3, 11}));
        high += __builtin_shuffle(part, zero, ((deepdsl_v8i){4, 12, 5, 13, 6, 14, 7, 15}));
        memcpy(row + 2 * q, &low, sizeof low);
        memcpy(row + 2 * q + 8, &high, sizeof high);
    }
    return q;
}

// The gradient of max pooling in one plane: each window adds g * (argmax == offset) to the input position at each
// offset. Windows that tile the plane (stride == kernel, no padding, inside) write its rows once each; others add
// in numpy's order (offset by offset, each over all windows).
DEEPDSL_PLANE void deepdsl_max_pool_bwd_plane(const float* g, const uint8_t* argmax, int h, int w, int ho, int wo,
                                              int kernel, int stride, int pad, float* o) {
    if (stride == kernel && pad == 0 && ho * kernel <= h && wo * kernel <= w) {
        for (int p = 0; p < ho; ++p)
            for (int i = 0; i < kernel; ++i) {
                float* dst = o + ((long)p * kernel + i) * w;
                if (kernel == 2) deepdsl_grad_row(dst, g + (long)p * wo, argmax + (long)p * wo, wo, 2, i);
                else deepdsl_grad_row(dst, g + (long)p * wo, argmax + (long)p * wo, wo, kernel, i);
                for (int x = wo * kernel; x < w; ++x) dst[x] = 0.0f;
            }
        for (long y = (long)ho * kernel; y < h; ++y) memset(o + y * w, 0, sizeof(float) * w);
        return;
    }
    memset(o, 0, sizeof(float) * h * w);
    for (int k = 0; k < kernel * kernel; ++k) {
        const int i = k / kernel, j = k % kernel;
        int q0, q1;
        deepdsl_valid(j, w, wo, stride, pad, &q0, &q1);
        for (int p = 0; p < ho; ++p) {
            const int y = p * stride - pad + i;
            if (y < 0 || y >= h) continue;
            float* row = o + (long)y * w + j - pad;
            const float* gr = g + (long)p * wo;
            const uint8_t* ar = argmax + (long)p * wo;
            int q = stride == 2 ? deepdsl_add_every_other(row, gr, ar, k, q0, q1, w + pad - j) : q0;
            for (; q < q1; ++q) row[(long)stride * q] += gr[q] * (float)(ar[q] == k);
        }
    }
}

// The gradient of max pooling of `planes` planes; a thread owns whole planes.
void deepdsl_max_pool_bwd(const float* g, const uint8_t* argmax, long planes, int h, int w, int ho, int wo,
                          int kernel, int stride, int pad, float* out) {
#pragma omp parallel for schedule(static) if (planes * h * w >= DEEPDSL_PARALLEL_MIN)
    for (long pl = 0; pl < planes; ++pl)
        deepdsl_max_pool_bwd_plane(g + pl * ho * wo, argmax + pl * ho * wo, h, w, ho, wo, kernel, stride, pad,
                                   out + pl * h * w);
}

// Average pooling (runtime/cpu/pool.py's avg_pool and avg_pool_bwd, the same float32 operations in the same
// order): out (planes, ho, wo) = each kernel x kernel window of x (planes, h, w) at `stride`, with `pad` zeros around
// (and past the far edges, in ceil mode), its values added from position (0, 0) row by row, the padding's zeros
// among them, divided by the window's count (`contract.avg_pool_divisor`: deepdsl_pool_count). Planes go
// DEEPDSL_POOL_LANES at a time, each its own chain of additions (a window's additions wait on one another); a
// thread owns whole groups of them.
#define DEEPDSL_POOL_LANES 8
#define DEEPDSL_POOL_SHARES 512         /* outputs of a plane whose gradient's shares are computed once (16 KB) */

// The positions of window `o` along an axis of n that an average divides by: the window clipped to the padded
// axis, or with `include_pad` 0 to the axis itself.
static inline int deepdsl_pool_count(int o, int n, int kernel, int stride, int pad, int include_pad) {
    const int start = o * stride - pad, end = start + kernel < n + pad ? start + kernel : n + pad;
    return include_pad ? end - start : (end < n ? end : n) - (start > 0 ? start : 0);
}

// Whether the one window of a pooling covers each plane exactly (global pooling: kernel = h = w, no padding).
static inline int deepdsl_pool_global(int h, int w, int ho, int wo, int kernel, int pad) {
    return ho == 1 && wo == 1 && pad == 0 && kernel == h && kernel == w;
}

void deepdsl_avg_pool(const float* x, long planes, int h, int w, int ho, int wo, int kernel, int stride, int pad,
                      int include_pad, float* out) {
    const long groups = (planes + DEEPDSL_POOL_LANES - 1) / DEEPDSL_POOL_LANES, hw = (long)h * w;
    if (deepdsl_pool_global(h, w, ho, wo, kernel, pad)) {      // the plane's values in order, no bounds to test
        const float count = (float)(deepdsl_pool_count(0, h, kernel, stride, pad, include_pad) *
                                    deepdsl_pool_count(0, w, kernel, stride, pad, include_pad));
#pragma omp parallel for schedule(static) if (planes * hw >= DEEPDSL_PARALLEL_MIN)
        for (long group = 0; group < groups; ++group) {
            const long p0 = group * DEEPDSL_POOL_LANES;
            const int lanes = planes - p0 < DEEPDSL_POOL_LANES ? (int)(planes - p0) : DEEPDSL_POOL_LANES;
            const float* src = x + p0 * hw;
            float sums[DEEPDSL_POOL_LANES];
            for (int l = 0; l < lanes; ++l) sums[l] = src[l * hw];
            for (long k = 1; k < hw; ++k)
                for (int l = 0; l < lanes; ++l) sums[l] += src[l * hw + k];
            for (int l = 0; l < lanes; ++l) out[p0 + l] = sums[l] / count;
        }
        return;
    }
#pragma omp parallel for schedule(static) if (planes * ho * wo * kernel * kernel >= DEEPDSL_PARALLEL_MIN)
    for (long group = 0; group < groups; ++group) {
        const long p0 = group * DEEPDSL_POOL_LANES;
        const int lanes = planes - p0 < DEEPDSL_POOL_LANES ? (int)(planes - p0) : DEEPDSL_POOL_LANES;
        const float* src = x + p0 * hw;
        for (int oy = 0; oy < ho; ++oy) {
            const int rows = deepdsl_pool_count(oy, h, kernel, stride, pad, include_pad);
            for (int ox = 0; ox < wo; ++ox) {
                float sums[DEEPDSL_POOL_LANES] = {0.0f};
                for (int i = 0; i < kernel; ++i) {
                    const int y = oy * stride + i - pad;
                    for (int j = 0; j < kernel; ++j) {
                        const int xx = ox * stride + j - pad;
                        const int inside = y >= 0 && y < h && xx >= 0 && xx < w, first = i == 0 && j == 0;
                        const long at = inside ? (long)y * w + xx : 0;
                        for (int l = 0; l < lanes; ++l) {
                            const float v = inside ? src[l * hw + at] : 0.0f;
                            sums[l] = first ? v : sums[l] + v;
                        }
                    }
                }
                const float count = (float)(rows * deepdsl_pool_count(ox, w, kernel, stride, pad, include_pad));
                for (int l = 0; l < lanes; ++l) out[(p0 + l) * ho * wo + oy * wo + ox] = sums[l] / count;
            }
        }
    }
}

// The gradient of deepdsl_avg_pool: out (planes, h, w) gets each window's share, g / its count, at every position
// of the window, as numpy's kernel spreads them: the plane zeroed, then for each window position (i, j) row by row
// every window's share added at it (written, where windows do not overlap: stride >= kernel). Planes go
// DEEPDSL_POOL_LANES at a time (a global pooling's plane has one window: a loop of its own would cost more than its
// work), their shares computed once where a plane has at most DEEPDSL_POOL_SHARES outputs, else at each use; a
// thread owns whole groups of planes.
void deepdsl_avg_pool_bwd(const float* g, long planes, int h, int w, int ho, int wo, int kernel, int stride, int pad,
                          int include_pad, float* out) {
    const int overlap = stride < kernel, kept = (long)ho * wo <= DEEPDSL_POOL_SHARES;
    const long groups = (planes + DEEPDSL_POOL_LANES - 1) / DEEPDSL_POOL_LANES, hw = (long)h * w, howo = ho * wo;
    if (deepdsl_pool_global(h, w, ho, wo, kernel, pad)) {      // one share over the whole plane
        const float count = (float)(deepdsl_pool_count(0, h, kernel, stride, pad, include_pad) *
                                    deepdsl_pool_count(0, w, kernel, stride, pad, include_pad));
#pragma omp parallel for schedule(static) if (planes * hw >= DEEPDSL_PARALLEL_MIN)
        for (long p = 0; p < planes; ++p) {
            const float share = g[p] / count, value = overlap ? 0.0f + share : share;
            for (long k = 0; k < hw; ++k) out[p * hw + k] = value;
        }
        return;
    }
#pragma omp parallel for schedule(static) if (planes * hw >= DEEPDSL_PARALLEL_MIN)
    for (long group = 0; group < groups; ++group) {
        const long p0 = group * DEEPDSL_POOL_LANES;
        const int lanes = planes - p0 < DEEPDSL_POOL_LANES ? (int)(planes - p0) : DEEPDSL_POOL_LANES;
        const float* gp = g + p0 * howo;
        float* dst = out + p0 * hw;
        float shares[DEEPDSL_POOL_LANES * DEEPDSL_POOL_SHARES];
        for (int oy = 0; kept && oy < ho; ++oy) {
            const int rows = deepdsl_pool_count(oy, h, kernel, stride, pad, include_pad);
            for (int ox = 0; ox < wo; ++ox) {
                const float count = (float)(rows * deepdsl_pool_count(ox, w, kernel, stride, pad, include_pad));
                for (int l = 0; l < lanes; ++l) shares[l * howo + oy * wo + ox] = gp[l * howo + oy * wo + ox] / count;
            }
        }
        memset(dst, 0, sizeof(float) * lanes * hw);
        // (the share's expression chosen outside the loops: inside, gcc computed both and kept one)
#define DEEPDSL_POOL_SPREAD(SHARE)                                                                      \
        for (int i = 0; i < kernel; ++i)                                                                 \
            for (int j = 0; j < kernel; ++j)                                                             \
                for (int oy = 0; oy < ho; ++oy) {                                                        \
                    const int y = oy * stride + i - pad;                                                 \
                    if (y < 0 || y >= h) continue;                                                       \
                    for (int ox = 0; ox < wo; ++ox) {                                                    \
                        const int x = ox * stride + j - pad;                                             \
                        if (x < 0 || x >= w) continue;                                                   \
                        const long o = oy * wo + ox, at = (long)y * w + x;                               \
                        for (int l = 0; l < lanes; ++l) {                                                \
                            const float share = SHARE;                                                   \
                            dst[l * hw + at] = overlap ? dst[l * hw + at] + share : share;               \
                        }                                                                                \
                    }                                                                                    \
                }
        if (kept) {
            DEEPDSL_POOL_SPREAD(shares[l * howo + o])
        } else {
            DEEPDSL_POOL_SPREAD(gp[l * howo + o] /
                                (float)(deepdsl_pool_count(oy, h, kernel, stride, pad, include_pad) *
                                        deepdsl_pool_count(ox, w, kernel, stride, pad, include_pad)))
        }
#undef DEEPDSL_POOL_SPREAD
    }
}

// ---------------------------------------------------------------------------------------------------------------
// rows of a table by index (token embeddings) and their gradient

// out[i] = table[ids[i]] (a row of NaN for a row number outside [0, rows)); a thread copies whole rows.
void deepdsl_take_rows(const float* table, const int* ids, long m, long d, long rows, float* out) {
#pragma omp parallel for schedule(static) if (m * d >= DEEPDSL_PARALLEL_MIN)
    for (long i = 0; i < m; ++i) {
        float* to = out + i * d;
        const long row = ids[i];
        if (row >= 0 && row < rows)
            deepdsl_copy_floats(to, table + row * d, d);
        else
            for (long c = 0; c < d; ++c) to[c] = __builtin_nanf("");
    }
}

// out = 0; out[ids[i]] += g[i] for i in order. A thread owns blocks of 16 columns of every row and adds the rows of
// g into them in the order of i: each sum is made in that order whatever the threads, the numpy kernel's bits.
void deepdsl_add_rows(const float* g, const int* ids, long m, long d, long rows, float* out) {
#pragma omp parallel if (m * d >= DEEPDSL_PARALLEL_MIN)
    {
        long c0, c1;
        deepdsl_share(d, 16, &c0, &c1);
        for (long r = 0; r < rows; ++r)
            for (long c = c0; c < c1; ++c) out[r * d + c] = 0.0f;
        for (long i = 0; i < m; ++i) {
            const long row = ids[i];
            if (row < 0 || row >= rows) continue;
            float* to = out + row * d;
            const float* from = g + i * d;
            for (long c = c0; c < c1; ++c) to[c] += from[c];
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// a classifier's ranks of its labels and masks of tokens

// out[i] = how many scores of row i come before its label's sorted by decreasing score, ties in column order (NaN
// for a label outside the row); a thread ranks whole rows.
void deepdsl_label_rank(const float* x, const int* labels, long rows, long classes, float* out) {
#pragma omp parallel for schedule(static) if (rows * classes >= DEEPDSL_PARALLEL_MIN)
    for (long i = 0; i < rows; ++i) {
        const long label = labels[i];
        if (label < 0 || label >= classes) { out[i] = __builtin_nanf(""); continue; }
        const float* row = x + i * classes;
        const float own = row[label];
        long ahead = 0;
        for (long j = 0; j < classes; ++j) ahead += (row[j] > own) | ((row[j] == own) & (j < label));
        out[i] = (float)ahead;
    }
}

// out = each row's log-softmax, (x - m) - log(sum_j exp(x_j - m)), m the row's largest score (NaN for a row holding
// NaN, as numpy's max gives; a row of -inf gives NaN). A thread computes whole rows; a row's exponentials are summed
// in 16 lanes halved in a fixed order (DEEPDSL_LANE_SUM): the results do not depend on the thread count.
void deepdsl_log_softmax(const float* x, long rows, long columns, float* out) {
#pragma omp parallel for schedule(static) if (rows * columns >= DEEPDSL_PARALLEL_MIN)
    for (long i = 0; i < rows; ++i) {
        const float* row = x + i * columns;
        float* o = out + i * columns;
        float lanes[DEEPDSL_SUM_LANES];
        for (int l = 0; l < DEEPDSL_SUM_LANES; ++l) lanes[l] = -INFINITY;
        long j = 0;
        for (; j + DEEPDSL_SUM_LANES <= columns; j += DEEPDSL_SUM_LANES) {
#pragma omp simd
            for (int l = 0; l < DEEPDSL_SUM_LANES; ++l) lanes[l] = deepdsl_maxf(lanes[l], row[j + l]);
        }
        for (int l = 0; j + l < columns; ++l) lanes[l] = deepdsl_maxf(lanes[l], row[j + l]);
        float m = lanes[0];
        for (int l = 1; l < DEEPDSL_SUM_LANES; ++l) m = deepdsl_maxf(m, lanes[l]);
        DEEPDSL_LANE_SUM(columns, lanes, k, deepdsl_expf_poly(row[k] - m));
        const float log_sum = logf(deepdsl_lane_total(lanes));
#pragma omp simd
        for (long k = 0; k < columns; ++k) o[k] = (row[k] - m) - log_sum;
    }
}

// out[i] = 1 where the token x[i] equals value, else 0
void deepdsl_equal_tokens(const int* x, long n, int value, uint8_t* out) {
#pragma omp parallel for schedule(static) if (n >= DEEPDSL_PARALLEL_MIN)
    for (long i = 0; i < n; ++i) out[i] = x[i] == value;
}

// Dropout's mask: n bytes of the stream keyed by (seed, stream), 1 with probability keep (deepdsl_random.h: the
// bytes numpy's generator gives, each a function of its index alone).
// Sixteen groups at a time, lane by lane in each round (vectors of groups: eight 64-bit lanes with AVX-512), or, where
// the products are scalar (AVX2), two groups side by side in scalar registers (`deepdsl_bernoulli_pair`: four
// groups' arrays went through the stack every round, 4.5 ns a byte on a Zen 3); a last partial block of groups
// alone.
#define DEEPDSL_BERNOULLI_LANES (DEEPDSL_PHILOX_VECTORS ? 16 : 2)

// the 8 bytes of a group's mask from its Philox block: each draw's low 32 bits, then its high ones. With AVX2's scalar
// products (the vector products' loop converts its groups' draws lane by lane) the eight in the lanes of a vector (the
// same conversion, product and comparison), the comparison's sign bits spread to bytes of 0 or 1: bit i replicated into
// byte i, kept by byte i's mask bit (2^i), then 2^i + 127 has bit 7 set and 0 + 127 has not, no byte carrying into the
// next.
static inline __attribute__((always_inline)) void deepdsl_bernoulli_bytes(const deepdsl_u64 draws[4], float keep,
                                                                          uint8_t* o) {
#if defined(__AVX2__) && !DEEPDSL_PHILOX_VECTORS
    __m256i bits;
    memcpy(&bits, draws, sizeof bits);
    const __m256 uniform = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 8)),
                                         _mm256_set1_ps(1.0f / 16777216.0f));
    const deepdsl_u64 signs = (deepdsl_u64)_mm256_movemask_ps(_mm256_cmp_ps(uniform, _mm256_set1_ps(keep),
                                                                             _CMP_LT_OQ));
    const deepdsl_u64 kept = (signs * 0x0101010101010101ULL) & 0x8040201008040201ULL;
    const deepdsl_u64 bytes = ((kept + 0x7F7F7F7F7F7F7F7FULL) >> 7) & 0x0101010101010101ULL;
    memcpy(o, &bytes, sizeof bytes);
#else
    for (int d = 0; d < 4; ++d) {
        o[2 * d] = deepdsl_bernoulli_bit((unsigned)draws[d], keep);
        o[2 * d + 1] = deepdsl_bernoulli_bit((unsigned)(draws[d] >> 32), keep);
    }
#endif
}

#if !DEEPDSL_PHILOX_VECTORS
// groups `group` and `group` + 1 (their bytes at o): two chains of products in flight, their state in registers
static inline __attribute__((always_inline)) void deepdsl_bernoulli_pair(deepdsl_u64 group, deepdsl_u64 seed,
                                                                         deepdsl_u64 stream, float keep, uint8_t* o) {
    deepdsl_u64 a0 = group + 1, a1 = 0, a2 = 0, a3 = 0, b0 = group + 2, b1 = 0, b2 = 0, b3 = 0;
#pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {
        const deepdsl_u64 k0 = seed + round * DEEPDSL_PHILOX_W0, k1 = stream + round * DEEPDSL_PHILOX_W1;
        deepdsl_philox_round(&a0, &a1, &a2, &a3, k0, k1);
        deepdsl_philox_round(&b0, &b1, &b2, &b3, k0, k1);
    }
    const deepdsl_u64 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
    deepdsl_bernoulli_bytes(a, keep, o);
    deepdsl_bernoulli_bytes(b, keep, o + 8);
}
#endif

void deepdsl_bernoulli(uint8_t* out, long n, unsigned long long seed, unsigned long long stream, float keep) {
    const long blocks = n / (8 * DEEPDSL_BERNOULLI_LANES);
#pragma omp parallel for schedule(static) if (n >= DEEPDSL_PARALLEL_MIN)
    for (long block = 0; block < blocks; ++block) {
        uint8_t* o = out + block * 8 * DEEPDSL_BERNOULLI_LANES;
#if DEEPDSL_PHILOX_VECTORS
        deepdsl_u64 c0[DEEPDSL_BERNOULLI_LANES], c1[DEEPDSL_BERNOULLI_LANES], c2[DEEPDSL_BERNOULLI_LANES],
            c3[DEEPDSL_BERNOULLI_LANES];
        for (int l = 0; l < DEEPDSL_BERNOULLI_LANES; ++l) {
            c0[l] = (deepdsl_u64)(block * DEEPDSL_BERNOULLI_LANES + l) + 1;
            c1[l] = c2[l] = c3[l] = 0;
        }
        for (int round = 0; round < 10; ++round) {
            const deepdsl_u64 k0 = seed + round * DEEPDSL_PHILOX_W0, k1 = stream + round * DEEPDSL_PHILOX_W1;
#pragma omp simd
            for (int l = 0; l < DEEPDSL_BERNOULLI_LANES; ++l)
                deepdsl_philox_round(&c0[l], &c1[l], &c2[l], &c3[l], k0, k1);
        }
#pragma omp simd
        for (int l = 0; l < DEEPDSL_BERNOULLI_LANES; ++l) {
            const deepdsl_u64 draws[4] = {c0[l], c1[l], c2[l], c3[l]};
            deepdsl_bernoulli_bytes(draws, keep, o + 8 * l);
        }
#else
        deepdsl_bernoulli_pair((deepdsl_u64)block * 2, seed, stream, keep, o);
#endif
    }
    for (long group = blocks * DEEPDSL_BERNOULLI_LANES; group * 8 < n; ++group)
        deepdsl_bernoulli_group(group, n, seed, stream, keep, out);
}

// thin convolutions straight from the input
#include "cpu_conv.c"

// direct convolutions on channel-blocked copies
#include "cpu_blocked.c"

// Winograd's F(4x4, 3x3) on channel-blocked copies
#include "cpu_winograd.c"

// matrix products on these threads
#include "cpu_gemm.c"

// attention's passes over rows
#include "cpu_attention.c"

// the render of images read from files into batch slots
#include "cpu_images.c"
