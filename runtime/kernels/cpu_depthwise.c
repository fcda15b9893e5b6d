// Depthwise convolutions (groups = channels = filters, MobileNet's) and their gradients, two ways:
// - plane by plane (`deepdsl_depthwise_planes` and the gradients' `_planes`): each tap of a channel's filter times
//   the channel's plane shifted by the tap, rows in vectors (stride-1 planes "widened": a flat pass over the padded
//   plane per tap);
// - a vector's channels at a time (`deepdsl_depthwise_lanes`, "lanes": 16 with AVX-512, 8 with AVX2): a sample's
//   planes of that many consecutive channels interleaved into the thread's buffer, position by position, so that
//   every tap at every output position is one product of a vector, whatever the plane's size and the stride; for
//   small planes and strided ones, which leave most of a row's vector idle plane by plane.
// Each lane computes what the plane kernels compute for its channel, in their order: the forward and the input
// gradient give the same bits either way; the filter gradient gives those of the plane kernel's row-by-row sums.
// The public kernels at the end choose by the shapes alone.

// Depthwise convolution (groups = channels = filters, MobileNet's): plane by plane, each tap of a channel's filter
// times its input plane shifted by the tap (zeros outside), with no im2col matrix; out (m, c, ho, wo) from x
// (m, c, h, w) and w (c, 1, kh, kw). Its input gradient scatters the same products back (`scatter`): each tap
// times the output gradient added into the input positions the tap read.
static void deepdsl_depthwise_taps(const float* f, int h, int wd, int kh, int kw, int ho, int wo, int stride,
                                   int pad, const float* from, float* to, int scatter) {
    for (int i = 0; i < kh; ++i) {
        int p0, p1;
        deepdsl_valid(i, h, ho, stride, pad, &p0, &p1);
        for (int j = 0; j < kw; ++j) {
            int q0, q1;
            deepdsl_valid(j, wd, wo, stride, pad, &q0, &q1);
            const float tap = f[i * kw + j];
            for (int p = p0; p < p1; ++p) {
                const long input = (long)(i + stride * p - pad) * wd + (j - pad), output = (long)p * wo;
                if (scatter && stride == 2) {
                    float* row = to + input;
                    const float* grad = from + output;
#pragma omp simd
                    for (int q = q0; q < q1; ++q) row[2L * q] += tap * grad[q];
                } else if (scatter) {
                    float* row = to + input;
                    const float* grad = from + output;
                    for (int q = q0; q < q1; ++q) row[(long)stride * q] += tap * grad[q];
                } else if (stride == 1) {
                    const float* row = from + input;
                    float* d = to + output;
#pragma omp simd
                    for (int q = q0; q < q1; ++q) d[q] += tap * row[q];
                } else if (stride == 2) {             // (a constant stride: even and odd lanes, vectorized)
                    const float* row = from + input;
                    float* d = to + output;
#pragma omp simd
                    for (int q = q0; q < q1; ++q) d[q] += tap * row[2L * q];
                } else {
                    const float* row = from + input;
                    float* d = to + output;
                    for (int q = q0; q < q1; ++q) d[q] += tap * row[(long)stride * q];
                }
            }
        }
    }
}

// Stride-1 depthwise convolutions on planes of at most DEEPDSL_DW_PLANE floats padded run "widened": the plane is
// copied with its zero padding (and kw - 1 zeros after it) into the thread's buffer, and each tap's products are
// added over rows as wide as the padded plane in one flat, vectorized pass (the columns past the output's are
// computed and dropped), rather than row by row and tap by tap. The same products are added in the same order (a
// padding position adds a zero product where the row-by-row loops skip it), so the sums are the same.
#define DEEPDSL_DW_PLANE (1L << 16)
#define DEEPDSL_DW_FILTER_ROWS 128      /* the filter gradient's widened rows at least (small planes: row by row) */

// Whether a stride-1 depthwise convolution's planes run widened.
static inline int deepdsl_depthwise_widened(int h, int wd, int kh, int kw, int stride, int pad) {
    return stride == 1 && pad < kh && pad < kw &&
           (long)(h + kh - 1 + 2 * pad) * (wd + kw - 1 + 2 * pad) + kw <= DEEPDSL_DW_PLANE;
}

// The rows of a padded plane (rows x width, then `extra` floats) from the (h, wd) plane `from`: `top` rows down and
// `left` columns in. The thread's buffer is set to zero once (`deepdsl_zero_plane`) and every plane copied into it
// writes the same floats, so its padding stays zero: setting all of it to zero for every plane took 11 % of a filter
// gradient's time.
static inline void deepdsl_zero_plane(int rows, int width, int extra, float* to) {
    memset(to, 0, sizeof(float) * ((long)rows * width + extra));
}

static inline void deepdsl_plane_rows(const float* from, int h, int wd, int top, int left, int width, float* to) {
    for (int p = 0; p < h; ++p) memcpy(to + (long)(top + p) * width + left, from + (long)p * wd, sizeof(float) * wd);
}

// wide[k] = sum over taps (i, j) in order of f[i][j] * src[k + i * width + j] for k < n (the tap turned around with
// `flip`): unfused products added from zero, as the row loops do, `DEEPDSL_DW_BLOCK` vectors of positions (then one)
// at a time with their sums in registers over the taps. A position's sum is one chain of additions (a product, then
// its add, tap after tap): a block of eight independent chains keeps both of the processor's adders busy where four
// waited on the adds' latency (with an array of sums set to zero by `rep stos` and copied through the stack: the
// taps of 16 x 144 planes of 28 x 28 took 2.3x the time on a Zen 3).
#define DEEPDSL_DW_BLOCK 8
static inline __attribute__((always_inline)) void deepdsl_widened_block(const float* f, int taps, const long* offsets,
                                                                       const float* src, int vectors, float* wide) {
    deepdsl_v8f acc[DEEPDSL_DW_BLOCK];
    #pragma GCC unroll 8
    for (int u = 0; u < vectors; ++u) acc[u] = (deepdsl_v8f){0};
    for (int t = 0; t < taps; ++t) {
        const float* from = src + offsets[t];
        const float tap = f[t];
        #pragma GCC unroll 8
        for (int u = 0; u < vectors; ++u) {
            deepdsl_v8f v;
            memcpy(&v, from + 8 * u, sizeof v);
            acc[u] += tap * v;
        }
    }
    #pragma GCC unroll 8
    for (int u = 0; u < vectors; ++u) memcpy(wide + 8 * u, &acc[u], sizeof acc[u]);
}

static void deepdsl_widened_taps(const float* f, int kh, int kw, int width, const float* src, long n, int flip,
                                 float* wide) {
    const int taps = kh * kw;
    long offsets[taps];
    for (int t = 0; t < taps; ++t) {
        const int i = t / kw, j = t % kw;
        offsets[t] = (long)(flip ? kh - 1 - i : i) * width + (flip ? kw - 1 - j : j);
    }
    long k = 0;
    for (; k + 8 * DEEPDSL_DW_BLOCK <= n; k += 8 * DEEPDSL_DW_BLOCK)
        deepdsl_widened_block(f, taps, offsets, src + k, DEEPDSL_DW_BLOCK, wide + k);
    for (; k + 8 <= n; k += 8)
        deepdsl_widened_block(f, taps, offsets, src + k, 1, wide + k);
    for (; k < n; ++k) {
        float acc = 0.0f;
        for (int t = 0; t < taps; ++t) acc += f[t] * src[offsets[t] + k];
        wide[k] = acc;
    }
}

// to (m, c, oh, ow) = per plane of from (m, c, fh, fw), padded by `top` rows and `left` columns: each channel's taps
// over it widened (`deepdsl_widened_taps`, the taps turned around with `flip`), then + bias (c) when given; the
// planes on the kernels' threads, each with its padded plane and widened rows in the thread's buffer.
static void deepdsl_widened_planes(const float* from, const float* w, const float* bias, int m, int c, int fh, int fw,
                                   int top, int left, int kh, int kw, int flip, int oh, int ow, float* to) {
    const int hp = fh + 2 * top, wp = fw + 2 * left;
#pragma omp parallel if ((long)m * c * oh * ow * kh * kw >= DEEPDSL_PARALLEL_MIN)
    {
        float* plane = malloc(sizeof(float) * ((long)hp * wp + kw + (long)oh * wp));
        float* wide = plane + (long)hp * wp + kw;
        deepdsl_zero_plane(hp, wp, kw, plane);
#pragma omp for collapse(2) schedule(static)
        for (int s = 0; s < m; ++s)
            for (int ch = 0; ch < c; ++ch) {
                deepdsl_plane_rows(from + ((long)s * c + ch) * fh * fw, fh, fw, top, left, wp, plane);
                deepdsl_widened_taps(w + (long)ch * kh * kw, kh, kw, wp, plane, (long)oh * wp, flip, wide);
                float* dst = to + ((long)s * c + ch) * oh * ow;
                for (int p = 0; p < oh; ++p) {
                    const float* row = wide + (long)p * wp;
                    if (bias) {
                        const float b = bias[ch];
#pragma omp simd
                        for (int q = 0; q < ow; ++q) dst[(long)p * ow + q] = row[q] + b;
                    } else {
                        deepdsl_copy_floats(dst + (long)p * ow, row, ow);
                    }
                }
            }
        free(plane);
    }
}

// The sum over the taps comes first, then the bias, as numpy's products do.
static void deepdsl_depthwise_planes(const float* x, const float* w, const float* bias, int m, int c, int h,
                                     int wd, int kh, int kw, int ho, int wo, int stride, int pad, float* out) {
    if (deepdsl_depthwise_widened(h, wd, kh, kw, stride, pad)) {
        deepdsl_widened_planes(x, w, bias, m, c, h, wd, pad, pad, kh, kw, 0, ho, wo, out);
        return;
    }
#pragma omp parallel for collapse(2) schedule(static) if ((long)m * c * ho * wo * kh * kw >= DEEPDSL_PARALLEL_MIN)
    for (int s = 0; s < m; ++s) {
        for (int ch = 0; ch < c; ++ch) {
            float* dst = out + ((long)s * c + ch) * ho * wo;
            memset(dst, 0, sizeof(float) * ho * wo);
            deepdsl_depthwise_taps(w + (long)ch * kh * kw, h, wd, kh, kw, ho, wo, stride, pad,
                                   x + ((long)s * c + ch) * h * wd, dst, 0);
            if (bias) {
                const float b = bias[ch];
#pragma omp simd
                for (long k = 0; k < (long)ho * wo; ++k) dst[k] += b;
            }
        }
    }
}

// The input gradient widened: the output gradient padded by kh - 1 - pad rows and kw - 1 - pad columns, each tap
// (in order) times it shifted by the turned-around tap: dx[y][x] = sum over (i, j) of w[i][j] g[y + pad - i]
// [x + pad - j], the products the scatter adds, in its order.
static void deepdsl_depthwise_bwd_data_planes(const float* g, const float* w, int m, int c, int h, int wd, int kh,
                                              int kw, int ho, int wo, int stride, int pad, float* dx) {
    if (deepdsl_depthwise_widened(h, wd, kh, kw, stride, pad)) {
        deepdsl_widened_planes(g, w, NULL, m, c, ho, wo, kh - 1 - pad, kw - 1 - pad, kh, kw, 1, h, wd, dx);
        return;
    }
#pragma omp parallel for collapse(2) schedule(static) if ((long)m * c * ho * wo * kh * kw >= DEEPDSL_PARALLEL_MIN)
    for (int s = 0; s < m; ++s) {
        for (int ch = 0; ch < c; ++ch) {
            float* dst = dx + ((long)s * c + ch) * h * wd;
            memset(dst, 0, sizeof(float) * h * wd);
            deepdsl_depthwise_taps(w + (long)ch * kh * kw, h, wd, kh, kw, ho, wo, stride, pad,
                                   g + ((long)s * c + ch) * ho * wo, dst, 1);
        }
    }
}

// The sum of 16 lanes in one fixed order (pairs, then pairs of pairs).
static inline float deepdsl_lanes16_sum(const float* v) {
    float a[8];
    for (int l = 0; l < 8; ++l) a[l] = v[l] + v[l + 8];
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// out[t] = sum over k < n of a[k] * b[k + t] for t < T, each in 16 lanes (two vectors of 8: the same sums on any SIMD
// width), added up at the end: T dot products at once (one alone waits on its adds), each summed as it would be alone.
#define DEEPDSL_DOT_SHIFTS 3
static inline __attribute__((always_inline)) void deepdsl_dot16_shifts(const float* a, const float* b, long n, int T,
                                                                      float* out) {
    deepdsl_v8f lo[DEEPDSL_DOT_SHIFTS], hi[DEEPDSL_DOT_SHIFTS];
    #pragma GCC unroll 3
    for (int t = 0; t < T; ++t) lo[t] = hi[t] = (deepdsl_v8f){0};
    long k = 0;
    for (; k + 16 <= n; k += 16) {
        deepdsl_v8f a0, a1;
        memcpy(&a0, a + k, sizeof a0);
        memcpy(&a1, a + k + 8, sizeof a1);
        #pragma GCC unroll 3
        for (int t = 0; t < T; ++t) {
            deepdsl_v8f b0, b1;
            memcpy(&b0, b + t + k, sizeof b0);
            memcpy(&b1, b + t + k + 8, sizeof b1);
            lo[t] += a0 * b0;
            hi[t] += a1 * b1;
        }
    }
    #pragma GCC unroll 3
    for (int t = 0; t < T; ++t) {
        float lanes[16];
        memcpy(lanes, &lo[t], sizeof lo[t]);
        memcpy(lanes + 8, &hi[t], sizeof hi[t]);
        for (long l = 0; k + l < n; ++l) lanes[l] += a[k + l] * b[t + k + l];
        out[t] = deepdsl_lanes16_sum(lanes);
    }
}

// Its filter gradient: for each channel and tap, the sum over samples and output positions of the output gradient
// times the input the tap read. Widened (stride 1, `deepdsl_depthwise_widened`): per sample, the output gradient
// with zero columns to the padded input's width, and each tap's sum one flat dot product of it with the padded input
// shifted by the tap (16 lanes), the samples' sums added in order; where those rows are fewer than
// DEEPDSL_DW_FILTER_ROWS floats, row by row (copying such a plane costs more than its few products).
static void deepdsl_depthwise_bwd_filter_planes(const float* g, const float* x, int m, int c, int h, int wd, int kh,
                                                int kw, int ho, int wo, int stride, int pad, float* dw) {
    if (deepdsl_depthwise_widened(h, wd, kh, kw, stride, pad) &&
        (long)ho * (wd + 2 * pad) >= DEEPDSL_DW_FILTER_ROWS) {
        const int hp = h + 2 * pad, wp = wd + 2 * pad;
        const long n = (long)ho * wp;
#pragma omp parallel if ((long)m * c * ho * wo * kh * kw >= DEEPDSL_PARALLEL_MIN)
        {
            float* plane = malloc(sizeof(float) * ((long)hp * wp + kw + n));
            float* wide = plane + (long)hp * wp + kw;
            deepdsl_zero_plane(hp, wp, kw, plane);
            deepdsl_zero_plane(ho, wp, 0, wide);
#pragma omp for schedule(static)
            for (int ch = 0; ch < c; ++ch) {
                float* total = dw + (long)ch * kh * kw;
                for (int t = 0; t < kh * kw; ++t) total[t] = 0.0f;
                for (int s = 0; s < m; ++s) {
                    deepdsl_plane_rows(x + ((long)s * c + ch) * h * wd, h, wd, pad, pad, wp, plane);
                    deepdsl_plane_rows(g + ((long)s * c + ch) * ho * wo, ho, wo, 0, 0, wp, wide);
                    for (int i = 0; i < kh; ++i)        // a row's taps DEEPDSL_DOT_SHIFTS at a time, then one
                        for (int j = 0; j < kw;) {
                            const int T = kw - j >= DEEPDSL_DOT_SHIFTS ? DEEPDSL_DOT_SHIFTS : 1;
                            float dots[DEEPDSL_DOT_SHIFTS];
                            if (T == DEEPDSL_DOT_SHIFTS)
                                deepdsl_dot16_shifts(wide, plane + (long)i * wp + j, n, DEEPDSL_DOT_SHIFTS, dots);
                            else
                                deepdsl_dot16_shifts(wide, plane + (long)i * wp + j, n, 1, dots);
                            for (int u = 0; u < T; ++u) total[i * kw + j + u] += dots[u];
                            j += T;
                        }
                }
            }
            free(plane);
        }
        return;
    }
#pragma omp parallel for collapse(2) schedule(static) if ((long)m * c * ho * wo * kh * kw >= DEEPDSL_PARALLEL_MIN)
    for (int ch = 0; ch < c; ++ch) {
        for (int t = 0; t < kh * kw; ++t) {
            const int i = t / kw, j = t % kw;
            int p0, p1, q0, q1;
            deepdsl_valid(i, h, ho, stride, pad, &p0, &p1);
            deepdsl_valid(j, wd, wo, stride, pad, &q0, &q1);
            float total = 0.0f;
            for (int s = 0; s < m; ++s) {
                const float* grad = g + ((long)s * c + ch) * ho * wo;
                const float* src = x + ((long)s * c + ch) * h * wd;
                for (int p = p0; p < p1; ++p) {
                    const float* row = src + (long)(i + stride * p - pad) * wd + (j - pad);
                    const float* gr = grad + (long)p * wo;
                    float part = 0.0f;
                    for (int q = q0; q < q1; ++q) part += gr[q] * row[(long)stride * q];
                    total += part;
                }
            }
            dw[(long)ch * kh * kw + t] = total;
        }
    }
}


// ---------------------------------------------------------------------------------------------------------------
// A vector's channels at a time

// A vector of DEEPDSL_DW_LANES channels: 16 with AVX-512, 8 without (gcc splits wider vectors through memory).
// Each lane sums alone, so the width changes no bits.
#if defined(__AVX512F__)
#define DEEPDSL_DW_LANES 16
typedef float deepdsl_dw_v __attribute__((vector_size(64)));
#else
#define DEEPDSL_DW_LANES 8
typedef deepdsl_v8f deepdsl_dw_v;
#endif
#define DEEPDSL_DW_LANE_FLOATS (1L << 17)   /* a thread's interleaved planes at most (512 KB) */

static inline __attribute__((always_inline)) deepdsl_dw_v deepdsl_dw_load(const float* from) {
    deepdsl_dw_v v;
    memcpy(&v, from, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void deepdsl_dw_store(float* to, deepdsl_dw_v v) {
    memcpy(to, &v, sizeof v);
}

// to[k][l] (DEEPDSL_DW_LANES a position, k < n) = from[l * plane + k] for the first `lanes` channels l, zero in
// the others.
static void deepdsl_lanes_in(const float* from, long plane, int lanes, long n, float* to) {
    long k = 0;
    if (lanes == DEEPDSL_DW_LANES)
        for (; k + 8 <= n; k += 8)
            for (int half = 0; half < DEEPDSL_DW_LANES; half += 8) {
                deepdsl_v8f r[8];
                deepdsl_load8x8(r, from + half * plane + k, plane);
                deepdsl_transpose8(r);
                deepdsl_store8x8(to + k * DEEPDSL_DW_LANES + half, DEEPDSL_DW_LANES, r);
            }
    for (; k < n; ++k)
        for (int l = 0; l < DEEPDSL_DW_LANES; ++l) to[k * DEEPDSL_DW_LANES + l] = l < lanes ? from[l * plane + k] : 0;
}

// to[l * plane + k] = from[k][l] for k < n and the first `lanes` lanes l.
static void deepdsl_lanes_out(const float* from, long n, int lanes, long plane, float* to) {
    long k = 0;
    if (lanes == DEEPDSL_DW_LANES)
        for (; k + 8 <= n; k += 8)
            for (int half = 0; half < DEEPDSL_DW_LANES; half += 8) {
                deepdsl_v8f r[8];
                deepdsl_load8x8(r, from + k * DEEPDSL_DW_LANES + half, DEEPDSL_DW_LANES);
                deepdsl_transpose8(r);
                deepdsl_store8x8(to + half * plane + k, plane, r);
            }
    for (; k < n; ++k)
        for (int l = 0; l < lanes; ++l) to[l * plane + k] = from[k * DEEPDSL_DW_LANES + l];
}

// F[t][l] = tap t of filter l (w: `lanes` filters of `taps` taps), zero past them; B[l] = bias[l] likewise.
static void deepdsl_lanes_filters(const float* w, const float* bias, int taps, int lanes, float* F, float* B) {
    for (int t = 0; t < taps; ++t)
        for (int l = 0; l < DEEPDSL_DW_LANES; ++l) F[t * DEEPDSL_DW_LANES + l] = l < lanes ? w[(long)l * taps + t] : 0;
    if (bias)
        for (int l = 0; l < DEEPDSL_DW_LANES; ++l) B[l] = l < lanes ? bias[l] : 0;
}

// O[u] (u < P, a vector's channels each) = the sums over the taps of P output positions `stride` columns apart
// whose taps (rows i0 to i1 - 1, every column) all lie in the plane, the first one's top left tap at `at`: P
// independent sums at once, each in its taps' order (one position's sum alone waits on each add).
#define DEEPDSL_DW_POSITIONS 4
static inline __attribute__((always_inline)) void deepdsl_lanes_positions(const float* at, const float* F,
                                                                         const float* B, int i0, int i1, int wd,
                                                                         int kw, int stride, int P, float* O) {
    deepdsl_dw_v acc[DEEPDSL_DW_POSITIONS];
    #pragma GCC unroll 4
    for (int u = 0; u < P; ++u) acc[u] = (deepdsl_dw_v){0};
    for (int i = i0; i < i1; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < kw; ++j) {
            const deepdsl_dw_v f = deepdsl_dw_load(F + ((long)i * kw + j) * DEEPDSL_DW_LANES);
            const float* x = at + ((long)i * wd + j) * DEEPDSL_DW_LANES;
            #pragma GCC unroll 4
            for (int u = 0; u < P; ++u) acc[u] += f * deepdsl_dw_load(x + (long)u * stride * DEEPDSL_DW_LANES);
        }
    #pragma GCC unroll 4
    for (int u = 0; u < P; ++u) {
        if (B) acc[u] += deepdsl_dw_load(B);
        deepdsl_dw_store(O + (long)u * DEEPDSL_DW_LANES, acc[u]);
    }
}

// O[p][q] = the sum over the taps (i, j) in order whose input lies in the plane of F[i][j] X[s p + i - pad]
// [s q + j - pad], from zero, then + B where given: the plane kernels' sums, a vector's channels at once. The
// columns whose taps all lie in the plane, [qa, qb), run with the filter's width known to the compiler where it is 3
// (`kw3`).
static inline __attribute__((always_inline)) void deepdsl_lanes_conv_rows(const float* X, const float* F,
                                                                         const float* B, int h, int wd, int kh,
                                                                         int kw, int ho, int wo, int stride,
                                                                         int pad, int kw3, float* O) {
    if (kw3) kw = 3;
    const int qa = (pad + stride - 1) / stride;
    int qb = wd - kw + pad >= 0 ? (wd - kw + pad) / stride + 1 : 0;
    if (qb > wo) qb = wo;
    if (qb < qa) qb = qa;
    for (int p = 0; p < ho; ++p) {
        const int y0 = stride * p - pad;
        const int i0 = y0 < 0 ? -y0 : 0, i1 = h - y0 < kh ? h - y0 : kh;
        float* out = O + (long)p * wo * DEEPDSL_DW_LANES;
        int q = qa;
        for (; q + DEEPDSL_DW_POSITIONS <= qb; q += DEEPDSL_DW_POSITIONS)     // positions whose taps all lie in it
            deepdsl_lanes_positions(X + ((long)y0 * wd + stride * q - pad) * DEEPDSL_DW_LANES, F, B, i0, i1, wd,
                                    kw, stride, DEEPDSL_DW_POSITIONS, out + (long)q * DEEPDSL_DW_LANES);
        for (; q < qb; ++q)
            deepdsl_lanes_positions(X + ((long)y0 * wd + stride * q - pad) * DEEPDSL_DW_LANES, F, B, i0, i1, wd,
                                    kw, stride, 1, out + (long)q * DEEPDSL_DW_LANES);
        for (q = 0; q < wo; ++q) {      // the others: their taps that lie in the plane
            if (q >= qa && q < qb)
                continue;
            const int x0 = stride * q - pad;
            const float* at = X + ((long)y0 * wd + x0) * DEEPDSL_DW_LANES;
            const int j0 = x0 < 0 ? -x0 : 0, j1 = wd - x0 < kw ? wd - x0 : kw;
            deepdsl_dw_v acc = {0};
            for (int i = i0; i < i1; ++i)
                for (int j = j0; j < j1; ++j)
                    acc += deepdsl_dw_load(F + ((long)i * kw + j) * DEEPDSL_DW_LANES) *
                           deepdsl_dw_load(at + ((long)i * wd + j) * DEEPDSL_DW_LANES);
            if (B) acc += deepdsl_dw_load(B);
            deepdsl_dw_store(out + (long)q * DEEPDSL_DW_LANES, acc);
        }
    }
}

static void deepdsl_lanes_conv(const float* X, const float* F, const float* B, int h, int wd, int kh, int kw, int ho,
                               int wo, int stride, int pad, float* O) {
    if (kw == 3) deepdsl_lanes_conv_rows(X, F, B, h, wd, kh, kw, ho, wo, stride, pad, 1, O);
    else deepdsl_lanes_conv_rows(X, F, B, h, wd, kh, kw, ho, wo, stride, pad, 0, O);
}

// The taps t = first, first + stride, ... (`count` of them) that read input coordinate y, at output coordinates
// o = (y + pad - first) / stride, o - 1, ...: those whose o is a whole number in [0, out).
static inline void deepdsl_reading_taps(int y, int k, int out, int stride, int pad, int* first, int* count, int* o) {
    const int lo = y + pad - stride * (out - 1) > 0 ? y + pad - stride * (out - 1) : 0;
    const int end = y + pad + 1 < k ? y + pad + 1 : k;
    *first = lo + (y + pad - lo) % stride;
    *count = *first < end ? (end - 1 - *first) / stride + 1 : 0;
    *o = (y + pad - *first) / stride;
}

// D[x + u stride] (u < P, a vector's channels each) for P input positions `stride` columns apart of one row that the
// same taps read (rows i0, i0 + stride, ... (`rows`), columns first, first + stride, ... (`count`)), at output
// columns q0, q0 + 1, ...: the taps' products F[i][j] G[p][q] in order from zero, P independent sums at once.
static inline __attribute__((always_inline)) void deepdsl_lanes_gathered(const float* G, const float* F, int wo,
                                                                        int kw, int stride, int i0, int rows, int p0,
                                                                        int first, int count, int q0, int P,
                                                                        float* D) {
    deepdsl_dw_v acc[DEEPDSL_DW_POSITIONS];
    #pragma GCC unroll 4
    for (int u = 0; u < P; ++u) acc[u] = (deepdsl_dw_v){0};
    for (int a = 0; a < rows; ++a) {
        const float* grad = G + ((long)(p0 - a) * wo + q0) * DEEPDSL_DW_LANES;
        const float* taps = F + ((long)(i0 + a * stride) * kw + first) * DEEPDSL_DW_LANES;
        for (int b = 0; b < count; ++b) {
            const deepdsl_dw_v f = deepdsl_dw_load(taps + (long)b * stride * DEEPDSL_DW_LANES);
            #pragma GCC unroll 4
            for (int u = 0; u < P; ++u)
                acc[u] += f * deepdsl_dw_load(grad + (long)(u - b) * DEEPDSL_DW_LANES);
        }
    }
    #pragma GCC unroll 4
    for (int u = 0; u < P; ++u) deepdsl_dw_store(D + (long)u * stride * DEEPDSL_DW_LANES, acc[u]);
}

// D[y][x] = the sum over the taps (i, j) in order that read input position (y, x), at output position (p, q) =
// ((y + pad - i) / s, (x + pad - j) / s), of F[i][j] G[p][q], from zero: the products the plane kernels add into
// that position, in their order. Positions `stride` apart that the same taps read, DEEPDSL_DW_POSITIONS at a time
// (along a row, the first tap and the count of a class of positions `stride` apart only grow: the same at both ends
// of a run, the same in between). `columns`: 3 wd ints of room.
static void deepdsl_lanes_conv_bwd_data(const float* G, const float* F, int h, int wd, int kh, int kw, int ho, int wo,
                                        int stride, int pad, int* columns, float* D) {
    int *first = columns, *count = columns + wd, *q0 = columns + 2 * wd;
    for (int x = 0; x < wd; ++x) deepdsl_reading_taps(x, kw, wo, stride, pad, first + x, count + x, q0 + x);
    const int P = DEEPDSL_DW_POSITIONS;
    for (int y = 0; y < h; ++y) {
        int i0, rows, p0;
        deepdsl_reading_taps(y, kh, ho, stride, pad, &i0, &rows, &p0);
        float* row = D + (long)y * wd * DEEPDSL_DW_LANES;
        for (int r = 0; r < stride && r < wd; ++r)
            for (int x = r; x < wd;) {
                const int last = x + (P - 1) * stride;
                if (last < wd && first[last] == first[x] && count[last] == count[x] && q0[last] == q0[x] + P - 1) {
                    deepdsl_lanes_gathered(G, F, wo, kw, stride, i0, rows, p0, first[x], count[x], q0[x], P,
                                           row + (long)x * DEEPDSL_DW_LANES);
                    x += P * stride;
                } else {
                    deepdsl_lanes_gathered(G, F, wo, kw, stride, i0, rows, p0, first[x], count[x], q0[x], 1,
                                           row + (long)x * DEEPDSL_DW_LANES);
                    x += stride;
                }
            }
    }
}

// T[i][j] += for each output row p whose tap row i lies in the plane, in order, the sum over the output columns q
// in order whose tap column lies in it, from zero, of G[p][q] X[s p + i - pad][s q + j - pad]: one sample's part of
// the plane kernel's row-by-row sums. An output row's taps (i, j) for its R tap rows that lie in the plane (x: the
// first one's input row, T its taps) and every j at once: R kw independent sums (the 3x3 filters' nine in
// registers, which keeps the adders busy where one row's three would wait on each other), each over its own
// columns in order (those before the columns all taps read, those, those after).
static inline __attribute__((always_inline)) void deepdsl_lanes_filter_rows(const float* grad, const float* x, int R,
                                                                           int wd, int kw, int wo, int stride,
                                                                           int pad, float* T) {
    deepdsl_dw_v part[R][kw];
    int q0[kw], q1[kw];
    int qa = 0, qb = wo;
    for (int j = 0; j < kw; ++j) {
        for (int r = 0; r < R; ++r) part[r][j] = (deepdsl_dw_v){0};
        deepdsl_valid(j, wd, wo, stride, pad, &q0[j], &q1[j]);
        if (q0[j] > qa) qa = q0[j];
        if (q1[j] < qb) qb = q1[j];
    }
    const int middle = qa < qb ? qb : qa;
#define DEEPDSL_DW_INPUT(r, j, q) deepdsl_dw_load(x + ((long)(r) * wd + stride * (q) - pad + (j)) * DEEPDSL_DW_LANES)
#define DEEPDSL_DW_GRAD(q) deepdsl_dw_load(grad + (long)(q) * DEEPDSL_DW_LANES)
    for (int j = 0; j < kw; ++j)
        for (int q = q0[j]; q < (q1[j] < qa ? q1[j] : qa); ++q)
            for (int r = 0; r < R; ++r) part[r][j] += DEEPDSL_DW_GRAD(q) * DEEPDSL_DW_INPUT(r, j, q);
    for (int q = qa; q < middle; ++q) {
        const deepdsl_dw_v g = DEEPDSL_DW_GRAD(q);
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < kw; ++j) part[r][j] += g * DEEPDSL_DW_INPUT(r, j, q);
    }
    for (int j = 0; j < kw; ++j)
        for (int q = q0[j] > middle ? q0[j] : middle; q < q1[j]; ++q)
            for (int r = 0; r < R; ++r) part[r][j] += DEEPDSL_DW_GRAD(q) * DEEPDSL_DW_INPUT(r, j, q);
#undef DEEPDSL_DW_INPUT
#undef DEEPDSL_DW_GRAD
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < kw; ++j) {
            float* at = T + ((long)r * kw + j) * DEEPDSL_DW_LANES;
            deepdsl_dw_store(at, deepdsl_dw_load(at) + part[r][j]);
        }
}

static void deepdsl_lanes_conv_bwd_filter(const float* G, const float* X, int h, int wd, int kh, int kw, int ho,
                                          int wo, int stride, int pad, float* T) {
    for (int p = 0; p < ho; ++p) {
        const int y0 = stride * p - pad;
        const int i0 = y0 < 0 ? -y0 : 0, i1 = h - y0 < kh ? h - y0 : kh, rows = i1 - i0;
        const float* grad = G + (long)p * wo * DEEPDSL_DW_LANES;
        const float* x = X + (long)(y0 + i0) * wd * DEEPDSL_DW_LANES;
        float* taps = T + (long)i0 * kw * DEEPDSL_DW_LANES;
        if (kw == 3 && rows == 3) deepdsl_lanes_filter_rows(grad, x, 3, wd, 3, wo, stride, pad, taps);
        else if (kw == 3 && rows == 2) deepdsl_lanes_filter_rows(grad, x, 2, wd, 3, wo, stride, pad, taps);
        else
            for (int r = 0; r < rows; ++r)
                deepdsl_lanes_filter_rows(grad, x + (long)r * wd * DEEPDSL_DW_LANES, 1, wd, kw, wo, stride, pad,
                                          taps + (long)r * kw * DEEPDSL_DW_LANES);
    }
}

// Whether a depthwise convolution and its gradients run a vector's channels at a time: at least that many channels,
// a sample's planes of them in and out fit a thread's buffer, and the planes are not wide stride-1 ones (which run
// widened plane by plane as fast, and whose filter gradient sums in 16 lanes of its own). The filter gradient then
// sums as the plane kernel would have (row by row): the choice changes no bits.
static inline int deepdsl_depthwise_lanes(int c, int h, int wd, int kh, int kw, int ho, int wo, int stride, int pad) {
    return c >= DEEPDSL_DW_LANES && (long)(h * wd + ho * wo) * DEEPDSL_DW_LANES <= DEEPDSL_DW_LANE_FLOATS &&
           !(deepdsl_depthwise_widened(h, wd, kh, kw, stride, pad) &&
             (long)ho * (wd + 2 * pad) >= DEEPDSL_DW_FILTER_ROWS);
}

// A thread's buffer for a vector's channels: `floats` floats and `ints` ints after them, 64-byte aligned (a vector).
static float* deepdsl_lanes_buffer(long floats, long ints) {
    const long bytes = (long)sizeof(float) * floats + (long)sizeof(int) * ints;
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

// ---------------------------------------------------------------------------------------------------------------
// The kernels: out (m, c, ho, wo) from x (m, c, h, w) and w (c, 1, kh, kw), the input gradient dx from the output
// gradient g, the filter gradient dw from g and x; threads take a sample's group of a vector's channels each (the
// filter gradient: a group of channels, every sample in order).

// The channels of the group starting at c0 (of c): a vector's, or fewer in the last group.
static inline int deepdsl_lanes_of(int c, int c0) {
    return c - c0 < DEEPDSL_DW_LANES ? c - c0 : DEEPDSL_DW_LANES;
}

// The forward (`backward` 0: `to` the output from the input `from`) or the input gradient (1: `to` the input gradient
// from the output gradient `from`) a vector's channels at a time, a sample's group of channels a task.
static void deepdsl_depthwise_lanes_run(const float* from, const float* w, const float* bias, int m, int c, int h,
                                        int wd, int kh, int kw, int ho, int wo, int stride, int pad, int backward,
                                        float* to) {
    const int groups = (c + DEEPDSL_DW_LANES - 1) / DEEPDSL_DW_LANES, taps = kh * kw;
    const long in = (long)h * wd, n = (long)ho * wo, read = backward ? n : in, written = backward ? in : n;
#pragma omp parallel if ((long)m * c * ho * wo * kh * kw >= DEEPDSL_PARALLEL_MIN)
    {
        float* X = deepdsl_lanes_buffer(DEEPDSL_DW_LANES * (read + written + taps + 1), 3L * wd);
        float *Y = X + DEEPDSL_DW_LANES * read, *F = Y + DEEPDSL_DW_LANES * written, *B = F + DEEPDSL_DW_LANES * taps;
        int* columns = (int*)(B + DEEPDSL_DW_LANES);
#pragma omp for collapse(2) schedule(static)
        for (int s = 0; s < m; ++s)
            for (int group = 0; group < groups; ++group) {
                const int c0 = group * DEEPDSL_DW_LANES, lanes = deepdsl_lanes_of(c, c0);
                deepdsl_lanes_filters(w + (long)c0 * taps, bias ? bias + c0 : NULL, taps, lanes, F, B);
                deepdsl_lanes_in(from + ((long)s * c + c0) * read, read, lanes, read, X);
                if (backward) deepdsl_lanes_conv_bwd_data(X, F, h, wd, kh, kw, ho, wo, stride, pad, columns, Y);
                else deepdsl_lanes_conv(X, F, bias ? B : NULL, h, wd, kh, kw, ho, wo, stride, pad, Y);
                deepdsl_lanes_out(Y, written, lanes, written, to + ((long)s * c + c0) * written);
            }
        free(X);
    }
}

void deepdsl_depthwise(const float* x, const float* w, const float* bias, int m, int c, int h, int wd, int kh,
                       int kw, int ho, int wo, int stride, int pad, float* out) {
    if (deepdsl_depthwise_lanes(c, h, wd, kh, kw, ho, wo, stride, pad))
        deepdsl_depthwise_lanes_run(x, w, bias, m, c, h, wd, kh, kw, ho, wo, stride, pad, 0, out);
    else
        deepdsl_depthwise_planes(x, w, bias, m, c, h, wd, kh, kw, ho, wo, stride, pad, out);
}

void deepdsl_depthwise_bwd_data(const float* g, const float* w, int m, int c, int h, int wd, int kh, int kw, int ho,
                                int wo, int stride, int pad, float* dx) {
    if (deepdsl_depthwise_lanes(c, h, wd, kh, kw, ho, wo, stride, pad))
        deepdsl_depthwise_lanes_run(g, w, NULL, m, c, h, wd, kh, kw, ho, wo, stride, pad, 1, dx);
    else
        deepdsl_depthwise_bwd_data_planes(g, w, m, c, h, wd, kh, kw, ho, wo, stride, pad, dx);
}

void deepdsl_depthwise_bwd_filter(const float* g, const float* x, int m, int c, int h, int wd, int kh, int kw, int ho,
                                  int wo, int stride, int pad, float* dw) {
    if (!deepdsl_depthwise_lanes(c, h, wd, kh, kw, ho, wo, stride, pad)) {
        deepdsl_depthwise_bwd_filter_planes(g, x, m, c, h, wd, kh, kw, ho, wo, stride, pad, dw);
        return;
    }
    const int groups = (c + DEEPDSL_DW_LANES - 1) / DEEPDSL_DW_LANES, taps = kh * kw;
    const long in = (long)h * wd, n = (long)ho * wo;
#pragma omp parallel if ((long)m * c * ho * wo * kh * kw >= DEEPDSL_PARALLEL_MIN)
    {
        float* G = deepdsl_lanes_buffer(DEEPDSL_DW_LANES * (n + in + taps), 0);
        float *X = G + DEEPDSL_DW_LANES * n, *T = X + DEEPDSL_DW_LANES * in;
#pragma omp for schedule(static)
        for (int group = 0; group < groups; ++group) {
            const int c0 = group * DEEPDSL_DW_LANES, lanes = deepdsl_lanes_of(c, c0);
            memset(T, 0, sizeof(float) * DEEPDSL_DW_LANES * taps);
            for (int s = 0; s < m; ++s) {
                deepdsl_lanes_in(g + ((long)s * c + c0) * n, n, lanes, n, G);
                deepdsl_lanes_in(x + ((long)s * c + c0) * in, in, lanes, in, X);
                deepdsl_lanes_conv_bwd_filter(G, X, h, wd, kh, kw, ho, wo, stride, pad, T);
            }
            for (int l = 0; l < lanes; ++l)
                for (int t = 0; t < taps; ++t) dw[(long)(c0 + l) * taps + t] = T[t * DEEPDSL_DW_LANES + l];
        }
        free(G);
    }
}
