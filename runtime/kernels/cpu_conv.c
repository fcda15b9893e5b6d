// Direct convolution of thin layers, included by cpu_ops.c: stride 1 and few products per output (C*kh*kw small,
// as in a network's first layer on images of few channels, LeNet's conv1), where the im2col matrix would be kh*kw
// copies of the input and its products too narrow for a matrix-product library to run fast or on several threads.
// The convolution and its filter gradient straight from the input, no workspace (runtime/cpu/conv.py takes this
// path where `contract.direct_conv` says so). At the end: the filter gradients of thin pointwise convolutions
// straight from their operands (`contract.pointwise_filter`).
//
// Every output is summed by one thread in one fixed order, so results do not depend on the thread count: an output
// of the forward is the sum over the taps (c, i, j) in that order, then the bias (as numpy's product, then its
// bias); a filter-gradient element the sum over samples and output rows of eight interleaved partial sums over the
// columns, added up at the end (numpy's product sums in its own order: the two agree to float32 rounding). Taps
// outside the input (zero padding) add nothing: rows outside are skipped, and columns outside add a zero product
// (masked vectors, as the im2col matrix's zeros do) or are skipped (one at a time) -- the same for finite weights.
//
// Columns go eight at a time (24 where a row allows): where a vector's windows leave the input row, or its last
// columns leave the output row, its loads and stores are masked (AVX: masked-off lanes are neither read nor
// written); without AVX those columns go one at a time.

#define DEEPDSL_DIRECT_KW 8             /* the widest kernel (contract.DIRECT_CONV_WIDTH) */
#define DEEPDSL_CONV_BLOCK 4            /* output channels a forward pass computes together (one input load each) */

// acc + a * b, fused where the processor has fused multiply-adds (as the matrix-product library's sums are; the
// library is built with -ffp-contract=off, which the elementwise kernels need to round as numpy does)
#if defined(__FMA__)
#define DEEPDSL_FMA(acc, a, b) ((deepdsl_v8f)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(acc)))
#define DEEPDSL_FMAF(acc, a, b) fmaf(a, b, acc)
#else
#define DEEPDSL_FMA(acc, a, b) ((acc) + (a) * (b))
#define DEEPDSL_FMAF(acc, a, b) ((acc) + (a) * (b))
#endif
#define DEEPDSL_FMA_BY(acc, scalar, b) DEEPDSL_FMA(acc, ((deepdsl_v8f){0} + (scalar)), b)

// Columns [q, q + 8 * NV) of row p of B output channels: NV vectors of eight sums per channel in registers, each
// input vector loaded once for the B channels, each weight once for the NV vectors. MASKED: some windows leave the
// input row or some columns the output row (masked loads and stores); else all lie inside. B, NV, KW and MASKED
// are constants where this is inlined (the loops unroll, the sums stay in registers).
static inline __attribute__((always_inline)) void deepdsl_direct_vectors(
        const float* x, const float* w, long w_stride, const float* bias, int B, int NV, int MASKED, int c, int h,
        int wd, int kh, int KW, int wo, int pad, int p, int q, int i0, int i1, float* out, long out_stride) {
    deepdsl_v8f acc[DEEPDSL_CONV_BLOCK][3] = {{{0}}};
    for (int ch = 0; ch < c; ++ch)
        for (int i = i0; i < i1; ++i) {
            const float* row = x + ((long)ch * h + p + i - pad) * wd + q - pad;
            const float* taps = w + ((long)ch * kh + i) * KW;
            #pragma GCC unroll 8
            for (int j = 0; j < KW; ++j) {
                deepdsl_v8f v[3];
                #pragma GCC unroll 3
                for (int k = 0; k < NV; ++k) {
#if DEEPDSL_MASKED
                    if (MASKED) {
                        const int first = q + 8 * k + j - pad;
                        v[k] = deepdsl_load(row + j + 8 * k, deepdsl_inside(first, wd) & deepdsl_inside(q + 8 * k, wo));
                        continue;
                    }
#endif
                    memcpy(&v[k], row + j + 8 * k, sizeof v[k]);
                    DEEPDSL_IN_REGISTER(v[k]);
                }
                #pragma GCC unroll 8
                for (int b = 0; b < B; ++b) {
                    const float tap = taps[b * w_stride + j];
                    #pragma GCC unroll 3
                    for (int k = 0; k < NV; ++k) acc[b][k] = DEEPDSL_FMA_BY(acc[b][k], tap, v[k]);
                }
            }
        }
    #pragma GCC unroll 8
    for (int b = 0; b < B; ++b)
        #pragma GCC unroll 3
        for (int k = 0; k < NV; ++k) {
            if (bias) acc[b][k] += bias[b];
            float* to = out + b * out_stride + (long)p * wo + q + 8 * k;
#if DEEPDSL_MASKED
            if (MASKED) {
                deepdsl_store(to, deepdsl_inside(q + 8 * k, wo), acc[b][k]);
                continue;
            }
#endif
            memcpy(to, &acc[b][k], sizeof acc[b][k]);
        }
}

// Output column q of row p of B output channels, one tap at a time (those outside the input add nothing).
static inline __attribute__((always_inline)) void deepdsl_direct_column(
        const float* x, const float* w, long w_stride, const float* bias, int B, int c, int h, int wd, int kh,
        int KW, int wo, int pad, int p, int q, int i0, int i1, float* out, long out_stride) {
    float acc[DEEPDSL_CONV_BLOCK] = {0};
    for (int ch = 0; ch < c; ++ch)
        for (int i = i0; i < i1; ++i) {
            const float* row = x + ((long)ch * h + p + i - pad) * wd;
            const float* taps = w + ((long)ch * kh + i) * KW;
            for (int j = 0; j < KW; ++j) {
                const int col = q + j - pad;
                if (col < 0 || col >= wd) continue;
                for (int b = 0; b < B; ++b) acc[b] = DEEPDSL_FMAF(acc[b], taps[b * w_stride + j], row[col]);
            }
        }
    for (int b = 0; b < B; ++b) out[b * out_stride + (long)p * wo + q] = bias ? acc[b] + bias[b] : acc[b];
}

// Whether the windows of columns [q, q + n) lie inside the input row and the columns inside the output row.
static inline __attribute__((always_inline)) int deepdsl_direct_inside(int q, int n, int KW, int wd, int wo,
                                                                        int pad) {
    return q - pad >= 0 && q + n - 1 + KW - 1 - pad < wd && q + n <= wo;
}

// Output row p of B output channels: out_b[q] = sum over (c, i, j) of w_b[c][i][j] * x[c][p + i - pad][q + j - pad]
// over the rows inside the input, then + bias_b; 24 columns at a time where their windows lie inside the input row,
// else 8 (masked where they do not), or one at a time without masked loads.
static inline __attribute__((always_inline)) void deepdsl_direct_row(
        const float* x, const float* w, long w_stride, const float* bias, int B, int c, int h, int wd, int kh,
        int KW, int wo, int pad, int p, float* out, long out_stride) {
    const int i0 = pad - p > 0 ? pad - p : 0, i1 = h + pad - p < kh ? h + pad - p : kh;
    for (int q = 0; q < wo;) {
        if (deepdsl_direct_inside(q, 24, KW, wd, wo, pad)) {
            deepdsl_direct_vectors(x, w, w_stride, bias, B, 3, 0, c, h, wd, kh, KW, wo, pad, p, q, i0, i1, out,
                                   out_stride);
            q += 24;
        } else if (deepdsl_direct_inside(q, 8, KW, wd, wo, pad)) {
            deepdsl_direct_vectors(x, w, w_stride, bias, B, 1, 0, c, h, wd, kh, KW, wo, pad, p, q, i0, i1, out,
                                   out_stride);
            q += 8;
        } else if (DEEPDSL_MASKED) {
            deepdsl_direct_vectors(x, w, w_stride, bias, B, 1, 1, c, h, wd, kh, KW, wo, pad, p, q, i0, i1, out,
                                   out_stride);
            q += 8;
        } else {
            deepdsl_direct_column(x, w, w_stride, bias, B, c, h, wd, kh, KW, wo, pad, p, q, i0, i1, out, out_stride);
            q += 1;
        }
    }
}

// The planes of output channels [o0, o0 + B) of one sample.
static inline __attribute__((always_inline)) void deepdsl_direct_planes(
        const float* x, const float* w, const float* bias, int o0, int B, int c, int h, int wd, int kh, int KW,
        int ho, int wo, int pad, float* out) {
    const long w_stride = (long)c * kh * KW;
    for (int p = 0; p < ho; ++p)
        deepdsl_direct_row(x, w + o0 * w_stride, w_stride, bias ? bias + o0 : 0, B, c, h, wd, kh, KW, wo, pad, p,
                           out + (long)o0 * ho * wo, (long)ho * wo);
}

// deepdsl_direct_planes with the kernel width a constant for the common widths
#define DEEPDSL_DIRECT_PLANES(O0, B) \
    switch (kw) { \
    case 3: deepdsl_direct_planes(xs, w, bias, O0, B, c, h, wd, kh, 3, ho, wo, pad, os); break; \
    case 5: deepdsl_direct_planes(xs, w, bias, O0, B, c, h, wd, kh, 5, ho, wo, pad, os); break; \
    default: deepdsl_direct_planes(xs, w, bias, O0, B, c, h, wd, kh, kw, ho, wo, pad, os); \
    }

// out (m, o, ho, wo) = x (m, c, h, w) convolved with w (o, c, kh, kw), stride 1, zero padding `pad`, + bias (o) when
// given. A thread computes whole output planes, DEEPDSL_CONV_BLOCK channels of one sample at a time.
void deepdsl_direct_conv(const float* x, const float* w, const float* bias, int m, int c, int h, int wd, int o,
                         int kh, int kw, int ho, int wo, int pad, float* out) {
    const int blocks = (o + DEEPDSL_CONV_BLOCK - 1) / DEEPDSL_CONV_BLOCK;
#pragma omp parallel for collapse(2) schedule(static) if ((long)m * o * ho * wo * c * kh * kw >= DEEPDSL_PARALLEL_MIN)
    for (int s = 0; s < m; ++s)
        for (int k = 0; k < blocks; ++k) {
            const int o0 = k * DEEPDSL_CONV_BLOCK, ob = o - o0 < DEEPDSL_CONV_BLOCK ? o - o0 : DEEPDSL_CONV_BLOCK;
            const float* xs = x + (long)s * c * h * wd;
            float* os = out + (long)s * o * ho * wo;
            if (ob == DEEPDSL_CONV_BLOCK) {
                DEEPDSL_DIRECT_PLANES(o0, DEEPDSL_CONV_BLOCK)
            } else {
                for (int oc = o0; oc < o0 + ob; ++oc) DEEPDSL_DIRECT_PLANES(oc, 1)
            }
        }
}

// sums[j] += the products of output-gradient columns [q, q + 8) of a row by the input columns their tap j read
// (`row` is the input row at column -pad), as eight partial sums; MASKED as in deepdsl_direct_vectors.
static inline __attribute__((always_inline)) void deepdsl_direct_filter_vector(
        const float* gr, const float* row, int q, int MASKED, int KW, int wd, int wo, int pad, deepdsl_v8f* sums) {
    deepdsl_v8f gv;
#if DEEPDSL_MASKED
    if (MASKED) gv = deepdsl_load(gr + q, deepdsl_inside(q, wo));
    else
#endif
        memcpy(&gv, gr + q, sizeof gv);
    #pragma GCC unroll 8
    for (int j = 0; j < KW; ++j) {
        deepdsl_v8f v;
#if DEEPDSL_MASKED
        if (MASKED) v = deepdsl_load(row + q + j, deepdsl_inside(q + j - pad, wd) & deepdsl_inside(q, wo));
        else
#endif
            memcpy(&v, row + q + j, sizeof v);
        sums[j] = DEEPDSL_FMA(sums[j], gv, v);
    }
}

#define DEEPDSL_FILTER_SAMPLES 8       /* samples whose gradient and input planes stay in cache for all kernel rows */

// dw[i][j] (one output channel o and input channel c) = sum over samples s, rows p and columns q of
// g[s][o][p][q] * x[s][c][p + i - pad][q + j - pad] over the positions inside the input: for each tap, eight
// partial sums over the columns q = 8k + l (and, without masked loads, one over those at the edges), added up at
// the end. Samples in blocks of DEEPDSL_FILTER_SAMPLES, each kernel row over the block with its kw partial sums in
// registers. KW as in deepdsl_direct_planes.
static inline __attribute__((always_inline)) void deepdsl_direct_filter_taps(
        const float* g, const float* x, long g_sample, long x_sample, int m, int h, int wd, int kh, int KW, int ho,
        int wo, int pad, float* dw) {
    deepdsl_v8f sums[kh * KW];
    float rest[kh * KW];
    for (int t = 0; t < kh * KW; ++t) {
        sums[t] = (deepdsl_v8f){0};
        rest[t] = 0.0f;
    }
    for (int s0 = 0; s0 < m; s0 += DEEPDSL_FILTER_SAMPLES) {
        const int s1 = s0 + DEEPDSL_FILTER_SAMPLES < m ? s0 + DEEPDSL_FILTER_SAMPLES : m;
        for (int i = 0; i < kh; ++i) {
            const int p0 = pad - i > 0 ? pad - i : 0, p1 = h + pad - i < ho ? h + pad - i : ho;
            deepdsl_v8f acc[DEEPDSL_DIRECT_KW] = {{0}};
            #pragma GCC unroll 8
            for (int j = 0; j < KW; ++j) acc[j] = sums[i * KW + j];
            for (int s = s0; s < s1; ++s)
                for (int p = p0; p < p1; ++p) {
                    const float* gr = g + s * g_sample + (long)p * wo;
                    const float* row = x + s * x_sample + (long)(p + i - pad) * wd - pad;
                    for (int q = 0; q < wo;) {
                        if (deepdsl_direct_inside(q, 8, KW, wd, wo, pad)) {
                            deepdsl_direct_filter_vector(gr, row, q, 0, KW, wd, wo, pad, acc);
                            q += 8;
                        } else if (DEEPDSL_MASKED) {
                            deepdsl_direct_filter_vector(gr, row, q, 1, KW, wd, wo, pad, acc);
                            q += 8;
                        } else {
                            for (int j = 0; j < KW; ++j)
                                if (q + j - pad >= 0 && q + j - pad < wd)
                                    rest[i * KW + j] = DEEPDSL_FMAF(rest[i * KW + j], gr[q], row[q + j]);
                            q += 1;
                        }
                    }
                }
            #pragma GCC unroll 8
            for (int j = 0; j < KW; ++j) sums[i * KW + j] = acc[j];
        }
    }
    for (int t = 0; t < kh * KW; ++t) {
        float total = 0.0f;
        for (int l = 0; l < 8; ++l) total += sums[t][l];
        dw[t] = total + rest[t];
    }
}

// dw (o, c, kh, kw) = the filter gradient of deepdsl_direct_conv from the output gradient g (m, o, ho, wo) and the
// input x (m, c, h, w); a thread computes whole (o, c) filters.
void deepdsl_direct_conv_bwd_filter(const float* g, const float* x, int m, int c, int h, int wd, int o, int kh, int kw,
                                    int ho, int wo, int pad, float* dw) {
#pragma omp parallel for collapse(2) schedule(static) if ((long)m * o * ho * wo * c * kh * kw >= DEEPDSL_PARALLEL_MIN)
    for (int oc = 0; oc < o; ++oc)
        for (int ch = 0; ch < c; ++ch) {
            const float* go = g + (long)oc * ho * wo;
            const float* xc = x + (long)ch * h * wd;
            const long g_sample = (long)o * ho * wo, x_sample = (long)c * h * wd;
            float* d = dw + ((long)oc * c + ch) * kh * kw;
            switch (kw) {
            case 3: deepdsl_direct_filter_taps(go, xc, g_sample, x_sample, m, h, wd, kh, 3, ho, wo, pad, d); break;
            case 5: deepdsl_direct_filter_taps(go, xc, g_sample, x_sample, m, h, wd, kh, 5, ho, wo, pad, d); break;
            default: deepdsl_direct_filter_taps(go, xc, g_sample, x_sample, m, h, wd, kh, kw, ho, wo, pad, d);
            }
        }
}

// ---------------------------------------------------------------------------------------------------------------
// Filter gradients of pointwise convolutions straight from the input (`contract.pointwise_filter`): dw (O, C) =
// sum over samples s of g[s] (O, P) x[s]^T (P, C), P = H*W positions, both operands read in place (no transposed
// copies) with the positions in the vectors' lanes. A tile of DEEPDSL_PW_O x DEEPDSL_PW_C filters keeps 16 lanes of
// sums each in registers over a chunk whose rows of all channels stay in the cache for every tile
// (DEEPDSL_PW_CACHE): as many whole samples as fit (small planes: a tile's lanes are added up once for them all), or
// a sample's positions in parts; each chunk's lanes are added up in a fixed order and the chunks' sums added to dw
// in order: the same bits on any number of threads, and with AVX2 (two registers of 8 lanes) as with AVX-512.

#if defined(__AVX512F__)
#define DEEPDSL_PW_O 4                  /* a tile's filters: 16 accumulators of 32 registers */
#define DEEPDSL_PW_C 4
#else
#define DEEPDSL_PW_O 3                  /* 3 x 2 pairs of 8 lanes: 12 accumulators of 16 registers */
#define DEEPDSL_PW_C 2
#endif
#define DEEPDSL_PW_CACHE (1L << 17)     /* floats of a chunk's rows (512 KB) */

// partial[i][j] = sum over samples s < samples, then positions k < n of g[s * g_sample + i * plane + k] *
// x[s * x_sample + j * plane + k] for i < TO, j < TC: 16 lanes of fused multiply-adds over all of them (a position
// in lane k mod 16 of its sample), then the lanes added up in a fixed order; a sample's last vector's positions past
// n read as zeros (masked loads, or zero-filled copies without AVX).
static inline __attribute__((always_inline)) void deepdsl_pointwise_tile(
        const float* g, const float* x, long plane, long g_sample, long x_sample, int samples, long n, int TO, int TC,
        float* partial) {
    const long full = n / 16 * 16, rest = n - full;
#if defined(__AVX512F__)
    const __mmask16 tail = (__mmask16)((1u << rest) - 1u);
    __m512 acc[DEEPDSL_PW_O][DEEPDSL_PW_C];
    for (int i = 0; i < TO; ++i)
        for (int j = 0; j < TC; ++j) acc[i][j] = _mm512_setzero_ps();
#define DEEPDSL_PW_STEP(LOAD)                                                                               \
    do {                                                                                                    \
        __m512 gv[DEEPDSL_PW_O], xv[DEEPDSL_PW_C];                                                          \
        _Pragma("GCC unroll 4") for (int i = 0; i < TO; ++i) {                                            \
            gv[i] = LOAD(gs + i * plane + k);                                                               \
            DEEPDSL_IN_REGISTER(gv[i]);                                                                     \
        }                                                                                                   \
        _Pragma("GCC unroll 4") for (int j = 0; j < TC; ++j) {                                            \
            xv[j] = LOAD(xs + j * plane + k);                                                               \
            DEEPDSL_IN_REGISTER(xv[j]);                                                                     \
        }                                                                                                   \
        _Pragma("GCC unroll 4") for (int i = 0; i < TO; ++i)                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < TC; ++j) acc[i][j] = _mm512_fmadd_ps(gv[i], xv[j], acc[i][j]); \
    } while (0)
#define DEEPDSL_PW_TAIL(p) _mm512_maskz_loadu_ps(tail, p)
    for (int s = 0; s < samples; ++s) {
        const float* gs = g + s * g_sample;
        const float* xs = x + s * x_sample;
        long k = 0;
        for (; k < full; k += 16) DEEPDSL_PW_STEP(_mm512_loadu_ps);
        if (rest) DEEPDSL_PW_STEP(DEEPDSL_PW_TAIL);
    }
#undef DEEPDSL_PW_STEP
#undef DEEPDSL_PW_TAIL
    for (int i = 0; i < TO; ++i)
        for (int j = 0; j < TC; ++j) {
            float lanes[16];
            _mm512_storeu_ps(lanes, acc[i][j]);
            partial[i * TC + j] = deepdsl_lanes16_sum(lanes);
        }
#else
    deepdsl_v8f lo[DEEPDSL_PW_O][DEEPDSL_PW_C], hi[DEEPDSL_PW_O][DEEPDSL_PW_C];
    for (int i = 0; i < TO; ++i)
        for (int j = 0; j < TC; ++j) lo[i][j] = hi[i][j] = (deepdsl_v8f){0};
    for (int s = 0; s < samples; ++s) {
        const float* gs = g + s * g_sample;
        const float* xs = x + s * x_sample;
        float gt[DEEPDSL_PW_O][16], xt[DEEPDSL_PW_C][16];
        if (rest) {
            for (int i = 0; i < TO; ++i) {
                memset(gt[i], 0, sizeof gt[i]);
                memcpy(gt[i], gs + i * plane + full, sizeof(float) * rest);
            }
            for (int j = 0; j < TC; ++j) {
                memset(xt[j], 0, sizeof xt[j]);
                memcpy(xt[j], xs + j * plane + full, sizeof(float) * rest);
            }
        }
        for (long k = 0; k <= full; k += 16) {
            const int last = k == full;
            if (last && !rest) break;
            // the lanes' first 8 positions, then their last 8: a half's rows of x and one row of g at a time in
            // registers beside the sums (3 x 2 filters: 12 sums, 2 + 1 rows)
            deepdsl_v8f xv[DEEPDSL_PW_C];
            #pragma GCC unroll 4
            for (int j = 0; j < TC; ++j) {
                memcpy(&xv[j], last ? xt[j] : xs + j * plane + k, sizeof xv[j]);
                DEEPDSL_IN_REGISTER(xv[j]);
            }
            #pragma GCC unroll 4
            for (int i = 0; i < TO; ++i) {
                deepdsl_v8f gv;
                memcpy(&gv, last ? gt[i] : gs + i * plane + k, sizeof gv);
                DEEPDSL_IN_REGISTER(gv);
                #pragma GCC unroll 4
                for (int j = 0; j < TC; ++j) lo[i][j] = DEEPDSL_FMA(lo[i][j], gv, xv[j]);
            }
            #pragma GCC unroll 4
            for (int j = 0; j < TC; ++j) {
                memcpy(&xv[j], (last ? xt[j] : xs + j * plane + k) + 8, sizeof xv[j]);
                DEEPDSL_IN_REGISTER(xv[j]);
            }
            #pragma GCC unroll 4
            for (int i = 0; i < TO; ++i) {
                deepdsl_v8f gv;
                memcpy(&gv, (last ? gt[i] : gs + i * plane + k) + 8, sizeof gv);
                DEEPDSL_IN_REGISTER(gv);
                #pragma GCC unroll 4
                for (int j = 0; j < TC; ++j) hi[i][j] = DEEPDSL_FMA(hi[i][j], gv, xv[j]);
            }
        }
    }
    for (int i = 0; i < TO; ++i)
        for (int j = 0; j < TC; ++j) {
            float lanes[16];
            memcpy(lanes, &lo[i][j], sizeof lo[i][j]);
            memcpy(lanes + 8, &hi[i][j], sizeof hi[i][j]);
            partial[i * TC + j] = deepdsl_lanes16_sum(lanes);
        }
#endif
}

// dw (o, c) = the filter gradient of a pointwise convolution from its output gradient g (m, o, P) and input
// x (m, c, P), in chunks whose rows of all channels fit DEEPDSL_PW_CACHE: as many whole samples as fit, or (where
// one does not) a sample's positions in whole vectors; per chunk the tiles on the kernels' threads, each tile's lanes
// summed over the whole chunk (few sums of lanes to add up: small planes' tiles cost little beside their products),
// and the chunks' sums added to dw in order. A sample whose rows pass the cap by less than half of it stays whole
// (DEEPDSL_PW_WHOLE): MobileNet-v2's 28 x 28 planes of 144 and 24 channels, 0.5 % past it, were cut into 768 and 16
// positions, each part's lanes added up for every tile (144 to 24 channels: 1.3x the time on a Zen 3).
#define DEEPDSL_PW_WHOLE (DEEPDSL_PW_CACHE + DEEPDSL_PW_CACHE / 2)
void deepdsl_pointwise_filter(const float* g, const float* x, int m, int o, int c, long plane, float* dw) {
    const long per_sample = (long)(o + c) * plane;
    const int samples = per_sample <= DEEPDSL_PW_CACHE ? (int)(DEEPDSL_PW_CACHE / per_sample) : 1;
    long width = per_sample <= DEEPDSL_PW_WHOLE ? plane : DEEPDSL_PW_CACHE / (o + c) / 16 * 16;
    if (width < 16) width = 16;
    const int to = (o + DEEPDSL_PW_O - 1) / DEEPDSL_PW_O, tc = (c + DEEPDSL_PW_C - 1) / DEEPDSL_PW_C;
#pragma omp parallel if ((long)o * c * m * plane >= DEEPDSL_PARALLEL_MIN)
    for (int s0 = 0; s0 < m; s0 += samples)
        for (long p0 = 0; p0 < plane; p0 += width) {
            const int count = m - s0 < samples ? m - s0 : samples;
            const long n = plane - p0 < width ? plane - p0 : width;
            const int first = s0 == 0 && p0 == 0;
#pragma omp for schedule(static)
            for (int t = 0; t < to * tc; ++t) {
                const int o0 = t / tc * DEEPDSL_PW_O, c0 = t % tc * DEEPDSL_PW_C;
                const int ro = o - o0 < DEEPDSL_PW_O ? o - o0 : DEEPDSL_PW_O;
                const int rc = c - c0 < DEEPDSL_PW_C ? c - c0 : DEEPDSL_PW_C;
                const float* gs = g + ((long)s0 * o + o0) * plane + p0;
                const float* xs = x + ((long)s0 * c + c0) * plane + p0;
                float partial[DEEPDSL_PW_O * DEEPDSL_PW_C];
                if (ro == DEEPDSL_PW_O && rc == DEEPDSL_PW_C)
                    deepdsl_pointwise_tile(gs, xs, plane, (long)o * plane, (long)c * plane, count, n, DEEPDSL_PW_O,
                                           DEEPDSL_PW_C, partial);
                else
                    deepdsl_pointwise_tile(gs, xs, plane, (long)o * plane, (long)c * plane, count, n, ro, rc,
                                           partial);
                for (int i = 0; i < ro; ++i)
                    for (int j = 0; j < rc; ++j) {
                        float* to_ = dw + (long)(o0 + i) * c + c0 + j;
                        *to_ = first ? partial[i * rc + j] : *to_ + partial[i * rc + j];
                    }
            }
        }
}
