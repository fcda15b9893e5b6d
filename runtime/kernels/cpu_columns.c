// The im2col matrix of a convolution and its adjoint, col2im, included by cpu_ops.c: the copies that lay out a
// convolution's windows as the rows of a matrix product (runtime/cpu/conv.py's im2col; cols[ch][i][j][s][p][q]),
// and the additions that bring the product's column gradients back to the input gradient, in numpy's order
// (_col2im_add, and the shifted sums of the stride-1 schemes). Stride 1 on small planes goes through a zero-padded
// copy of each plane (DEEPDSL_SMALL_PLANE), or with "same" padding on small planes as shifted planes
// (DEEPDSL_SHIFT_PLANE).

#if DEEPDSL_MASKED
// d[q] = row[2q] for q in [q0, q1) (a stride-2 window row; `avail` floats of the input row lie at row[0 ..]): two
// vectors of 8 read, their even lanes kept, 8 columns at a time; the vectors reaching past the row read masked.
static inline __attribute__((always_inline)) void deepdsl_gather_even(float* d, const float* row, int q0, int q1,
                                                                      int avail) {
    const deepdsl_v8i even = {0, 2, 4, 6, 8, 10, 12, 14};
    for (int q = q0; q < q1; q += 8) {
        deepdsl_v8f a, b;
        if (2 * q + 16 <= avail) {
            memcpy(&a, row + 2 * q, sizeof a);
            memcpy(&b, row + 2 * q + 8, sizeof b);
        } else {
            a = deepdsl_load(row + 2 * q, deepdsl_inside(2 * q, avail));
            b = deepdsl_load(row + 2 * q + 8, deepdsl_inside(2 * q + 8, avail));
        }
        const deepdsl_v8f v = __builtin_shuffle(a, b, even);
        if (q + 8 <= q1) memcpy(d + q, &v, sizeof v);
        else deepdsl_store(d + q, deepdsl_inside(q, q1), v);
    }
}
#endif

// One plane of the im2col matrix: plane[p][q] = src[i + stride*p - pad][j + stride*q - pad] (0 outside the h x w
// plane src), the rows of tap (i, j) of one channel and sample.
DEEPDSL_ROW void deepdsl_im2col_plane(const float* src, int h, int w, int ho, int wo, int i, int j, int stride,
                                      int pad, float* dst) {
    if (stride == 1 && pad == 0 && j == 0 && wo == w) {        /* every row inside and contiguous: one copy */
        memcpy(dst, src + (long)i * w, sizeof(float) * ho * wo);
        return;
    }
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
#if DEEPDSL_MASKED
        if (stride == 1) {          /* vectors of 8 columns, masked where the row or the padding ends inside one */
            int q = 0;
            for (; q + 8 <= wo; q += 8) {
                deepdsl_v8f v;
                if (q + j - pad >= 0 && q + j - pad + 8 <= w) memcpy(&v, row + q, sizeof v);
                else v = deepdsl_load(row + q, deepdsl_inside(q + j - pad, w));
                memcpy(d + q, &v, sizeof v);
            }
            if (q < wo) {
                const deepdsl_v8i columns = deepdsl_inside(q, wo);
                deepdsl_store(d + q, columns, deepdsl_load(row + q, deepdsl_inside(q + j - pad, w) & columns));
            }
            continue;
        }
#endif
        for (int q = 0; q < q0; ++q) d[q] = 0.0f;
        if (stride == 1) {
            deepdsl_copy_floats(d + q0, row + q0, q1 - q0);
#if DEEPDSL_MASKED
        } else if (stride == 2) {
            deepdsl_gather_even(d, row, q0, q1, w - (j - pad));
#endif
        } else {
            for (int q = q0; q < q1; ++q) d[q] = row[(long)stride * q];
        }
        for (int q = q1; q < wo; ++q) d[q] = 0.0f;
    }
}

#if DEEPDSL_MASKED
// Stride 1 on planes whose zero-padded copy holds at most DEEPDSL_SMALL_PLANE floats (an array of 8 KB on the
// stack, not workspace: its size is fixed): a channel of a sample is copied once into a zeroed padded plane (8
// floats of margin), whose every window row is then read by whole vectors of 8 without bounds tests. A row of 4 or 7
// floats (ResNet's last stages) otherwise costs more in tests and masks than in copying.
#define DEEPDSL_SMALL_PLANE 2048

// Whether an h x w plane padded by `pad` fits the stack array of the small-plane kernels.
static inline int deepdsl_small_plane(int h, int w, int pad) {
    return (long)(h + 2 * pad) * (w + 2 * pad) <= DEEPDSL_SMALL_PLANE;
}

// plane (hp x wp, zeroed, + 8 floats of margin) = src (h x w) with `pad` zeros around it
static inline __attribute__((always_inline)) void deepdsl_zero_padded(const float* src, int h, int w, int pad,
                                                                       int wp, float* plane, long size) {
    memset(plane, 0, sizeof(float) * (size + 8));
    for (int y = 0; y < h; ++y) deepdsl_copy_floats(plane + (long)(y + pad) * wp + pad, src + (long)y * w, w);
}

// dst (rows x width, contiguous) = the rows of `width` floats at src, src + step, ...: vectors of 8, read whole (src
// has 7 floats of margin after its last row), the last of a row written masked.
static inline __attribute__((always_inline)) void deepdsl_gather_rows(const float* src, long step, int rows,
                                                                      int width, float* dst) {
    for (int p = 0; p < rows; ++p) {
        const float* from = src + p * step;
        float* to = dst + (long)p * width;
        int q = 0;
        for (; q + 8 <= width; q += 8) memcpy(to + q, from + q, sizeof(deepdsl_v8f));
        if (q < width) {
            deepdsl_v8f v;
            memcpy(&v, from + q, sizeof v);
            deepdsl_store(to + q, deepdsl_inside(q, width), v);
        }
    }
}

// The kh*kw planes of the im2col matrix of one channel of one sample, stride 1 (tap (i, j) at dst + (i*kw + j) *
// tap_stride): window rows of the padded plane.
DEEPDSL_ROW void deepdsl_im2col_small(const float* src, int h, int w, int kh, int kw, int ho, int wo, int pad,
                                      long tap_stride, float* dst) {
    float plane[DEEPDSL_SMALL_PLANE + 8];
    const int wp = w + 2 * pad;
    deepdsl_zero_padded(src, h, w, pad, wp, plane, (long)(h + 2 * pad) * wp);
    for (int i = 0; i < kh; ++i)
        for (int j = 0; j < kw; ++j)
            deepdsl_gather_rows(plane + (long)i * wp + j, wp, ho, wo, dst + (long)(i * kw + j) * tap_stride);
}
#endif

#if DEEPDSL_MASKED
// Stride 1 with output planes the size of the input's ("same" padding, pad = (kh - 1) / 2 = (kw - 1) / 2) on planes
// of at most DEEPDSL_SHIFT_PLANE floats and kernels of at most DEEPDSL_SHIFT_TAPS taps: tap (i, j) of a plane is the
// plane itself shifted by (i - pad) * w + j - pad floats, zero where the window leaves the plane. Vectors of 8 run
// over the whole plane, rows and all, read masked (the lanes outside the plane or the window are not read): no row
// loop and no padded copy (on 4x4 and 7x7 planes the rows are shorter than a vector). The masks of each tap's
// vectors are computed once a call (`deepdsl_shift_masks`, on the stack: at most 25 x 33 vectors of 8 ints).
#define DEEPDSL_SHIFT_PLANE 256
#define DEEPDSL_SHIFT_TAPS 25
#define DEEPDSL_SHIFT_MASKS (DEEPDSL_SHIFT_TAPS * (DEEPDSL_SHIFT_PLANE / 8 + 1))

static inline int deepdsl_shifts(int h, int w, int kh, int kw, int ho, int wo, int stride, int pad) {
    return stride == 1 && ho == h && wo == w && 2 * pad == kh - 1 && 2 * pad == kw - 1 &&
           (long)h * w <= DEEPDSL_SHIFT_PLANE && kh * kw <= DEEPDSL_SHIFT_TAPS;
}

// masks[(i*kw + j) * vectors + v]: the lanes of positions t = 8v .. 8v + 7 (rows t / w, columns t % w) inside the
// h x w plane whose row plus `sign` * (i - pad) and column plus `sign` * (j - pad) lie in it too. sign 1: the
// positions of tap (i, j) whose input im2col reads; -1: those col2im adds tap (i, j)'s plane to.
static void deepdsl_shift_masks(int h, int w, int kh, int kw, int pad, int sign, deepdsl_v8i* masks) {
    const int hw = h * w, vectors = (hw + 7) / 8;
    for (int i = 0; i < kh; ++i)
        for (int j = 0; j < kw; ++j)
            for (int v = 0; v < vectors; ++v) {
                deepdsl_v8i lanes;
                for (int l = 0; l < 8; ++l) {
                    const int t = 8 * v + l, y = t / w + sign * (i - pad), x = t % w + sign * (j - pad);
                    lanes[l] = t < hw && y >= 0 && y < h && x >= 0 && x < w ? -1 : 0;
                }
                masks[(i * kw + j) * vectors + v] = lanes;
            }
}

// The kh*kw tap planes of one channel of one sample (tap (i, j) at dst + (i*kw + j) * tap_stride).
DEEPDSL_ROW void deepdsl_im2col_shifted(const float* src, int h, int w, int kh, int kw, int pad, long tap_stride,
                                        const deepdsl_v8i* masks, float* dst) {
    const int hw = h * w, vectors = (hw + 7) / 8;
    for (int i = 0; i < kh; ++i)
        for (int j = 0; j < kw; ++j) {
            const long shift = (long)(i - pad) * w + j - pad;
            const deepdsl_v8i* mask = masks + (i * kw + j) * vectors;
            float* to = dst + (long)(i * kw + j) * tap_stride;
            int v = 0;
            for (; 8 * v + 8 <= hw; ++v) {
                const deepdsl_v8f x = deepdsl_load(src + 8 * v + shift, mask[v]);
                memcpy(to + 8 * v, &x, sizeof x);
            }
            if (v < vectors)
                deepdsl_store(to + 8 * v, deepdsl_inside(8 * v, hw), deepdsl_load(src + 8 * v + shift, mask[v]));
        }
}

// Its adjoint, one input plane: o[t] = the sum over taps (i, j) in order of the tap plane at t - shift, where the
// window holds t (0 + each contribution, as deepdsl_col2im_plane adds them: a masked-off lane adds +0.0, which
// changes no sum that starts from +0.0).
DEEPDSL_ROW void deepdsl_col2im_shifted(const float* cols, long row_stride, int h, int w, int kh, int kw, int pad,
                                        const deepdsl_v8i* masks, float* o) {
    const int hw = h * w, vectors = (hw + 7) / 8;
    for (int v = 0; v < vectors; ++v) {
        deepdsl_v8f sum = {0};
        for (int i = 0; i < kh; ++i)
            for (int j = 0; j < kw; ++j) {
                const long shift = (long)(i - pad) * w + j - pad;
                sum += deepdsl_load(cols + (long)(i * kw + j) * row_stride + 8 * v - shift,
                                    masks[(i * kw + j) * vectors + v]);
            }
        if (8 * v + 8 <= hw) memcpy(o + 8 * v, &sum, sizeof sum);
        else deepdsl_store(o + 8 * v, deepdsl_inside(8 * v, hw), sum);
    }
}
#endif

// cols[ch][i][j][s][p][q] = x[s][ch][i + stride*p - pad][j + stride*q - pad], 0 outside x: the im2col matrix of m
// samples as (C*kh*kw, m*Ho*Wo) rows, the layout runtime/cpu/conv.py multiplies; on the kernels' threads where
// `parallel`, else on the calling one.
static void deepdsl_im2col_on(const float* x, int m, int c, int h, int w, int kh, int kw, int ho, int wo, int stride,
                              int pad, float* cols, int parallel) {
    const long rows = (long)c * kh * kw;
    const long plane = (long)ho * wo;
    parallel = parallel && rows * m * plane >= DEEPDSL_PARALLEL_MIN;
#if DEEPDSL_MASKED
    if (deepdsl_shifts(h, w, kh, kw, ho, wo, stride, pad) && !(kh == 1 && kw == 1)) {
        deepdsl_v8i masks[DEEPDSL_SHIFT_MASKS];
        deepdsl_shift_masks(h, w, kh, kw, pad, 1, masks);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
        for (int ch = 0; ch < c; ++ch)
            for (int s = 0; s < m; ++s)
                deepdsl_im2col_shifted(x + ((long)s * c + ch) * h * w, h, w, kh, kw, pad, m * plane, masks,
                                       cols + ((long)ch * kh * kw * m + s) * plane);
        return;
    }
    /* (a column kernel without padding copies each tap's plane at once, below) */
    if (stride == 1 && !(kw == 1 && pad == 0) && deepdsl_small_plane(h, w, pad)) {
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
        for (int ch = 0; ch < c; ++ch)
            for (int s = 0; s < m; ++s)
                deepdsl_im2col_small(x + ((long)s * c + ch) * h * w, h, w, kh, kw, ho, wo, pad, m * plane,
                                     cols + ((long)ch * kh * kw * m + s) * plane);
        return;
    }
#endif
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (long r = 0; r < rows; ++r) {
        for (int s = 0; s < m; ++s) {
            const int ch = (int)(r / ((long)kh * kw)), i = (int)((r / kw) % kh), j = (int)(r % kw);
            deepdsl_im2col_plane(x + ((long)s * c + ch) * h * w, h, w, ho, wo, i, j, stride, pad,
                                 cols + (r * m + s) * plane);
        }
    }
}

void deepdsl_im2col(const float* x, int m, int c, int h, int w, int kh, int kw, int ho, int wo, int stride,
                    int pad, float* cols) {
    deepdsl_im2col_on(x, m, c, h, w, kh, kw, ho, wo, stride, pad, cols, 1);
}

// The input gradient of a stride-1 convolution from its column gradients, gathered: out[s][ch][y][x] (m samples of
// ch < channels planes h x w) is the sum, in the order k = 0, 1, ..., of contribution k at position
// (y + pad) * wp + x + pad - offsets[k] of its row (ch, s), where that lies in [0, rows) -- what adding each
// contribution over a zeroed padded plane at its offset and cropping gives (runtime/cpu/conv.py), in one pass.
// Contribution k, row (ch, s) starts at contributions + k * k_stride + ch * c_stride + s * rows.
DEEPDSL_ROW void deepdsl_shifted_sums_plane(const float* base, long count, const long* offsets, long k_stride,
                                            long rows, long h, long w, long wp, long pad, float* o) {
    memset(o, 0, sizeof(float) * h * w);
    for (long k = 0; k < count; ++k) {            /* each element adds its contributions in the order k */
        const float* src = base + k * k_stride;
        for (long y = 0; y < h; ++y) {
            /* t = start + x for x < w, kept within [0, rows) */
            const long start = (y + pad) * wp + pad - offsets[k];
            const long x0 = start < 0 ? -start : 0;
            const long x1 = rows - start < w ? rows - start : w;
            float* row = o + y * w;
#pragma omp simd
            for (long x = x0; x < x1; ++x) row[x] += src[start + x];
        }
    }
}

void deepdsl_shifted_sums(const float* contributions, long count, const long* offsets, long k_stride,
                          long c_stride, long rows, long m, long channels, long h, long w, long wp, long pad,
                          float* out) {
#pragma omp parallel for collapse(2) schedule(static) if (m * channels * h * w * count >= DEEPDSL_PARALLEL_MIN)
    for (long s = 0; s < m; ++s)
        for (long ch = 0; ch < channels; ++ch)
            deepdsl_shifted_sums_plane(contributions + ch * c_stride + s * rows, count, offsets, k_stride, rows, h, w,
                                       wp, pad, out + (s * channels + ch) * h * w);
}

// One plane of col2im: o (h x w) = 0, then for each kernel offset (i, j) in order, o[stride*p - pad + i]
// [stride*q - pad + j] += cols[(i*kw + j) * row_stride + p*wo + q] over the positions inside the plane -- the
// additions of runtime/cpu/conv.py's _col2im_add, in its order.
DEEPDSL_ROW void deepdsl_col2im_plane(const float* cols, long row_stride, int h, int w, int kh, int kw, int ho,
                                      int wo, int stride, int pad, float* o) {
    memset(o, 0, sizeof(float) * h * w);
    for (int i = 0; i < kh; ++i) {
        int p0, p1;
        deepdsl_valid(i, h, ho, stride, pad, &p0, &p1);
        for (int j = 0; j < kw; ++j) {
            int q0, q1;
            deepdsl_valid(j, w, wo, stride, pad, &q0, &q1);
            const float* src = cols + (long)(i * kw + j) * row_stride;
            for (int p = p0; p < p1; ++p) {
                float* row = o + (long)(stride * p - pad + i) * w + j - pad;
                const float* from = src + (long)p * wo;
                if (stride == 1) deepdsl_add_floats(row + q0, from + q0, q1 - q0);
                else for (int q = q0; q < q1; ++q) row[(long)stride * q] += from[q];
            }
        }
    }
}

#if DEEPDSL_MASKED
// One plane of col2im with stride 1 on a small plane (DEEPDSL_SMALL_PLANE): the taps' rows added in the order of
// deepdsl_col2im_plane into a zeroed padded plane on the stack (vectors of 8, a row's last floats one by one: a
// masked vector there was slower, and so was deepdsl_add_floats's loop, 1.0-1.7x), then the plane cropped into o.
DEEPDSL_ROW void deepdsl_col2im_small(const float* cols, long row_stride, int h, int w, int kh, int kw, int ho,
                                      int wo, int pad, float* o) {
    float plane[DEEPDSL_SMALL_PLANE + 8];
    const int wp = w + 2 * pad;
    memset(plane, 0, sizeof(float) * ((long)(h + 2 * pad) * wp + 8));
    for (int i = 0; i < kh; ++i)
        for (int j = 0; j < kw; ++j) {
            const float* src = cols + (long)(i * kw + j) * row_stride;
            float* base = plane + (long)i * wp + j;
            for (int p = 0; p < ho; ++p) {
                const float* from = src + (long)p * wo;
                float* row = base + (long)p * wp;
                int q = 0;
                for (; q + 8 <= wo; q += 8) {
                    deepdsl_v8f v, sum;
                    memcpy(&v, from + q, sizeof v);
                    memcpy(&sum, row + q, sizeof sum);
                    sum += v;
                    memcpy(row + q, &sum, sizeof sum);
                }
                for (; q < wo; ++q) row[q] += from[q];
            }
        }
    deepdsl_gather_rows(plane + (long)pad * wp + pad, wp, h, w, o);
}
#endif

// out (m, channels, h, w) = col2im of the column gradients: element (s, ch, i, j, p, q) at cols + s * sample_stride
// + ((ch * kh + i) * kw + j) * row_stride + p * wo + q (a chunk's (C*kh*kw, m*Ho*Wo) product or per-sample ones);
// a thread owns whole planes (on the calling thread alone where not `parallel`).
static void deepdsl_col2im_on(const float* cols, long sample_stride, long row_stride, long m, long channels, int h,
                              int w, int kh, int kw, int ho, int wo, int stride, int pad, float* out, int parallel) {
#if DEEPDSL_MASKED
    const int shifted = deepdsl_shifts(h, w, kh, kw, ho, wo, stride, pad);
    const int small = stride == 1 && deepdsl_small_plane(h, w, pad);
    deepdsl_v8i masks[DEEPDSL_SHIFT_MASKS];
    if (shifted) deepdsl_shift_masks(h, w, kh, kw, pad, -1, masks);
#endif
#pragma omp parallel for collapse(2) schedule(static) if (parallel && m * channels * h * w * kh >= DEEPDSL_PARALLEL_MIN)
    for (long s = 0; s < m; ++s)
        for (long ch = 0; ch < channels; ++ch) {
            const float* planes = cols + s * sample_stride + ch * kh * kw * row_stride;
            float* o = out + (s * channels + ch) * h * w;
#if DEEPDSL_MASKED
            if (shifted) {
                deepdsl_col2im_shifted(planes, row_stride, h, w, kh, kw, pad, masks, o);
                continue;
            }
            if (small) {
                deepdsl_col2im_small(planes, row_stride, h, w, kh, kw, ho, wo, pad, o);
                continue;
            }
#endif
            deepdsl_col2im_plane(planes, row_stride, h, w, kh, kw, ho, wo, stride, pad, o);
        }
}

void deepdsl_col2im(const float* cols, long sample_stride, long row_stride, long m, long channels, int h, int w,
                    int kh, int kw, int ho, int wo, int stride, int pad, float* out) {
    deepdsl_col2im_on(cols, sample_stride, row_stride, m, channels, h, w, kh, kw, ho, wo, stride, pad, out, 1);
}
