// Direct convolutions on channel-blocked data, included by cpu_ops.c: stride 1 convolutions of many channels (a
// residual network's 3x3 layers), whose im2col matrix would be kh*kw copies of the input. runtime/cpu/conv.py takes
// this path where `contract.blocked_conv` says so and the planned workspace holds the blocked copies
// (`contract.blocked_scratch`). Processors without AVX2 and fused multiply-adds have none of these kernels
// (`deepdsl_blocked_kernels` returns 0) and keep im2col.
//
// The blocked layout keeps 16 consecutive channels of one position together: a (C, H, W) sample is stored as
// (C/16, H, W, 16) (channels past C are zeros), so that 16 channels are one vector (one AVX-512 register, two AVX2
// ones) and the 16 channels of a position one cache line. The input is copied into that layout with its zero
// padding around it (`deepdsl_blocked_input`), the filters into (O/16, C/16, kh, kw, 16 inputs, 16 outputs)
// (`deepdsl_blocked_filters`), and the convolution then runs without bounds checks (the method of Georganas et al.,
// "Anatomy of high-performance deep learning convolutions on SIMD architectures", SC18): a tile of up to
// DEEPDSL_TILE output positions of one row and up to three blocks of 16 output channels keeps its sums in registers,
// and each input channel of each tap is one broadcast, one filter vector per block and one fused multiply-add per
// position and block; the tile is written to the plain (N, O, Ho, Wo) output through a small transposition.
//
// The input gradient is the same convolution of the output gradient (padded by k - 1 - pad) with the filters
// turned around and transposed. The filter gradient of (16 x 16 channels, tap) blocks sums over the samples and
// positions with its sums in registers: AVX-512 eight input channels of up to three output blocks (24 sums) at a
// time, AVX2 six input channels of one block (96 sums).
//
// Every output is the sum of its products in one fixed order: over input channels, kernel rows, kernel columns
// (forward: c, i, j; input gradient: o, i, j), or over samples, rows and columns (filter gradient), in partial sums
// of fused multiply-adds from zero of at most DEEPDSL_SUM_TERMS products (a block of channels, or rows of a sample)
// added up in order, then + bias. Threads split outputs (shares weighted by the output blocks of each item of
// work), never a sum, so results do not depend on the thread count; and each lane of a vector sums alone, so AVX-512
// and AVX2 give the same bits, whatever the tiles' shapes.

#define DEEPDSL_BLOCK 16                /* channels of a block (contract.CHANNEL_BLOCK) */
#if defined(__AVX512F__)
#define DEEPDSL_LANES 16                /* floats of a vector (contract.WIDE_FILTER_ROW) */
#define DEEPDSL_TILE 14                 /* output positions of a tile at most */
#define DEEPDSL_TILE_SUMS 28            /* its sums of 16 channels, in 28 of the 32 vector registers */
#elif defined(__AVX2__) && defined(__FMA__)
#define DEEPDSL_LANES 8
#define DEEPDSL_TILE 6
#define DEEPDSL_TILE_SUMS 6             /* 12 of 16 registers (each 16 channels is two) */
#endif

#ifdef DEEPDSL_TILE
#define DEEPDSL_BLOCKED DEEPDSL_LANES

// The tiles' shapes (OB output blocks, R positions; OB * R <= DEEPDSL_TILE_SUMS) that `deepdsl_tile_blocks` uses,
// as switch arms: constants in each, so the tile's loops unroll.
#if DEEPDSL_TILE == 14
#define DEEPDSL_TILES_OF(X, OB) X(OB, 1) X(OB, 2) X(OB, 3) X(OB, 4) X(OB, 5) X(OB, 6) X(OB, 7)
#define DEEPDSL_TILES(X) DEEPDSL_TILES_OF(X, 1) X(1, 8) X(1, 9) X(1, 10) X(1, 11) X(1, 12) X(1, 13) X(1, 14) \
    DEEPDSL_TILES_OF(X, 2) X(2, 8) X(2, 9) X(2, 10) X(2, 11) X(2, 12) X(2, 13) X(2, 14) DEEPDSL_TILES_OF(X, 3) \
    X(3, 8) X(3, 9)
#else
#define DEEPDSL_TILES(X) X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(1, 5) X(1, 6)
#endif

// out (OB blocks x R positions x 16 channels) = (`add`: out +) the sum over channel blocks c < cb, kernel rows i,
// columns j and channels k of the block of x[c][i][j + position][k] * w_b[c][i][j][k][:], x pointing at the tile's
// first input position in block 0 (its blocks `x_block` floats apart, rows `x_row` apart), w at the first output
// block's filters (the next ones `w_block` floats apart). The OB output blocks share each input broadcast.
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void deepdsl_blocked_tile(
        const float* x, const float* w, long w_block, int cb, int kh, int kw, long x_block, long x_row, int OB, int R,
        int add, float* out) {
    __m512 acc[3][DEEPDSL_TILE];
    #pragma GCC unroll 3
    for (int b = 0; b < OB; ++b)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
    for (int c = 0; c < cb; ++c)
        for (int i = 0; i < kh; ++i)
            for (int j = 0; j < kw; ++j) {
                const float* xr = x + c * x_block + i * x_row + j * DEEPDSL_BLOCK;
                const float* wt = w + ((long)(c * kh + i) * kw + j) * DEEPDSL_BLOCK * DEEPDSL_BLOCK;
                for (int k = 0; k < DEEPDSL_BLOCK; ++k) {
                    __m512 wv[3];
                    #pragma GCC unroll 3
                    for (int b = 0; b < OB; ++b) wv[b] = _mm512_loadu_ps(wt + b * w_block + k * DEEPDSL_BLOCK);
                    #pragma GCC unroll 16
                    for (int r = 0; r < R; ++r) {
                        const __m512 v = _mm512_set1_ps(xr[r * DEEPDSL_BLOCK + k]);
                        #pragma GCC unroll 3
                        for (int b = 0; b < OB; ++b) acc[b][r] = _mm512_fmadd_ps(v, wv[b], acc[b][r]);
                    }
                }
            }
    #pragma GCC unroll 3
    for (int b = 0; b < OB; ++b)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            float* to = out + (b * R + r) * DEEPDSL_BLOCK;
            _mm512_storeu_ps(to, add ? _mm512_add_ps(_mm512_loadu_ps(to), acc[b][r]) : acc[b][r]);
        }
}
#else
static inline __attribute__((always_inline)) void deepdsl_blocked_tile(
        const float* x, const float* w, long w_block, int cb, int kh, int kw, long x_block, long x_row, int OB, int R,
        int add, float* out) {
    __m256 lo[3][DEEPDSL_TILE], hi[3][DEEPDSL_TILE];
    #pragma GCC unroll 3
    for (int b = 0; b < OB; ++b)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) lo[b][r] = hi[b][r] = _mm256_setzero_ps();
    for (int c = 0; c < cb; ++c)
        for (int i = 0; i < kh; ++i)
            for (int j = 0; j < kw; ++j) {
                const float* xr = x + c * x_block + i * x_row + j * DEEPDSL_BLOCK;
                const float* wt = w + ((long)(c * kh + i) * kw + j) * DEEPDSL_BLOCK * DEEPDSL_BLOCK;
                for (int k = 0; k < DEEPDSL_BLOCK; ++k) {
                    __m256 w0[3], w1[3];
                    #pragma GCC unroll 3
                    for (int b = 0; b < OB; ++b) {
                        w0[b] = _mm256_loadu_ps(wt + b * w_block + k * DEEPDSL_BLOCK);
                        w1[b] = _mm256_loadu_ps(wt + b * w_block + k * DEEPDSL_BLOCK + 8);
                    }
                    #pragma GCC unroll 16
                    for (int r = 0; r < R; ++r) {
                        const __m256 v = _mm256_broadcast_ss(xr + r * DEEPDSL_BLOCK + k);
                        #pragma GCC unroll 3
                        for (int b = 0; b < OB; ++b) {
                            lo[b][r] = _mm256_fmadd_ps(v, w0[b], lo[b][r]);
                            hi[b][r] = _mm256_fmadd_ps(v, w1[b], hi[b][r]);
                        }
                    }
                }
            }
    #pragma GCC unroll 3
    for (int b = 0; b < OB; ++b)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            float* to = out + (b * R + r) * DEEPDSL_BLOCK;
            _mm256_storeu_ps(to, add ? _mm256_add_ps(_mm256_loadu_ps(to), lo[b][r]) : lo[b][r]);
            _mm256_storeu_ps(to + 8, add ? _mm256_add_ps(_mm256_loadu_ps(to + 8), hi[b][r]) : hi[b][r]);
        }
}
#endif

#define DEEPDSL_SUM_TERMS 256   /* products a partial sum adds at most before it is added to the output's total */

// A tile of OB output blocks by r positions (OB * r <= DEEPDSL_TILE_SUMS), constants in each arm, over `count`
// channel blocks: one partial sum, into `out` or (`add`) added to it.
static inline void deepdsl_blocked_tile_pass(const float* x, const float* w, long w_block, int count, int kh, int kw,
                                             long x_block, long x_row, int ob, int r, int add, float* out) {
    switch (ob * 64 + r) {
#define DEEPDSL_TILE_CASE(OB, R) \
    case OB * 64 + R: deepdsl_blocked_tile(x, w, w_block, count, kh, kw, x_block, x_row, OB, R, add, out); break;
    DEEPDSL_TILES(DEEPDSL_TILE_CASE)
#undef DEEPDSL_TILE_CASE
    }
}

// The channel blocks a partial sum adds: as many whole blocks as DEEPDSL_SUM_TERMS products allow, one at least.
static inline int deepdsl_sum_blocks(int kh, int kw) {
    const int per_block = kh * kw * DEEPDSL_BLOCK;
    return per_block >= DEEPDSL_SUM_TERMS ? 1 : DEEPDSL_SUM_TERMS / per_block;
}

// The same tile over all cb channel blocks: a partial sum over each group of channel blocks of at most
// DEEPDSL_SUM_TERMS products (one block at least), the partial sums added up in order (as a matrix product's blocks
// of its inner dimension are: far less rounding than one long sum).
static inline void deepdsl_blocked_tile_of(const float* x, const float* w, long w_block, int cb, int kh, int kw,
                                           long x_block, long x_row, int ob, int r, float* out) {
    const int group = deepdsl_sum_blocks(kh, kw);
    for (int c0 = 0; c0 < cb; c0 += group)
        deepdsl_blocked_tile_pass(x + c0 * x_block, w + (long)c0 * kh * kw * DEEPDSL_BLOCK * DEEPDSL_BLOCK, w_block,
                                  cb - c0 < group ? cb - c0 : group, kh, kw, x_block, x_row, ob, r, c0 > 0, out);
}

// The output blocks a tile of `positions` positions sums together: with AVX-512 three up to 9 positions, else two
// (each broadcast input serves as many blocks, and each loaded filter vector as many positions: fewer loads for
// each fused multiply-add), else one (the shapes instantiated in DEEPDSL_TILES; each instance adds to the library's
// build time).
static inline int deepdsl_tile_blocks(int positions) {
    return DEEPDSL_TILE == 14 ? (positions <= 9 ? 3 : 2) : 1;
}

// to[q][k] = from[k * stride + q] for q < w, k < 16: a row of 16 channels (zeros past `channels`) blocked, 16
// positions at a time through a 16 x 16 tile on the stack.
DEEPDSL_ROW void deepdsl_block_row(const float* from, long stride, int channels, int w, float* to) {
    int q = 0;
    if (channels >= DEEPDSL_BLOCK)
        for (; q + DEEPDSL_BLOCK <= w; q += DEEPDSL_BLOCK) {
            float t[DEEPDSL_BLOCK][DEEPDSL_BLOCK];
            for (int k = 0; k < DEEPDSL_BLOCK; ++k) memcpy(t[k], from + k * stride + q, sizeof t[k]);
            for (int r = 0; r < DEEPDSL_BLOCK; ++r)
#pragma omp simd
                for (int k = 0; k < DEEPDSL_BLOCK; ++k) to[(q + r) * DEEPDSL_BLOCK + k] = t[k][r];
        }
    for (; q < w; ++q)
        for (int k = 0; k < DEEPDSL_BLOCK; ++k) to[q * DEEPDSL_BLOCK + k] = k < channels ? from[k * stride + q] : 0.0f;
}

// xb (m, ceil(c / 16), h + 2 ph, w + 2 pw, 16) = x (m, c, h, w) with ph zero rows above and below, pw zero columns
// left and right, and zero channels past c. A thread copies whole rows of blocks.
void deepdsl_blocked_input(const float* x, int m, int c, int h, int w, int ph, int pw, float* xb) {
    const int cb = (c + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK, hp = h + 2 * ph, wp = w + 2 * pw;
    const long row = (long)wp * DEEPDSL_BLOCK;
#pragma omp parallel for collapse(2) schedule(static) if ((long)m * cb * hp * row >= DEEPDSL_EW_PARALLEL_MIN)
    for (long sb = 0; sb < (long)m * cb; ++sb)
        for (int p = 0; p < hp; ++p) {
            float* to = xb + (sb * hp + p) * row;
            const int s = (int)(sb / cb), c0 = (int)(sb % cb) * DEEPDSL_BLOCK;
            const int inside = p >= ph && p < ph + h;
            memset(to, 0, sizeof(float) * pw * DEEPDSL_BLOCK);
            memset(to + (long)(pw + w) * DEEPDSL_BLOCK, 0, sizeof(float) * pw * DEEPDSL_BLOCK);
            if (!inside) {
                memset(to + (long)pw * DEEPDSL_BLOCK, 0, sizeof(float) * w * DEEPDSL_BLOCK);
                continue;
            }
            deepdsl_block_row(x + (((long)s * c + c0) * h + p - ph) * w, (long)h * w, c - c0, w,
                              to + (long)pw * DEEPDSL_BLOCK);
        }
}

// The filters w (o, c, kh, kw) as a convolution's blocked filters: wb (ceil(o / 16), ceil(c / 16), kh, kw, 16 input
// channels, 16 output channels), zeros past o and c. `flip`: the filters of the input gradient, the convolution of
// the output gradient: inputs and outputs exchanged and the kernel turned around, wb (ceil(c / 16), ceil(o / 16), kh,
// kw, 16 output channels of w, 16 input channels of w) with wb[..][i][j] from w[..][kh - 1 - i][kw - 1 - j].
void deepdsl_blocked_filters(const float* w, int o, int c, int kh, int kw, int flip, float* wb) {
    const int to = flip ? c : o, from = flip ? o : c;
    const int tb = (to + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK, fb = (from + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK;
    const long taps = (long)kh * kw;
#pragma omp parallel for collapse(2) schedule(static) if ((long)tb * fb * taps * 256 >= DEEPDSL_EW_PARALLEL_MIN)
    for (int a = 0; a < tb; ++a)
        for (int b = 0; b < fb; ++b) {
            float* blocks = wb + ((long)a * fb + b) * taps * DEEPDSL_BLOCK * DEEPDSL_BLOCK;
            const int ks = from - b * DEEPDSL_BLOCK < DEEPDSL_BLOCK ? from - b * DEEPDSL_BLOCK : DEEPDSL_BLOCK;
            const int ls = to - a * DEEPDSL_BLOCK < DEEPDSL_BLOCK ? to - a * DEEPDSL_BLOCK : DEEPDSL_BLOCK;
            if (ks < DEEPDSL_BLOCK || ls < DEEPDSL_BLOCK)
                memset(blocks, 0, sizeof(float) * taps * DEEPDSL_BLOCK * DEEPDSL_BLOCK);
            // the convolution's input channel b * 16 + k and output channel a * 16 + l, reading w in its order
            if (flip)
                for (int k = 0; k < ks; ++k)
                    for (int l = 0; l < ls; ++l) {
                        const float* in = w + ((long)(b * DEEPDSL_BLOCK + k) * c + a * DEEPDSL_BLOCK + l) * taps;
                        for (long t = 0; t < taps; ++t)
                            blocks[(t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l] = in[taps - 1 - t];
                    }
            else
                for (int l = 0; l < ls; ++l)
                    for (int k = 0; k < ks; ++k) {
                        const float* in = w + ((long)(a * DEEPDSL_BLOCK + l) * c + b * DEEPDSL_BLOCK + k) * taps;
                        for (long t = 0; t < taps; ++t) blocks[(t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l] = in[t];
                    }
        }
}

// Output blocks in groups: `ob` blocks in `groups` groups of as equal sizes as can be (the first ob % groups of
// them one block larger), each group `per` items (rows, or taps of input blocks) whose cost is the group's blocks.
static inline int deepdsl_group_start(int group, int ob, int groups) {
    const int size = ob / groups, larger = ob % groups;
    return group * size + (group < larger ? group : larger);
}

// The first item whose cost so far is `cost` at least.
static inline long deepdsl_group_item(long cost, long per, int ob, int groups) {
    const long size = ob / groups, larger = ob % groups, first = larger * (size + 1) * per;
    if (cost < first)
        return cost / ((size + 1) * per) * per + (cost % ((size + 1) * per) + size) / (size + 1);
    cost -= first;
    return (larger + cost / (size * per)) * per + (cost % (size * per) + size - 1) / size;
}

// [*first, *last): this thread's items, those whose cost so far lies in its equal share of the whole cost, so that
// the threads' work differs by a group's item at most; in order, a thread's items contiguous.
static inline void deepdsl_group_share(long per, int ob, int groups, long* first, long* last) {
    long begin, end;
    deepdsl_share((long)ob * per, 1, &begin, &end);
    *first = deepdsl_group_item(begin, per, ob, groups);
    *last = deepdsl_group_item(end, per, ob, groups);
}

// A tile's sums (blocks x r positions x 16 channels) to the plain output at `to` (channel l of block b at to + (b *
// 16 + l) * plane, o0 the first block's first channel, o the channels), + bias[channel] where given.
static inline void deepdsl_blocked_tile_out(const float* tile, int blocks, int r, int o0, int o, long plane,
                                            const float* bias, float* to) {
    for (int b = 0; b < blocks; ++b) {
        const int first = o0 + b * DEEPDSL_BLOCK, oe = o - first < DEEPDSL_BLOCK ? o - first : DEEPDSL_BLOCK;
        const float* part = tile + b * r * DEEPDSL_BLOCK;
        for (int l = 0; l < oe; ++l) {
            float* at = to + (long)(b * DEEPDSL_BLOCK + l) * plane;
            if (bias) {
                const float add = bias[first + l];
                for (int t = 0; t < r; ++t) at[t] = part[t * DEEPDSL_BLOCK + l] + add;
            } else {
                for (int t = 0; t < r; ++t) at[t] = part[t * DEEPDSL_BLOCK + l];
            }
        }
    }
}

#define DEEPDSL_RUN_FLOATS 16384        /* a thread's sums of a run of rows: 64 KB of its stack */

// out (m, o, ho, wo) = the stride-1 convolution of the blocked, padded input xb (m, cb, hp, wp, 16) with the
// blocked filters wb (ceil(o / 16), cb, kh, kw, 16, 16) (+ bias (o) when given): ho = hp - kh + 1, wo = wp - kw + 1.
// The output blocks go in groups of at most `deepdsl_tile_blocks` (sizes as equal as can be); a thread computes whole
// rows of a group of a sample (its share weighted by the groups' blocks: `deepdsl_group_share`), in tiles of as
// equal a number of positions as DEEPDSL_TILE allows; the groups outermost, so that a group's filters stay in the
// cache over the samples. A thread takes its rows of a group in runs whose sums fit DEEPDSL_RUN_FLOATS: each
// partial sum (a group of channel blocks, `deepdsl_sum_blocks`) of every tile of the run, then the next, the sums kept
// on the stack in between: the filters of a partial sum (27 KB for three blocks of a 3x3 layer) stay in the L1
// cache over the run's tiles, where a tile's whole sum read all of the group's filters (442 KB for 256 channels) from
// the L2 cache. Each output adds the same partial sums in the same order either way (the same bits).
void deepdsl_blocked_conv(const float* xb, const float* wb, const float* bias, int m, int cb, int hp, int wp,
                          int o, int kh, int kw, float* out) {
    const int ob = (o + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK, ho = hp - kh + 1, wo = wp - kw + 1;
    const long x_row = (long)wp * DEEPDSL_BLOCK, x_block = (long)hp * x_row;
    const long filters = (long)cb * kh * kw * DEEPDSL_BLOCK * DEEPDSL_BLOCK, plane = (long)ho * wo;
    const long pass_filters = (long)kh * kw * DEEPDSL_BLOCK * DEEPDSL_BLOCK;
    const int tiles = (wo + DEEPDSL_TILE - 1) / DEEPDSL_TILE, per_tile = (wo + tiles - 1) / tiles;
    const int most = deepdsl_tile_blocks(per_tile), groups = (ob + most - 1) / most, group = deepdsl_sum_blocks(kh, kw);
#pragma omp parallel if ((long)m * o * plane * cb * kh * kw * DEEPDSL_BLOCK >= DEEPDSL_PARALLEL_MIN)
    {
        float sums[DEEPDSL_RUN_FLOATS];
        long first, last;
        deepdsl_group_share((long)m * ho, ob, groups, &first, &last);
        while (first < last) {
            const int a = (int)(first / ((long)m * ho));
            const int b0 = deepdsl_group_start(a, ob, groups), blocks = deepdsl_group_start(a + 1, ob, groups) - b0;
            const long row_sums = (long)blocks * wo * DEEPDSL_BLOCK, group_end = (long)(a + 1) * m * ho;
            const long fit = DEEPDSL_RUN_FLOATS / row_sums;
            if (fit == 0) {             // (rows too long for the stack: each tile's whole sum at once)
                const int s = (int)(first / ho % m), p = (int)(first % ho);
                const float* x = xb + (long)s * cb * x_block + (long)p * x_row;
                for (int q = 0; q < wo; q += per_tile) {
                    const int r = wo - q < per_tile ? wo - q : per_tile;
                    deepdsl_blocked_tile_of(x + (long)q * DEEPDSL_BLOCK, wb + b0 * filters, filters, cb, kh, kw,
                                            x_block, x_row, blocks, r, sums);
                    deepdsl_blocked_tile_out(sums, blocks, r, b0 * DEEPDSL_BLOCK, o, plane, bias,
                                             out + ((long)s * o + b0 * DEEPDSL_BLOCK) * plane + (long)p * wo + q);
                }
                ++first;
                continue;
            }
            long end = first + fit < last ? first + fit : last;
            end = end < group_end ? end : group_end;
            for (int c0 = 0; c0 < cb; c0 += group) {
                const int count = cb - c0 < group ? cb - c0 : group;
                const float* w = wb + b0 * filters + c0 * pass_filters;
                for (long item = first; item < end; ++item) {
                    const int s = (int)(item / ho % m), p = (int)(item % ho);
                    const float* x = xb + ((long)s * cb + c0) * x_block + (long)p * x_row;
                    float* row = sums + (item - first) * row_sums;
                    for (int q = 0; q < wo; q += per_tile) {
                        const int r = wo - q < per_tile ? wo - q : per_tile;
                        deepdsl_blocked_tile_pass(x + (long)q * DEEPDSL_BLOCK, w, filters, count, kh, kw, x_block,
                                                  x_row, blocks, r, c0 > 0, row + (long)blocks * q * DEEPDSL_BLOCK);
                    }
                }
            }
            for (long item = first; item < end; ++item) {
                const int s = (int)(item / ho % m), p = (int)(item % ho);
                float* row = out + ((long)s * o + b0 * DEEPDSL_BLOCK) * plane + (long)p * wo;
                for (int q = 0; q < wo; q += per_tile)
                    deepdsl_blocked_tile_out(sums + (item - first) * row_sums + (long)blocks * q * DEEPDSL_BLOCK,
                                             blocks, wo - q < per_tile ? wo - q : per_tile, b0 * DEEPDSL_BLOCK, o,
                                             plane, bias, row + q);
            }
            first = end;
        }
    }
}

// sums (16 input channels x 16 output channels of one tap, by rows) += over samples s < m, then rows p < ho,
// columns q < wo of x[s][p][q][k] * g[s][p][q][:], x pointing at the tap's first input position of the first sample
// (rows `x_row` floats apart, samples `x_sample`), g at the first sample's output gradient block (rows of wo
// positions, samples `g_sample` apart): a partial sum in registers over each group of rows of a sample of at most
// DEEPDSL_SUM_TERMS positions (one row at least), added to the sums in order. The same for `ob` output blocks at a
// time (their gradients `g_block` floats apart, their sums `sums_block`), which share each broadcast input: with
// AVX-512 input channels [k0, k0 + KC) of OB blocks at a time (OB * KC sums, the OB gradients and a broadcast in
// registers), with AVX2 6, 6 and 4 input channels of one block at a time. Each sum adds the same products in the
// same order in every case, so the bits are those of one block and one channel at a time.
#if defined(__AVX512F__)
#define DEEPDSL_FILTER_BLOCKS 3         /* output blocks at most that share the broadcasts */
static inline __attribute__((always_inline)) void deepdsl_blocked_filter_part(
        const float* x, long x_row, long x_sample, const float* g, long g_block, long g_sample, int m, int ho, int wo,
        int rows, int k0, int OB, int KC, float* sums, long sums_block) {
    for (int s = 0; s < m; ++s)
        for (int p0 = 0; p0 < ho; p0 += rows) {
            __m512 acc[DEEPDSL_FILTER_BLOCKS][8];
            #pragma GCC unroll 3
            for (int b = 0; b < OB; ++b)
                #pragma GCC unroll 8
                for (int k = 0; k < KC; ++k) acc[b][k] = _mm512_setzero_ps();
            for (int p = p0; p < ho && p < p0 + rows; ++p) {
                const float* xr = x + s * x_sample + p * x_row + k0;
                const float* gr = g + s * g_sample + (long)p * wo * DEEPDSL_BLOCK;
                for (int q = 0; q < wo; ++q) {
                    __m512 gv[DEEPDSL_FILTER_BLOCKS];
                    #pragma GCC unroll 3
                    for (int b = 0; b < OB; ++b) gv[b] = _mm512_loadu_ps(gr + b * g_block + q * DEEPDSL_BLOCK);
                    #pragma GCC unroll 8
                    for (int k = 0; k < KC; ++k) {
                        const __m512 v = _mm512_set1_ps(xr[q * DEEPDSL_BLOCK + k]);
                        #pragma GCC unroll 3
                        for (int b = 0; b < OB; ++b) acc[b][k] = _mm512_fmadd_ps(v, gv[b], acc[b][k]);
                    }
                }
            }
            #pragma GCC unroll 3
            for (int b = 0; b < OB; ++b)
                #pragma GCC unroll 8
                for (int k = 0; k < KC; ++k) {
                    float* to = sums + b * sums_block + (k0 + k) * DEEPDSL_BLOCK;
                    _mm512_storeu_ps(to, _mm512_add_ps(_mm512_loadu_ps(to), acc[b][k]));
                }
        }
}

static inline void deepdsl_blocked_filter_sums(const float* x, long x_row, long x_sample, const float* g,
                                               long g_block, long g_sample, int m, int ho, int wo, int ob,
                                               float* sums, long sums_block) {
    const int rows = wo >= DEEPDSL_SUM_TERMS ? 1 : DEEPDSL_SUM_TERMS / wo;
    for (int k0 = 0; k0 < DEEPDSL_BLOCK; k0 += 8)
        switch (ob) {
        case 1: deepdsl_blocked_filter_part(x, x_row, x_sample, g, g_block, g_sample, m, ho, wo, rows, k0, 1, 8, sums,
                                            sums_block); break;
        case 2: deepdsl_blocked_filter_part(x, x_row, x_sample, g, g_block, g_sample, m, ho, wo, rows, k0, 2, 8, sums,
                                            sums_block); break;
        default: deepdsl_blocked_filter_part(x, x_row, x_sample, g, g_block, g_sample, m, ho, wo, rows, k0, 3, 8,
                                             sums, sums_block);
        }
}
#else
#define DEEPDSL_FILTER_BLOCKS 1
// AVX2: input channels [k0, k0 + IC) of the block at a time (IC = 6 or 4: 12 or 8 accumulators, with the output
// gradient's two registers and a broadcast within 16).
static inline __attribute__((always_inline)) void deepdsl_blocked_filter_part(
        const float* x, long x_row, long x_sample, const float* g, long g_sample, int m, int ho, int wo, int rows,
        int k0, int IC, float* sums) {
    for (int s = 0; s < m; ++s)
        for (int p0 = 0; p0 < ho; p0 += rows) {
            __m256 lo[6], hi[6];
            #pragma GCC unroll 6
            for (int k = 0; k < IC; ++k) lo[k] = hi[k] = _mm256_setzero_ps();
            for (int p = p0; p < ho && p < p0 + rows; ++p) {
                const float* xr = x + s * x_sample + p * x_row + k0;
                const float* gr = g + s * g_sample + (long)p * wo * DEEPDSL_BLOCK;
                for (int q = 0; q < wo; ++q) {
                    const __m256 g0 = _mm256_loadu_ps(gr + q * DEEPDSL_BLOCK);
                    const __m256 g1 = _mm256_loadu_ps(gr + q * DEEPDSL_BLOCK + 8);
                    #pragma GCC unroll 6
                    for (int k = 0; k < IC; ++k) {
                        const __m256 v = _mm256_broadcast_ss(xr + q * DEEPDSL_BLOCK + k);
                        lo[k] = _mm256_fmadd_ps(v, g0, lo[k]);
                        hi[k] = _mm256_fmadd_ps(v, g1, hi[k]);
                    }
                }
            }
            #pragma GCC unroll 6
            for (int k = 0; k < IC; ++k) {
                float* to = sums + (k0 + k) * DEEPDSL_BLOCK;
                _mm256_storeu_ps(to, _mm256_add_ps(_mm256_loadu_ps(to), lo[k]));
                _mm256_storeu_ps(to + 8, _mm256_add_ps(_mm256_loadu_ps(to + 8), hi[k]));
            }
        }
}

static inline void deepdsl_blocked_filter_sums(const float* x, long x_row, long x_sample, const float* g,
                                               long g_block, long g_sample, int m, int ho, int wo, int ob,
                                               float* sums, long sums_block) {
    const int rows = wo >= DEEPDSL_SUM_TERMS ? 1 : DEEPDSL_SUM_TERMS / wo;
    for (int b = 0; b < ob; ++b) {
        const float* gs = g + b * g_block;
        float* to = sums + b * sums_block;
        deepdsl_blocked_filter_part(x, x_row, x_sample, gs, g_sample, m, ho, wo, rows, 0, 6, to);
        deepdsl_blocked_filter_part(x, x_row, x_sample, gs, g_sample, m, ho, wo, rows, 6, 6, to);
        deepdsl_blocked_filter_part(x, x_row, x_sample, gs, g_sample, m, ho, wo, rows, 12, 4, to);
    }
}
#endif

#define DEEPDSL_FILTER_CACHE (1L << 18)  /* bytes of an input and a gradient block a group of samples spans */

// dwb (ob, cb, kh, kw, 16 inputs, 16 outputs) (+)= the filter gradient of a stride-1 convolution from the blocked,
// padded input xb (m, cb, hp, wp, 16) and the blocked output gradient gb (m, ob, ho, wo, 16), ho = hp - kh + 1,
// wo = wp - kw + 1: from zero where `first`, else adding to dwb (the next chunk of samples). The output blocks go in
// groups of DEEPDSL_FILTER_BLOCKS; a thread takes a fixed share of the items (group, input block, tap) in that
// order; for each pair of a group and an input block it runs groups of samples whose blocks stay in its cache
// (DEEPDSL_FILTER_CACHE) over the pair's taps, each tap's sums in registers over the group of samples.
void deepdsl_blocked_conv_bwd_filter(const float* xb, const float* gb, int m, int cb, int hp, int wp, int ob, int kh,
                                     int kw, int first, float* dwb) {
    const int ho = hp - kh + 1, wo = wp - kw + 1;
    const long x_row = (long)wp * DEEPDSL_BLOCK, x_block = (long)hp * x_row, g_block = (long)ho * wo * DEEPDSL_BLOCK;
    const long taps = (long)kh * kw, tile = DEEPDSL_BLOCK * DEEPDSL_BLOCK, sums_block = cb * taps * tile;
    const int groups = (ob + DEEPDSL_FILTER_BLOCKS - 1) / DEEPDSL_FILTER_BLOCKS;
    const long pair_bytes = (long)sizeof(float) * (x_block + DEEPDSL_FILTER_BLOCKS * g_block);
    const int together = pair_bytes >= DEEPDSL_FILTER_CACHE ? 1 : (int)(DEEPDSL_FILTER_CACHE / pair_bytes);
#pragma omp parallel if (ob * cb * taps * m * g_block * DEEPDSL_BLOCK >= DEEPDSL_PARALLEL_MIN)
    {
        long begin, end;
        deepdsl_group_share(cb * taps, ob, groups, &begin, &end);
        for (long t0 = begin; t0 < end;) {
            const long pair = t0 / taps, t1 = (pair + 1) * taps < end ? (pair + 1) * taps : end, c = pair % cb;
            const int group = (int)(pair / cb), a0 = deepdsl_group_start(group, ob, groups);
            const int blocks = deepdsl_group_start(group + 1, ob, groups) - a0;
            float* sums = dwb + (a0 * cb + c) * taps * tile;
            if (first)
                for (int b = 0; b < blocks; ++b)
                    memset(sums + b * sums_block + (t0 % taps) * tile, 0, sizeof(float) * (t1 - t0) * tile);
            for (int s0 = 0; s0 < m; s0 += together) {
                const int samples = m - s0 < together ? m - s0 : together;
                for (long t = t0; t < t1; ++t) {
                    const long tap = t % taps;
                    const float* x = xb + ((long)s0 * cb + c) * x_block + (tap / kw) * x_row
                                     + (tap % kw) * DEEPDSL_BLOCK;
                    deepdsl_blocked_filter_sums(x, x_row, cb * x_block, gb + ((long)s0 * ob + a0) * g_block, g_block,
                                                ob * g_block, samples, ho, wo, blocks, sums + tap * tile, sums_block);
                }
            }
            t0 = t1;
        }
    }
}

// w (o, c, kh, kw) = the blocked filters wb (ceil(o / 16), ceil(c / 16), kh, kw, 16 inputs, 16 outputs), dropping
// the channels past o and c.
void deepdsl_unblocked_filters(const float* wb, int o, int c, int kh, int kw, float* w) {
    const int ob = (o + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK, cb = (c + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK;
    const long taps = (long)kh * kw;
#pragma omp parallel for collapse(2) schedule(static) if ((long)o * c * taps >= DEEPDSL_EW_PARALLEL_MIN)
    for (int a = 0; a < ob; ++a)
        for (int b = 0; b < cb; ++b) {
            const float* blocks = wb + ((long)a * cb + b) * taps * DEEPDSL_BLOCK * DEEPDSL_BLOCK;
            for (int l = 0; l < DEEPDSL_BLOCK && a * DEEPDSL_BLOCK + l < o; ++l)
                for (int k = 0; k < DEEPDSL_BLOCK && b * DEEPDSL_BLOCK + k < c; ++k) {
                    float* to = w + ((long)(a * DEEPDSL_BLOCK + l) * c + b * DEEPDSL_BLOCK + k) * taps;
                    for (long t = 0; t < taps; ++t) to[t] = blocks[(t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l];
                }
        }
}

#else
#define DEEPDSL_BLOCKED 0
#endif

// Whether this library has the blocked kernels (processors with AVX2 and fused multiply-adds, or AVX-512): their
// vectors' lanes (8 or 16), or 0.
int deepdsl_blocked_kernels(void) { return DEEPDSL_BLOCKED; }
