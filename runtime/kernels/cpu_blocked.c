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
// DEEPDSL_TILE output positions of one row and up to three blocks of 16 output channels keeps its sums in registers
// (with AVX2 three blocks as two tiles of three half blocks), and each input channel of each tap is one broadcast,
// one filter vector per block and one fused multiply-add per position and block; a row's sums are written to the
// plain (N, O, Ho, Wo) output 8 x 8 at a time through transpositions in registers.
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
#define DEEPDSL_TILE 14                 /* output positions of a tile at most (its sums: 28 of 32 registers) */
#elif defined(__AVX2__) && defined(__FMA__)
#define DEEPDSL_LANES 8
#define DEEPDSL_TILE 6                  /* (its sums: 12 of 16 registers) */
#endif

#ifdef DEEPDSL_TILE
#define DEEPDSL_BLOCKED DEEPDSL_LANES

// The tiles' shapes (OB output blocks, R positions) that `deepdsl_tile_groups` and `deepdsl_row_tiles` make, as
// switch arms: constants in each, so the tile's loops unroll.
#if DEEPDSL_TILE == 14
#define DEEPDSL_TILES_OF(X, OB) X(OB, 1) X(OB, 2) X(OB, 3) X(OB, 4) X(OB, 5) X(OB, 6) X(OB, 7)
#define DEEPDSL_TILES(X) DEEPDSL_TILES_OF(X, 1) X(1, 8) X(1, 9) X(1, 10) X(1, 11) X(1, 12) X(1, 13) X(1, 14) \
    DEEPDSL_TILES_OF(X, 2) X(2, 8) X(2, 9) X(2, 10) X(2, 11) X(2, 12) X(2, 13) X(2, 14) DEEPDSL_TILES_OF(X, 3) \
    X(3, 8) X(3, 9)
#else
#define DEEPDSL_TILES(X) X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(1, 5) X(1, 6) X(3, 1) X(3, 2) X(3, 3) X(3, 4)
#endif

// out (OB blocks `out_block` floats apart, each R positions x 16 channels) = (`add`: out +) the sum over channel
// blocks c < cb, kernel rows i, columns j and channels k of the block of x[c][i][j + position][k] *
// w_b[c][i][j][k][:], x pointing at the tile's first input position in block 0 (its blocks `x_block` floats apart,
// rows `x_row` apart), w at the first output block's filters (the next ones `w_block` floats apart). The OB output
// blocks share each input broadcast. (`part`: AVX2's, below.)
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void deepdsl_blocked_tile(
        const float* x, const float* w, long w_block, int cb, int kh, int kw, long x_block, long x_row, int OB, int R,
        int part, int add, float* out, long out_block) {
    (void)part;
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
            float* to = out + b * out_block + r * DEEPDSL_BLOCK;
            _mm512_storeu_ps(to, add ? _mm512_add_ps(_mm512_loadu_ps(to), acc[b][r]) : acc[b][r]);
        }
}
#else
// AVX2: a block of 16 channels is two vectors, so the tile's unit is the half block of 8 channels: one block (two
// halves) by up to 6 positions, or three blocks in two parts of three halves by up to 4 positions (12 sums, three
// filter vectors and a broadcast fill the 16 registers, and each broadcast serves three fused multiply-adds). The
// halves H0 .. H0 + HB - 1 of the blocks: half h is channels 8 * (h % 2) .. of block h / 2, its sums at out + (h / 2)
// * out_block + r * 16 + 8 * (h % 2). `part` p of three blocks: the halves 3p .. 3p + 2.
static inline __attribute__((always_inline)) void deepdsl_half_tile(
        const float* x, const float* w, long w_block, int cb, int kh, int kw, long x_block, long x_row, int H0,
        int HB, int R, int add, float* out, long out_block) {
    __m256 acc[3][DEEPDSL_TILE];
    #pragma GCC unroll 3
    for (int b = 0; b < HB; ++b)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
    for (int c = 0; c < cb; ++c)
        for (int i = 0; i < kh; ++i)
            for (int j = 0; j < kw; ++j) {
                const float* xr = x + c * x_block + i * x_row + j * DEEPDSL_BLOCK;
                const float* wt = w + ((long)(c * kh + i) * kw + j) * DEEPDSL_BLOCK * DEEPDSL_BLOCK;
                for (int k = 0; k < DEEPDSL_BLOCK; ++k) {
                    __m256 wv[3];
                    #pragma GCC unroll 3
                    for (int b = 0; b < HB; ++b) {
                        wv[b] = _mm256_loadu_ps(wt + (H0 + b) / 2 * w_block + k * DEEPDSL_BLOCK + (H0 + b) % 2 * 8);
                        DEEPDSL_IN_REGISTER(wv[b]);
                    }
                    #pragma GCC unroll 16
                    for (int r = 0; r < R; ++r) {
                        const __m256 v = _mm256_broadcast_ss(xr + r * DEEPDSL_BLOCK + k);
                        #pragma GCC unroll 3
                        for (int b = 0; b < HB; ++b) acc[b][r] = _mm256_fmadd_ps(v, wv[b], acc[b][r]);
                    }
                }
            }
    #pragma GCC unroll 3
    for (int b = 0; b < HB; ++b)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            float* to = out + (H0 + b) / 2 * out_block + r * DEEPDSL_BLOCK + (H0 + b) % 2 * 8;
            _mm256_storeu_ps(to, add ? _mm256_add_ps(_mm256_loadu_ps(to), acc[b][r]) : acc[b][r]);
        }
}

static inline __attribute__((always_inline)) void deepdsl_blocked_tile(
        const float* x, const float* w, long w_block, int cb, int kh, int kw, long x_block, long x_row, int OB, int R,
        int part, int add, float* out, long out_block) {
    if (OB == 1)
        deepdsl_half_tile(x, w, w_block, cb, kh, kw, x_block, x_row, 0, 2, R, add, out, out_block);
    else
        deepdsl_half_tile(x, w, w_block, cb, kh, kw, x_block, x_row, 3 * part, 3, R, add, out, out_block);
}
#endif

#define DEEPDSL_SUM_TERMS 256   /* products a partial sum adds at most before it is added to the output's total */

// The parts a tile of `blocks` output blocks is computed in, one after the other: with AVX2 three blocks' two tiles
// of three half blocks, else one.
static inline int deepdsl_tile_parts(int blocks) {
    return DEEPDSL_TILE == 14 || blocks == 1 ? 1 : 2;
}

// A tile of OB output blocks by r positions (a shape of DEEPDSL_TILES), constants in each arm, over `count`
// channel blocks: one partial sum, into `out` or (`add`) added to it.
static inline void deepdsl_blocked_tile_pass(const float* x, const float* w, long w_block, int count, int kh, int kw,
                                             long x_block, long x_row, int ob, int r, int part, int add, float* out,
                                             long out_block) {
    switch (ob * 64 + r) {
#define DEEPDSL_TILE_CASE(OB, R) \
    case OB * 64 + R: \
        deepdsl_blocked_tile(x, w, w_block, count, kh, kw, x_block, x_row, OB, R, part, add, out, out_block); break;
    DEEPDSL_TILES(DEEPDSL_TILE_CASE)
#undef DEEPDSL_TILE_CASE
    }
}

// The channel blocks a partial sum adds: as many whole blocks as DEEPDSL_SUM_TERMS products allow, one at least.
static inline int deepdsl_sum_blocks(int kh, int kw) {
    const int per_block = kh * kw * DEEPDSL_BLOCK;
    return per_block >= DEEPDSL_SUM_TERMS ? 1 : DEEPDSL_SUM_TERMS / per_block;
}

// The same tile over all cb channel blocks (its blocks' sums r * 16 floats apart): a partial sum over each group of
// channel blocks of at most DEEPDSL_SUM_TERMS products (one block at least), the partial sums added up in order (as a
// matrix product's blocks of its inner dimension are: far less rounding than one long sum).
static inline void deepdsl_blocked_tile_of(const float* x, const float* w, long w_block, int cb, int kh, int kw,
                                           long x_block, long x_row, int ob, int r, float* out) {
    const int group = deepdsl_sum_blocks(kh, kw);
    for (int c0 = 0; c0 < cb; c0 += group)
        for (int part = 0; part < deepdsl_tile_parts(ob); ++part)
            deepdsl_blocked_tile_pass(x + c0 * x_block, w + (long)c0 * kh * kw * DEEPDSL_BLOCK * DEEPDSL_BLOCK,
                                      w_block, cb - c0 < group ? cb - c0 : group, kh, kw, x_block, x_row, ob, r, part,
                                      c0 > 0, out, (long)r * DEEPDSL_BLOCK);
}

// Output blocks in groups: the first `larger` groups of `big` blocks, the rest of `small`, each group `per` items
// (rows, or taps of input blocks) whose cost is the group's blocks.
typedef struct { int larger, big, small; } deepdsl_groups;

// `ob` blocks in `count` groups of as equal sizes as can be (the first ob % count of them one block larger).
static inline deepdsl_groups deepdsl_even_groups(int ob, int count) {
    const deepdsl_groups g = {ob % count, ob / count + 1, ob / count};
    return g;
}

static inline int deepdsl_group_start(deepdsl_groups g, int group) {
    return group < g.larger ? group * g.big : g.larger * g.big + (group - g.larger) * g.small;
}

// The first item whose cost so far is `cost` at least.
static inline long deepdsl_group_item(deepdsl_groups g, long cost, long per) {
    const long first = (long)g.larger * g.big * per;
    if (cost < first)
        return cost / (g.big * per) * per + (cost % (g.big * per) + g.big - 1) / g.big;
    cost -= first;
    return (g.larger + cost / (g.small * per)) * per + (cost % (g.small * per) + g.small - 1) / g.small;
}

// [*first, *last): this thread's items of the `ob` blocks' groups, those whose cost so far lies in its equal share
// of the whole cost, so that the threads' work differs by a group's item at most; in order, a thread's items
// contiguous.
static inline void deepdsl_group_share(deepdsl_groups g, long per, int ob, long* first, long* last) {
    long begin, end;
    deepdsl_share((long)ob * per, 1, &begin, &end);
    *first = deepdsl_group_item(g, begin, per);
    *last = deepdsl_group_item(g, end, per);
}

// A layer's output blocks in groups whose tiles share each broadcast input (and each loaded filter vector serves a
// tile's positions: fewer loads for each fused multiply-add), for rows of wo positions. AVX-512: tiles of up to 14
// positions of as equal numbers as can be; three blocks where they have 9 positions at most, else two; the groups
// of as equal sizes as can be. AVX2: groups of three blocks (each computed as two tiles of three half blocks by up to
// 4 positions), and the ob % 3 blocks left over alone (one block, 2 half blocks, by up to 6 positions): 12 sums.
static inline deepdsl_groups deepdsl_tile_groups(int ob, int wo) {
#if DEEPDSL_TILE == 14
    const int tiles = (wo + DEEPDSL_TILE - 1) / DEEPDSL_TILE, most = (wo + tiles - 1) / tiles <= 9 ? 3 : 2;
    return deepdsl_even_groups(ob, (ob + most - 1) / most);
#else
    (void)wo;
    const deepdsl_groups g = {ob / 3, 3, 1};
    return g;
#endif
}

// The tiles of a row of wo positions of a group of `blocks` output blocks (tile t its positions [t * wo / tiles,
// (t + 1) * wo / tiles)).
static inline int deepdsl_row_tiles(int blocks, int wo) {
    const int most = DEEPDSL_TILE == 14 || blocks == 1 ? DEEPDSL_TILE : 4;
    return (wo + most - 1) / most;
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

// One whole block pair of the filters (16 x 16 channels, `taps` taps each) blocked, 8 x 8 floats at a time through
// transpositions in registers: `rows` the first of the 16 channels whose filters are rows of w (`row` floats apart),
// each row the 16 channels of the other side, `taps` floats each. Not flipped (w's rows its output channels l): the
// row's floats j = k * taps + t go to blocks[(t * 16 + k) * 16 + l]. Flipped (w's rows its output channels k, the
// block's 16 inputs): the row's floats j = l * taps + t go to blocks[((taps - 1 - t) * 16 + k) * 16 + l].
static inline void deepdsl_block_pair(const float* rows, long row, long taps, int flip, float* blocks) {
    const long span = DEEPDSL_BLOCK * taps;
    if (!flip) {
        for (int l0 = 0; l0 < DEEPDSL_BLOCK; l0 += 8)
            for (long j0 = 0, k = 0, t = 0; j0 < span; j0 += 8) {       // (span is a multiple of 8)
                deepdsl_v8f v[8];
                deepdsl_load8x8(v, rows + l0 * row + j0, row);
                deepdsl_transpose8(v);
#pragma GCC unroll 8
                for (int e = 0; e < 8; ++e) {               // (k, t) = (j / taps, j % taps), j = j0 + e, counted
                    memcpy(blocks + (t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l0, &v[e], sizeof v[e]);
                    if (++t == taps) t = 0, ++k;
                }
            }
        return;
    }
    const long whole = taps / 8 * 8;     // (the taps past the last 8 float by float)
    for (int k = 0; k < DEEPDSL_BLOCK; ++k) {
        const float* from = rows + k * row;
        for (int l0 = 0; l0 < DEEPDSL_BLOCK; l0 += 8)
            for (long t0 = 0; t0 < whole; t0 += 8) {
                deepdsl_v8f v[8];
                deepdsl_load8x8(v, from + l0 * taps + t0, taps);
                deepdsl_transpose8(v);
#pragma GCC unroll 8
                for (int e = 0; e < 8; ++e)
                    memcpy(blocks + ((taps - 1 - t0 - e) * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l0, &v[e],
                           sizeof v[e]);
            }
        for (long t = whole; t < taps; ++t)
            for (int l = 0; l < DEEPDSL_BLOCK; ++l)
                blocks[((taps - 1 - t) * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l] = from[l * taps + t];
    }
}

// Block pair (a, b) of the filters w (o, c, kh, kw) as a convolution's blocked filters (`deepdsl_blocked_filters`):
// blocks (kh, kw, 16 input channels, 16 output channels) of output block a and input block b, zeros past o and c.
// `flip`: the input gradient's convolution, whose outputs are w's inputs and inputs w's outputs, the kernel turned
// around. A whole pair through `deepdsl_block_pair`, one with channels past o or c float by float.
static inline void deepdsl_blocked_filter_pair(const float* w, int o, int c, int kh, int kw, int flip, int a, int b,
                                               float* blocks) {
    const int to = flip ? c : o, from = flip ? o : c;
    const long taps = (long)kh * kw;
    const int ks = from - b * DEEPDSL_BLOCK < DEEPDSL_BLOCK ? from - b * DEEPDSL_BLOCK : DEEPDSL_BLOCK;
    const int ls = to - a * DEEPDSL_BLOCK < DEEPDSL_BLOCK ? to - a * DEEPDSL_BLOCK : DEEPDSL_BLOCK;
    if (ks == DEEPDSL_BLOCK && ls == DEEPDSL_BLOCK) {
        if (flip)
            deepdsl_block_pair(w + ((long)b * DEEPDSL_BLOCK * c + a * DEEPDSL_BLOCK) * taps, c * taps, taps, 1, blocks);
        else
            deepdsl_block_pair(w + ((long)a * DEEPDSL_BLOCK * c + b * DEEPDSL_BLOCK) * taps, c * taps, taps, 0, blocks);
        return;
    }
    memset(blocks, 0, sizeof(float) * taps * DEEPDSL_BLOCK * DEEPDSL_BLOCK);
    // the convolution's input channel b * 16 + k and output channel a * 16 + l, reading w in its order
    if (flip)
        for (int k = 0; k < ks; ++k)
            for (int l = 0; l < ls; ++l) {
                const float* in = w + ((long)(b * DEEPDSL_BLOCK + k) * c + a * DEEPDSL_BLOCK + l) * taps;
                for (long t = 0; t < taps; ++t) blocks[(t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l] = in[taps - 1 - t];
            }
    else
        for (int l = 0; l < ls; ++l)
            for (int k = 0; k < ks; ++k) {
                const float* in = w + ((long)(a * DEEPDSL_BLOCK + l) * c + b * DEEPDSL_BLOCK + k) * taps;
                for (long t = 0; t < taps; ++t) blocks[(t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l] = in[t];
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
    const int wr = flip ? fb : tb, wc = flip ? tb : fb;     // w's blocks of rows and of columns, read in order
#pragma omp parallel for collapse(2) schedule(static) if ((long)tb * fb * taps * 256 >= DEEPDSL_EW_PARALLEL_MIN)
    for (int r = 0; r < wr; ++r)
        for (int q = 0; q < wc; ++q) {
            const int a = flip ? q : r, b = flip ? r : q;
            deepdsl_blocked_filter_pair(w, o, c, kh, kw, flip, a, b,
                                        wb + ((long)a * fb + b) * taps * DEEPDSL_BLOCK * DEEPDSL_BLOCK);
        }
}

// The sums of n positions of `blocks` output blocks (block b's at sums + b * sums_block, position t's 16 channels at
// [t * 16]) to the plain output at `to` (channel l of block b at to + (b * 16 + l) * plane, o0 the first block's
// first channel, o the channels), + bias[channel] where given: 8 positions by 8 channels at a time, transposed in
// registers, the last positions of a row through masked stores.
static inline void deepdsl_blocked_out(const float* sums, int blocks, int n, long sums_block, int o0, int o,
                                       long plane, const float* bias, float* to) {
    for (int b = 0; b < blocks; ++b)
        for (int h = 0; h < DEEPDSL_BLOCK; h += 8) {
            const int first = o0 + b * DEEPDSL_BLOCK + h, channels = o - first < 8 ? o - first : 8;
            for (int t0 = 0; t0 < n; t0 += 8) {
                const int count = n - t0 < 8 ? n - t0 : 8;
                deepdsl_v8f v[8];               // (loops unrolled: v stays in registers)
#pragma GCC unroll 8
                for (int t = 0; t < 8; ++t)
                    if (t < count)
                        memcpy(&v[t], sums + b * sums_block + (t0 + t) * DEEPDSL_BLOCK + h, sizeof v[t]);
                    else
                        v[t] = (deepdsl_v8f){0};
                deepdsl_transpose8(v);
                const deepdsl_v8i mask = deepdsl_inside(t0, n);
#pragma GCC unroll 8
                for (int l = 0; l < 8; ++l) {
                    if (l >= channels)
                        break;
                    float* at = to + (long)(b * DEEPDSL_BLOCK + h + l) * plane + t0;
                    const deepdsl_v8f row = bias ? v[l] + bias[first + l] : v[l];
                    if (count == 8)
                        memcpy(at, &row, sizeof row);
                    else
                        deepdsl_store(at, mask, row);
                }
            }
        }
}

#define DEEPDSL_RUN_FLOATS 16384        /* a thread's sums of a run of rows: 64 KB of its stack */

// out (m, o, ho, wo) = the stride-1 convolution of the blocked, padded input xb (m, cb, hp, wp, 16) with the
// blocked filters wb (ceil(o / 16), cb, kh, kw, 16, 16) (+ bias (o) when given): ho = hp - kh + 1, wo = wp - kw + 1.
// The output blocks go in groups (`deepdsl_tile_groups`); a thread computes whole rows of a group of a sample (its
// share weighted by the groups' blocks: `deepdsl_group_share`), each row in `deepdsl_row_tiles` tiles of as equal
// numbers of positions as can be; the groups outermost, so that a group's filters stay in the cache over the
// samples. A thread takes its rows of a group in runs whose sums fit DEEPDSL_RUN_FLOATS: each partial sum (a group of
// channel blocks, `deepdsl_sum_blocks`) of every tile of the run, then the next, the sums kept on the stack in
// between: the filters of a partial sum (27 KB for three blocks of a 3x3 layer) stay in the L1 cache over the run's
// tiles, where a tile's whole sum read all of the group's filters (442 KB for 256 channels) from the L2 cache. Each
// output adds the same partial sums in the same order either way (the same bits).
void deepdsl_blocked_conv(const float* xb, const float* wb, const float* bias, int m, int cb, int hp, int wp,
                          int o, int kh, int kw, float* out) {
    const int ob = (o + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK, ho = hp - kh + 1, wo = wp - kw + 1;
    const long x_row = (long)wp * DEEPDSL_BLOCK, x_block = (long)hp * x_row;
    const long filters = (long)cb * kh * kw * DEEPDSL_BLOCK * DEEPDSL_BLOCK, plane = (long)ho * wo;
    const long pass_filters = (long)kh * kw * DEEPDSL_BLOCK * DEEPDSL_BLOCK;
    const deepdsl_groups g = deepdsl_tile_groups(ob, wo);
    const int group = deepdsl_sum_blocks(kh, kw);
#pragma omp parallel if ((long)m * o * plane * cb * kh * kw * DEEPDSL_BLOCK >= DEEPDSL_PARALLEL_MIN)
    {
        float sums[DEEPDSL_RUN_FLOATS];
        long first, last;
        deepdsl_group_share(g, (long)m * ho, ob, &first, &last);
        while (first < last) {
            const int a = (int)(first / ((long)m * ho));
            const int b0 = deepdsl_group_start(g, a), blocks = deepdsl_group_start(g, a + 1) - b0;
            const int tiles = deepdsl_row_tiles(blocks, wo);
            const long row_sums = (long)blocks * wo * DEEPDSL_BLOCK, group_end = (long)(a + 1) * m * ho;
            const long fit = DEEPDSL_RUN_FLOATS / row_sums;
            if (fit == 0) {             // (rows too long for the stack: each tile's whole sum at once)
                const int s = (int)(first / ho % m), p = (int)(first % ho);
                const float* x = xb + (long)s * cb * x_block + (long)p * x_row;
                for (int t = 0; t < tiles; ++t) {
                    const int q = t * wo / tiles, r = (t + 1) * wo / tiles - q;
                    deepdsl_blocked_tile_of(x + (long)q * DEEPDSL_BLOCK, wb + b0 * filters, filters, cb, kh, kw,
                                            x_block, x_row, blocks, r, sums);
                    deepdsl_blocked_out(sums, blocks, r, (long)r * DEEPDSL_BLOCK, b0 * DEEPDSL_BLOCK, o, plane, bias,
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
                for (int part = 0; part < deepdsl_tile_parts(blocks); ++part)
                    for (long item = first; item < end; ++item) {
                        const int s = (int)(item / ho % m), p = (int)(item % ho);
                        const float* x = xb + ((long)s * cb + c0) * x_block + (long)p * x_row;
                        float* row = sums + (item - first) * row_sums;
                        for (int t = 0; t < tiles; ++t) {
                            const int q = t * wo / tiles, r = (t + 1) * wo / tiles - q;
                            deepdsl_blocked_tile_pass(x + (long)q * DEEPDSL_BLOCK, w, filters, count, kh, kw,
                                                      x_block, x_row, blocks, r, part, c0 > 0,
                                                      row + (long)q * DEEPDSL_BLOCK, (long)wo * DEEPDSL_BLOCK);
                        }
                    }
            }
            for (long item = first; item < end; ++item) {
                const int s = (int)(item / ho % m), p = (int)(item % ho);
                deepdsl_blocked_out(sums + (item - first) * row_sums, blocks, wo, (long)wo * DEEPDSL_BLOCK,
                                    b0 * DEEPDSL_BLOCK, o, plane, bias,
                                    out + ((long)s * o + b0 * DEEPDSL_BLOCK) * plane + (long)p * wo);
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
                    __m256 g0 = _mm256_loadu_ps(gr + q * DEEPDSL_BLOCK);
                    __m256 g1 = _mm256_loadu_ps(gr + q * DEEPDSL_BLOCK + 8);
                    DEEPDSL_IN_REGISTER(g0);
                    DEEPDSL_IN_REGISTER(g1);
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
        const deepdsl_groups g = deepdsl_even_groups(ob, groups);
        deepdsl_group_share(g, cb * taps, ob, &begin, &end);
        for (long t0 = begin; t0 < end;) {
            const long pair = t0 / taps, t1 = (pair + 1) * taps < end ? (pair + 1) * taps : end, c = pair % cb;
            const int group = (int)(pair / cb), a0 = deepdsl_group_start(g, group);
            const int blocks = deepdsl_group_start(g, group + 1) - a0;
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

// Block pair (a, b) of the blocked filters, blocks (kh, kw, 16 inputs, 16 outputs), into w (o, c, kh, kw), dropping
// the channels past o and c: a whole pair 8 x 8 floats at a time through transpositions in registers (the inverse of
// `deepdsl_block_pair`'s), another float by float.
static inline void deepdsl_unblocked_filter_pair(const float* blocks, int o, int c, int kh, int kw, int a, int b,
                                                 float* w) {
    const long taps = (long)kh * kw, span = DEEPDSL_BLOCK * taps;
    if ((a + 1) * DEEPDSL_BLOCK <= o && (b + 1) * DEEPDSL_BLOCK <= c) {
        float* rows = w + ((long)a * DEEPDSL_BLOCK * c + b * DEEPDSL_BLOCK) * taps;
        for (int l0 = 0; l0 < DEEPDSL_BLOCK; l0 += 8)
            for (long j0 = 0, k = 0, t = 0; j0 < span; j0 += 8) {     // the row's floats j = k * taps + t
                deepdsl_v8f v[8];
#pragma GCC unroll 8
                for (int e = 0; e < 8; ++e) {                           // (k, t) counted, as `deepdsl_block_pair`
                    memcpy(&v[e], blocks + (t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l0, sizeof v[e]);
                    if (++t == taps) t = 0, ++k;
                }
                deepdsl_transpose8(v);
                deepdsl_store8x8(rows + l0 * c * taps + j0, c * taps, v);
            }
        return;
    }
    for (int l = 0; l < DEEPDSL_BLOCK && a * DEEPDSL_BLOCK + l < o; ++l)
        for (int k = 0; k < DEEPDSL_BLOCK && b * DEEPDSL_BLOCK + k < c; ++k) {
            float* to = w + ((long)(a * DEEPDSL_BLOCK + l) * c + b * DEEPDSL_BLOCK + k) * taps;
            for (long t = 0; t < taps; ++t) to[t] = blocks[(t * DEEPDSL_BLOCK + k) * DEEPDSL_BLOCK + l];
        }
}

// w (o, c, kh, kw) = the blocked filters wb (ceil(o / 16), ceil(c / 16), kh, kw, 16 inputs, 16 outputs), dropping
// the channels past o and c, pair by pair (`deepdsl_unblocked_filter_pair`).
void deepdsl_unblocked_filters(const float* wb, int o, int c, int kh, int kw, float* w) {
    const int ob = (o + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK, cb = (c + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK;
    const long taps = (long)kh * kw;
#pragma omp parallel for collapse(2) schedule(static) if ((long)o * c * taps >= DEEPDSL_EW_PARALLEL_MIN)
    for (int a = 0; a < ob; ++a)
        for (int b = 0; b < cb; ++b)
            deepdsl_unblocked_filter_pair(wb + ((long)a * cb + b) * taps * DEEPDSL_BLOCK * DEEPDSL_BLOCK, o, c, kh, kw,
                                          a, b, w);
}

// ---------------------------------------------------------------------------------------------------------------
// The filter gradient of a thin layer of any stride (`contract.thin_filter`: a first layer on images of few channels,
// 7x7 by stride 2, 11x11 by 4, a patch embedding's 7x7 by 7), whose im2col matrix is C*kh*kw rows deep and whose
// product is too thin to run fast (ResNet-50's conv1 by im2col and the sgemm: 59 GFLOP/s): straight from the
// zero-padded input xp (m, c, hp, wp) and the blocked output gradient gb (m, ob, ho, wo, 16), its sums for 16 output
// channels a vector. An item is a group of output blocks, an input channel and a part of the kernel's taps, in parts
// of as equal sizes as can be (with AVX-512 those of each kernel row, with AVX2 those of all its kh * kw taps in row
// order: a part's sums in registers, enough of them that few fused multiply-adds wait on each other); for each sample
// and output row, each of a thread's items sums over the row's positions q the gradient's vectors of q times the
// input at its taps' offsets from stride * q (one broadcast serving each block), a partial sum in registers added to
// the item's sums in dwb (ob, c, kh, kw, 16). Every sum adds its rows' partial sums in the order of the samples and
// rows (the chunks of samples too), each lane alone: the bits depend neither on the thread count nor on the vectors'
// width.
#define DEEPDSL_THIN_KW 11              /* the widest kernel (contract.THIN_FILTER_WIDTH) */
#if defined(__AVX512F__)
#define DEEPDSL_THIN_BLOCKS 2           /* output blocks an item sums: 2 x 11 sums, 2 gradients and a broadcast */
#define DEEPDSL_THIN_TAPS 11            /* taps an item sums at most: a kernel row's */
#define DEEPDSL_THIN_FLAT 0             /* parts of kernel rows, their offsets constants */

static inline __attribute__((always_inline)) void deepdsl_thin_row(const float* x, const long* at, int stride,
                                                                   const float* g, long g_block, int wo, int OB,
                                                                   int NJ, float* sums, long sums_block) {
    __m512 acc[DEEPDSL_THIN_BLOCKS][DEEPDSL_THIN_TAPS];
    #pragma GCC unroll 2
    for (int b = 0; b < OB; ++b)
        #pragma GCC unroll 11
        for (int j = 0; j < NJ; ++j) acc[b][j] = _mm512_setzero_ps();
    for (int q = 0; q < wo; ++q) {
        const float* xq = x + (long)q * stride;
        __m512 gv[DEEPDSL_THIN_BLOCKS];
        #pragma GCC unroll 2
        for (int b = 0; b < OB; ++b) gv[b] = _mm512_loadu_ps(g + b * g_block + q * DEEPDSL_BLOCK);
        #pragma GCC unroll 11
        for (int j = 0; j < NJ; ++j) {
            const __m512 v = _mm512_set1_ps(xq[at[j]]);
            #pragma GCC unroll 2
            for (int b = 0; b < OB; ++b) acc[b][j] = _mm512_fmadd_ps(v, gv[b], acc[b][j]);
        }
    }
    #pragma GCC unroll 2
    for (int b = 0; b < OB; ++b)
        #pragma GCC unroll 11
        for (int j = 0; j < NJ; ++j) {
            float* to = sums + b * sums_block + j * DEEPDSL_BLOCK;
            _mm512_storeu_ps(to, _mm512_add_ps(_mm512_loadu_ps(to), acc[b][j]));
        }
}
#define DEEPDSL_THIN_ROWS(X) X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(1, 5) X(1, 6) X(1, 7) X(1, 8) X(1, 9) X(1, 10) \
    X(1, 11) X(2, 1) X(2, 2) X(2, 3) X(2, 4) X(2, 5) X(2, 6) X(2, 7) X(2, 8) X(2, 9) X(2, 10) X(2, 11)
#else
#define DEEPDSL_THIN_BLOCKS 1           /* AVX2: one block (two vectors) by 6 taps: 12 sums, 2 gradients, 1 broadcast */
#define DEEPDSL_THIN_TAPS 6
#define DEEPDSL_THIN_FLAT 1             /* parts of all the taps in row order: 7x7's 49 in parts of 6 and 5, where parts
                                           of each row (6 and 1, or 4 and 3) kept fewer sums (8 ms against 6 on
                                           ResNet-50's conv1); their offsets in 6 registers */

static inline __attribute__((always_inline)) void deepdsl_thin_row(const float* x, const long* at, int stride,
                                                                   const float* g, long g_block, int wo, int OB,
                                                                   int NJ, float* sums, long sums_block) {
    (void)OB; (void)g_block; (void)sums_block;
    __m256 lo[DEEPDSL_THIN_TAPS], hi[DEEPDSL_THIN_TAPS];
    #pragma GCC unroll 6
    for (int j = 0; j < NJ; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int q = 0; q < wo; ++q) {
        const float* xq = x + (long)q * stride;
        __m256 g0 = _mm256_loadu_ps(g + q * DEEPDSL_BLOCK), g1 = _mm256_loadu_ps(g + q * DEEPDSL_BLOCK + 8);
        DEEPDSL_IN_REGISTER(g0);
        DEEPDSL_IN_REGISTER(g1);
        #pragma GCC unroll 6
        for (int j = 0; j < NJ; ++j) {
            const __m256 v = _mm256_broadcast_ss(xq + at[j]);
            lo[j] = _mm256_fmadd_ps(v, g0, lo[j]);
            hi[j] = _mm256_fmadd_ps(v, g1, hi[j]);
        }
    }
    #pragma GCC unroll 6
    for (int j = 0; j < NJ; ++j) {
        float* to = sums + j * DEEPDSL_BLOCK;
        _mm256_storeu_ps(to, _mm256_add_ps(_mm256_loadu_ps(to), lo[j]));
        _mm256_storeu_ps(to + 8, _mm256_add_ps(_mm256_loadu_ps(to + 8), hi[j]));
    }
}
#define DEEPDSL_THIN_ROWS(X) X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(1, 5) X(1, 6)
#endif

// An item of `deepdsl_thin_filter`: its group of output blocks `a` (`blocks` of them), input channel `ch` and part of
// `taps` taps from tap t0 (in row order) of a kernel `kw` wide, its span's parts `each`, `fewer` taps or (the first
// `more`) one tap more.
typedef struct { int a, blocks, ch, t0, taps; } deepdsl_thin_item;

static inline deepdsl_thin_item deepdsl_thin_part(long item, int ob, int c, int kw, int parts, int each, int fewer,
                                                  int more) {
    const int a = (int)(item / ((long)c * parts)), k = (int)(item % parts % each), i = (int)(item % parts / each);
    const deepdsl_thin_item t = {a, ob - a * DEEPDSL_THIN_BLOCKS < DEEPDSL_THIN_BLOCKS ? ob - a * DEEPDSL_THIN_BLOCKS
                                                                                    : DEEPDSL_THIN_BLOCKS,
                                 (int)(item / parts % c), i * kw + k * fewer + (k < more ? k : more),
                                 fewer + (k < more)};
    return t;
}

// dwb (ob, c, kh, kw, 16 outputs) = (`first`) or += the filter gradient of a convolution by `stride` from the
// zero-padded input xp (m, c, hp, wp) and the blocked output gradient gb (m, ob, ho, wo, 16), the taps of output
// position (p, q) at xp rows stride * p + i, columns stride * q + j (inside it: its padding included). A thread takes
// an even share of the items (group of DEEPDSL_THIN_BLOCKS output blocks, input channel, part of at most
// DEEPDSL_THIN_TAPS taps); for each sample and output row it sums each of its items over the row (rows of at most
// DEEPDSL_SUM_TERMS positions at a time), the row's gradient staying in its cache over the items.
void deepdsl_thin_filter(const float* xp, const float* gb, int m, int c, int hp, int wp, int ob, int ho, int wo,
                         int kh, int kw, int stride, int first, float* dwb) {
    const int groups = (ob + DEEPDSL_THIN_BLOCKS - 1) / DEEPDSL_THIN_BLOCKS, taps = kh * kw;
    const int span = DEEPDSL_THIN_FLAT ? taps : kw, rows = DEEPDSL_THIN_FLAT ? 1 : kh;  // (parts of `span` taps)
    const int parts = rows * ((span + DEEPDSL_THIN_TAPS - 1) / DEEPDSL_THIN_TAPS), each = parts / rows;
    const int fewer = span / each, more = span % each;  // (the first `more` parts of a span one tap more)
    const long items = (long)groups * c * parts, g_block = (long)ho * wo * DEEPDSL_BLOCK;
    static const long columns[DEEPDSL_THIN_KW] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};    // (a row's offsets)
    const long sums_block = (long)taps * c * DEEPDSL_BLOCK;
#pragma omp parallel if ((long)m * ho * wo * ob * DEEPDSL_BLOCK * c * taps >= DEEPDSL_PARALLEL_MIN)
    {
        long begin, end;
        deepdsl_share(items, 1, &begin, &end);
        if (first)                          // (this thread's items' sums: each item's taps are consecutive)
            for (long item = begin; item < end; ++item) {
                const deepdsl_thin_item t = deepdsl_thin_part(item, ob, c, kw, parts, each, fewer, more);
                for (int b = 0; b < t.blocks; ++b)
                    memset(dwb + (t.a * DEEPDSL_THIN_BLOCKS + b) * sums_block + ((long)t.ch * taps + t.t0)
                                 * DEEPDSL_BLOCK, 0, sizeof(float) * t.taps * DEEPDSL_BLOCK);
            }
        for (int s = 0; s < m; ++s)
            for (int p = 0; p < ho; ++p)
                for (int q0 = 0; q0 < wo; q0 += DEEPDSL_SUM_TERMS)
                    for (long item = begin; item < end; ++item) {
                        const deepdsl_thin_item t = deepdsl_thin_part(item, ob, c, kw, parts, each, fewer, more);
                        const int n = wo - q0 < DEEPDSL_SUM_TERMS ? wo - q0 : DEEPDSL_SUM_TERMS;
                        long at[DEEPDSL_THIN_TAPS];     // the part's taps' offsets in the input from its first's
                        for (int j = 0; j < t.taps && DEEPDSL_THIN_FLAT; ++j)
                            at[j] = (long)((t.t0 + j) / kw - t.t0 / kw) * wp + (t.t0 + j) % kw - t.t0 % kw;
                        const float* x = xp + (((long)s * c + t.ch) * hp + (long)stride * p + t.t0 / kw) * wp
                                         + (long)stride * q0 + t.t0 % kw;
                        const float* g = gb + (((long)s * ob + t.a * DEEPDSL_THIN_BLOCKS) * ho + p) * wo
                                              * DEEPDSL_BLOCK + (long)q0 * DEEPDSL_BLOCK;
                        float* sums = dwb + t.a * DEEPDSL_THIN_BLOCKS * sums_block
                                      + ((long)t.ch * taps + t.t0) * DEEPDSL_BLOCK;
                        switch (t.blocks * 16 + t.taps) {
#define DEEPDSL_THIN_CASE(B, J) \
                        case B * 16 + J: \
                            deepdsl_thin_row(x, DEEPDSL_THIN_FLAT ? at : columns, stride, g, g_block, n, B, J, sums, \
                                             sums_block); \
                            break;
                        DEEPDSL_THIN_ROWS(DEEPDSL_THIN_CASE)
#undef DEEPDSL_THIN_CASE
                        default: break;
                        }
                    }
    }
}

// dw (o, c, kh, kw) = the thin filter gradient's sums dwb (ceil(o / 16), c, kh, kw, 16), dropping the channels past o.
void deepdsl_thin_filter_out(const float* dwb, int o, int c, int kh, int kw, float* dw) {
    const long taps = (long)c * kh * kw;
    for (int l = 0; l < o; ++l)
        for (long t = 0; t < taps; ++t)
            dw[l * taps + t] = dwb[((long)(l / DEEPDSL_BLOCK) * taps + t) * DEEPDSL_BLOCK + l % DEEPDSL_BLOCK];
}

#else
#define DEEPDSL_BLOCKED 0
#endif

// Whether this library has the blocked kernels (processors with AVX2 and fused multiply-adds, or AVX-512): their
// vectors' lanes (8 or 16), or 0.
int deepdsl_blocked_kernels(void) { return DEEPDSL_BLOCKED; }
