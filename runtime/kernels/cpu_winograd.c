// Winograd's minimal filtering F(4x4, 3x3) on channel-blocked data, included by cpu_ops.c after cpu_blocked.c (whose
// tiles compute its products): a stride-1 3x3 convolution padded by 1 of many channels (a residual network's 3x3
// layers, forward, input and filter gradients) with 36 multiplications for each 4 x 4 outputs of a channel pair where
// the direct sums take 144 (Lavin and Gray, "Fast algorithms for convolutional neural networks", CVPR 2016).
// runtime/cpu/conv.py takes this path where `contract.winograd_conv` says so and the planned workspace holds its
// arrays (`contract.winograd_scratch`).
//
// With d a 6 x 6 patch of one input channel (4 x 4 outputs apart), g a 3 x 3 filter and the transforms B, G, A below,
// the 4 x 4 outputs are A^T [(G g G^T) . (B^T d B)] A, the product taken element by element: each of the 36 points
// xi of the transformed tile is a matrix product over the channels, U[xi] (outputs x inputs) times V[xi] (inputs x
// tiles), and the outputs are the inverse transform of those products. On the blocked layout:
//
//   U (36, ob, cb, 16 inputs, 16 outputs)  the filters transformed straight from their own layout
//                                           (`deepdsl_winograd_transform`), DEEPDSL_WINO_SKEW floats past each point,
//                                           a range of output blocks at a time (`contract.winograd_blocks`);
//   V (36, cb, T, 16)                       the input's tiles transformed, T = m * ceil(Ho / 4) * ceil(Wo / 4)
//                                           tiles, tile t = (sample * rows of tiles + row) * columns + column;
//   M (36, range's ob, T, 16)               their products: for each xi a product of the blocked tiles of
//                                           cpu_blocked.c (kh = kw = 1, the tiles as positions), over the input
//                                           channels in partial sums of DEEPDSL_SUM_TERMS products added in order;
//   out (m, O, Ho, Wo)                      the inverse transform of each tile's 36 products (+ bias), written to the
//                                           plain output 8 x 8 at a time through `deepdsl_blocked_out`.
//
// Every transform is the same sequence of vector operations on 16 channels whatever the vectors' width (GCC's
// vectors of 16 floats: one AVX-512 register or two AVX2 ones), and the products' lanes sum alone, so AVX-512 and
// AVX2 give the same bits. Threads split tiles, output blocks and points, never a sum: the bits do not depend on the
// thread count. Rows and columns of a tile past the padded input read zeros, and its outputs past Ho and Wo are
// dropped. The rounding differs from the direct sums' (the transforms' constants and sums), within float32's
// tolerance for a 3x3 filter: tests/test_blocked_conv.py bounds it.
//
// The filter gradient is the transpose of that map: for the same tiles, dg = G^T [(A y A^T) . (B^T d B)] G, y a tile's
// 4 x 4 output gradients, summed over the tiles. Each point is a product over the tiles, Y[xi] (outputs x tiles) by
// V[xi] (tiles x inputs), computed by the blocked filter gradient's register tiles (cpu_blocked.c, a 1x1 kernel whose
// positions are the tiles), and the gradient is the inverse transform of each channel pair's 36 sums:
//
//   Y (36, range's ob, T, 16)               the output gradient's tiles transformed (blocked first, zeros past it);
//   S (36, range's ob, cb, 16 in, 16 out)   their sums over the tiles (`deepdsl_winograd_filter_sums`), in partial
//                                           sums of whole samples (at most DEEPDSL_SUM_TERMS tiles, one sample at
//                                           least) added in order, over the chunks of samples in order;
//   dwb (ob, cb, 3, 3, 16 in, 16 out)       G^T S G of each pair (`deepdsl_winograd_filter_out`), the blocked
//                                           filters' layout, which `deepdsl_unblocked_filters` writes out.
//
// Where the whole batch's transformed tiles fit (`contract.winograd_pairs`), S would be written and read back for
// every chunk, for a few products a float where the tiles are few: `deepdsl_winograd_filter_pairs` keeps each
// pair's 36 sums on its thread's stack over the whole batch and writes the pair's gradient out at once, with the
// same bits.

#ifdef DEEPDSL_TILE
#define DEEPDSL_WINOGRAD 1
#define DEEPDSL_WINO_OUT 4              /* outputs of a tile along each axis */
#define DEEPDSL_WINO_POINTS 36          /* points of a transformed tile */
#define DEEPDSL_WINO_SKEW 16            /* floats past each point's transformed filters (contract.WINOGRAD_SKEW):
                                           the transform's 36 stores of an input channel fall in 36 sets of L1, not
                                           in one (a point's filters are a multiple of 4 KB) */
#define DEEPDSL_WINO_SPAN 16            /* tiles of a row written at a time: 64 outputs, 16 KB of the stack */

typedef float deepdsl_v16f __attribute__((vector_size(64)));
// (built without AVX-512, GCC warns that returning such a vector changes the ABI: deepdsl_load16 is inlined, so no
// call returns one; vectors are stored with memcpy)
#pragma GCC diagnostic ignored "-Wpsabi"

static inline deepdsl_v16f deepdsl_load16(const float* from) {
    deepdsl_v16f v;
    memcpy(&v, from, sizeof v);
    return v;
}

// The vectors the tiles' transforms compute in, a register each: a block's 16 channels with AVX-512, else half of
// them, each half transformed alone (with AVX2 vectors of 16 floats in two registers each, the transforms' unrolled
// loops had spilled and ran slower than rolled ones; halves unrolled run 6 % faster over ResNet-50's 3x3 layers);
// lane by lane the same operations, so the same bits on either. Their short loops unrolled.
#if defined(__AVX512F__)
typedef deepdsl_v16f deepdsl_wv;
#define DEEPDSL_WV 16
#else
typedef deepdsl_v8f deepdsl_wv;
#define DEEPDSL_WV 8
#endif

static inline deepdsl_wv deepdsl_load_wv(const float* from) {
    deepdsl_wv v;
    memcpy(&v, from, sizeof v);
    return v;
}


// t = B^T d for six vectors d, B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
// 0 4 0 -5 0 1]
static inline void deepdsl_wino_input6(const deepdsl_wv d[6], deepdsl_wv t[6]) {
    const deepdsl_wv a = d[4] - d[2], b = d[3] - d[1];
    t[0] = (d[0] * 4.0f - d[2] * 5.0f) + d[4];
    t[1] = (d[3] + d[4]) - (d[1] + d[2]) * 4.0f;
    t[2] = (d[4] - d[3]) + (d[1] - d[2]) * 4.0f;
    t[3] = a + b * 2.0f;
    t[4] = a - b * 2.0f;
    t[5] = (d[1] * 4.0f - d[3] * 5.0f) + d[5];
}

// u = G g for three vectors g, G = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1]
// (the sixths as products by float(1/6): a division each would cost more than the products' loads)
static inline __attribute__((always_inline)) void deepdsl_wino_filter3(const deepdsl_wv g[3], deepdsl_wv u[6]) {
    const float sixth = 1.0f / 6.0f;
    const deepdsl_wv ends = g[0] + g[2], quarter = g[0] * 0.25f + g[2], half = g[1] * 0.5f;
    u[0] = g[0] * 0.25f;
    u[1] = (ends + g[1]) * -sixth;
    u[2] = (ends - g[1]) * -sixth;
    u[3] = (quarter + half) * sixth;
    u[4] = (quarter - half) * sixth;
    u[5] = g[2];
}

// y = A^T m for six vectors m, A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
static inline void deepdsl_wino_output6(const deepdsl_wv m[6], deepdsl_wv y[4]) {
    const deepdsl_wv a = m[1] + m[2], b = m[1] - m[2], c = m[3] + m[4], e = m[3] - m[4];
    y[0] = (m[0] + a) + c;
    y[1] = b + e * 2.0f;
    y[2] = a + c * 4.0f;
    y[3] = (b + e * 8.0f) + m[5];
}

// t = A y for four vectors y (the transpose of A^T above): the output gradient's side of the filter gradient
static inline void deepdsl_wino_gradient4(const deepdsl_wv y[4], deepdsl_wv t[6]) {
    const deepdsl_wv even = y[0] + y[2], odd = y[1] + y[3];
    const deepdsl_wv even4 = y[0] + y[2] * 4.0f, odd8 = y[1] * 2.0f + y[3] * 8.0f;
    t[0] = y[0];
    t[1] = even + odd;
    t[2] = even - odd;
    t[3] = even4 + odd8;
    t[4] = even4 - odd8;
    t[5] = y[3];
}

// w = G^T s for six vectors s (the transpose of G above): a pair's 36 sums back to the 3 x 3 filter gradient
static inline void deepdsl_wino_filter_grad6(const deepdsl_wv s[6], deepdsl_wv w[3]) {
    const float sixth = 1.0f / 6.0f, twelfth = 1.0f / 12.0f, twenty_fourth = 1.0f / 24.0f;
    const deepdsl_wv inner = s[1] + s[2], outer = s[3] + s[4];
    w[0] = (s[0] * 0.25f - inner * sixth) + outer * twenty_fourth;
    w[1] = (s[2] - s[1]) * sixth + (s[3] - s[4]) * twelfth;
    w[2] = (outer - inner) * sixth + s[5];
}

// The 36 points of G g G^T of each filter of the pair of blocks (output block a, input block b) of the convolution
// whose filters are w (o, c, 3, 3) (`flip`: of its input gradient, `deepdsl_blocked_filter_pair`), point xi's
// (16 inputs, 16 outputs) at to + xi * point: the pair blocked on the stack first (9 KB), then each input
// channel's 36 points computed in registers and stored to the points' rows. AVX2's 16 registers do not hold a
// filter's 18 vectors of G g (they spilled: the transform took more than half of a 4x4 layer's time): there each
// row of G g is made alone for 8 output channels, from the filter's 9 vectors, and transformed at once.
static inline void deepdsl_wino_transform_pair(const float* w, int o, int c, int flip, int a, int b, float* to,
                                               long point) {
    const long tile = DEEPDSL_BLOCK * DEEPDSL_BLOCK;
    float blocks[9 * DEEPDSL_BLOCK * DEEPDSL_BLOCK];
    deepdsl_blocked_filter_pair(w, o, c, 3, 3, flip, a, b, blocks);
#if !defined(__AVX512F__)
    for (int k = 0; k < DEEPDSL_BLOCK; ++k)
        for (int h = 0; h < DEEPDSL_BLOCK; h += 8) {
            deepdsl_v8f g[9];                     // g[i * 3 + j]: the filter's row i, column j
            #pragma GCC unroll 9
            for (int t = 0; t < 9; ++t) memcpy(&g[t], blocks + t * tile + k * DEEPDSL_BLOCK + h, sizeof g[t]);
            #pragma GCC unroll 6
            for (int i = 0; i < 6; ++i) {
                deepdsl_v8f row[3];               // row i of G g: point i of each column's transform (the other
                #pragma GCC unroll 3              // points' operations, never read, are left out by the compiler)
                for (int j = 0; j < 3; ++j) {
                    const deepdsl_v8f column[3] = {g[j], g[3 + j], g[6 + j]};
                    deepdsl_v8f t[6];
                    deepdsl_wino_filter3(column, t);
                    row[j] = t[i];
                }
                deepdsl_v8f u[6];
                deepdsl_wino_filter3(row, u);
                #pragma GCC unroll 6
                for (int j = 0; j < 6; ++j)
                    memcpy(to + (i * 6 + j) * point + k * DEEPDSL_BLOCK + h, &u[j], sizeof u[j]);
            }
        }
#else
    for (int k = 0; k < DEEPDSL_BLOCK; ++k) {
        const float* g = blocks + k * DEEPDSL_BLOCK;
        deepdsl_v16f rows[6][3];              // G g: the filter's columns transformed, [row point][column]
        #pragma GCC unroll 3
        for (int j = 0; j < 3; ++j) {
            const deepdsl_v16f column[3] = {deepdsl_load16(g + j * tile), deepdsl_load16(g + (3 + j) * tile),
                                            deepdsl_load16(g + (6 + j) * tile)};
            deepdsl_v16f t[6];
            deepdsl_wino_filter3(column, t);
            #pragma GCC unroll 6
            for (int i = 0; i < 6; ++i) rows[i][j] = t[i];
        }
        #pragma GCC unroll 6
        for (int i = 0; i < 6; ++i) {
            deepdsl_v16f t[6];
            deepdsl_wino_filter3(rows[i], t);
            #pragma GCC unroll 6
            for (int j = 0; j < 6; ++j) memcpy(to + (i * 6 + j) * point + k * DEEPDSL_BLOCK, &t[j], sizeof t[j]);
        }
    }
#endif
}

// U (36, b1 - b0, ib, 16, 16) = G g G^T of each filter of output blocks [b0, b1) of the convolution whose filters
// are w (o, c, 3, 3) (`flip`: of its input gradient), ib its blocks of inputs, 16 output channels at a time: a
// thread takes whole pairs of blocks (`deepdsl_wino_transform_pair`), whose points' rows DEEPDSL_WINO_SKEW spreads
// over 36 sets of L1.
void deepdsl_winograd_transform(const float* w, int o, int c, int flip, int b0, int b1, float* u) {
    const int ib = ((flip ? o : c) + DEEPDSL_BLOCK - 1) / DEEPDSL_BLOCK;
    const long pairs = (long)(b1 - b0) * ib, tile = DEEPDSL_BLOCK * DEEPDSL_BLOCK;
    const long point = pairs * tile + DEEPDSL_WINO_SKEW;
#pragma omp parallel for schedule(static) if (pairs * 9 * tile >= DEEPDSL_EW_PARALLEL_MIN)
    for (long pair = 0; pair < pairs; ++pair)
        deepdsl_wino_transform_pair(w, o, c, flip, b0 + (int)(pair / ib), (int)(pair % ib), u + pair * tile, point);
}

// V[.][c][t] = B^T d B of the tile t's 6 x 6 patch d of channel block c of xb (m, cb, hp, wp, 16), rows p0 .. and
// columns q0 .. of the padded input (zeros past it).
static inline void deepdsl_wino_input_tile(const float* xc, int hp, int wp, int p0, int q0, long points, float* v) {
    const deepdsl_wv zero = {0};
    for (int h = 0; h < DEEPDSL_BLOCK; h += DEEPDSL_WV) {
        deepdsl_wv cols[6][6];                // B^T d: the patch's columns transformed, [row][column]
        #pragma GCC unroll 6
        for (int j = 0; j < 6; ++j) {
            deepdsl_wv d[6];
            #pragma GCC unroll 6
            for (int i = 0; i < 6; ++i)
                d[i] = p0 + i < hp && q0 + j < wp
                    ? deepdsl_load_wv(xc + ((long)(p0 + i) * wp + q0 + j) * DEEPDSL_BLOCK + h) : zero;
            deepdsl_wv t[6];
            deepdsl_wino_input6(d, t);
            #pragma GCC unroll 6
            for (int a = 0; a < 6; ++a) cols[a][j] = t[a];
        }
        #pragma GCC unroll 6
        for (int a = 0; a < 6; ++a) {
            deepdsl_wv t[6];
            deepdsl_wino_input6(cols[a], t);
            #pragma GCC unroll 6
            for (int b = 0; b < 6; ++b) memcpy(v + (a * 6 + b) * points + h, &t[b], sizeof t[b]);
        }
    }
}

// V (36, cb, T, 16) = the transformed tiles of the blocked, padded input xb (m, cb, hp, wp, 16) (th x tw tiles a
// sample): this thread's share of (sample, channel block, row of tiles), a worksharing loop of the enclosing
// parallel region, its implicit barrier at the end.
static inline void deepdsl_wino_inputs(const float* xb, int m, int cb, int hp, int wp, int th, int tw, float* v) {
    const long tiles = (long)m * th * tw, x_block = (long)hp * wp * DEEPDSL_BLOCK;
    const long v_point = (long)cb * tiles * DEEPDSL_BLOCK;
#pragma omp for schedule(static)
    for (long item = 0; item < (long)m * cb * th; ++item) {
        const int s = (int)(item / ((long)cb * th)), c = (int)(item / th % cb), ty = (int)(item % th);
        const float* xc = xb + ((long)s * cb + c) * x_block;
        for (int tx = 0; tx < tw; ++tx) {
            const long t = ((long)s * th + ty) * tw + tx;
            deepdsl_wino_input_tile(xc, hp, wp, ty * DEEPDSL_WINO_OUT, tx * DEEPDSL_WINO_OUT, v_point,
                                    v + ((long)c * tiles + t) * DEEPDSL_BLOCK);
        }
    }
}

// The outputs of a tile (4 x 4 positions of 16 channels) from its 36 products m (`points` floats apart): A^T m A,
// into rows (4 rows `row` floats apart, the tile's first position at column 0).
static inline void deepdsl_wino_output_tile(const float* m, long points, float* rows, long row) {
    for (int h = 0; h < DEEPDSL_BLOCK; h += DEEPDSL_WV) {
        deepdsl_wv cols[4][6];                // A^T m: the products' columns transformed, [row][column]
        #pragma GCC unroll 6
        for (int j = 0; j < 6; ++j) {
            deepdsl_wv p[6], y[4];
            #pragma GCC unroll 6
            for (int i = 0; i < 6; ++i) p[i] = deepdsl_load_wv(m + (i * 6 + j) * points + h);
            deepdsl_wino_output6(p, y);
            #pragma GCC unroll 4
            for (int a = 0; a < 4; ++a) cols[a][j] = y[a];
        }
        #pragma GCC unroll 4
        for (int a = 0; a < 4; ++a) {
            deepdsl_wv y[4];
            deepdsl_wino_output6(cols[a], y);
            #pragma GCC unroll 4
            for (int b = 0; b < 4; ++b) memcpy(rows + a * row + b * DEEPDSL_BLOCK + h, &y[b], sizeof y[b]);
        }
    }
}

// The outputs of row ty of tiles of sample s (th x tw tiles a sample) of one output block, its first channel
// `channel`, into out (m, o, ho, wo) + bias (o) when given: the inverse transform of each tile's 36 products (tile t's
// at products + t * 16, `points` floats apart), DEEPDSL_WINO_SPAN tiles at a time through the stack.
static inline void deepdsl_wino_outputs(const float* products, long points, int s, int ty, int th, int tw, int ho,
                                        int wo, int channel, int o, const float* bias, float* out) {
    const long plane = (long)ho * wo;
    float rows[DEEPDSL_WINO_OUT][DEEPDSL_WINO_SPAN * DEEPDSL_WINO_OUT * DEEPDSL_BLOCK];
    for (int tx0 = 0; tx0 < tw; tx0 += DEEPDSL_WINO_SPAN) {
        const int span = tw - tx0 < DEEPDSL_WINO_SPAN ? tw - tx0 : DEEPDSL_WINO_SPAN;
        for (int tx = tx0; tx < tx0 + span; ++tx) {
            const long t = ((long)s * th + ty) * tw + tx;
            deepdsl_wino_output_tile(products + t * DEEPDSL_BLOCK, points,
                                     &rows[0][(tx - tx0) * DEEPDSL_WINO_OUT * DEEPDSL_BLOCK],
                                     DEEPDSL_WINO_SPAN * DEEPDSL_WINO_OUT * DEEPDSL_BLOCK);
        }
        const int q0 = tx0 * DEEPDSL_WINO_OUT;
        const int n = wo - q0 < span * DEEPDSL_WINO_OUT ? wo - q0 : span * DEEPDSL_WINO_OUT;
        for (int y = 0; y < DEEPDSL_WINO_OUT && ty * DEEPDSL_WINO_OUT + y < ho; ++y)
            deepdsl_blocked_out(rows[y], 1, n, 0, channel, o, plane, bias,
                                out + ((long)s * o + channel) * plane + (long)(ty * DEEPDSL_WINO_OUT + y) * wo + q0);
    }
}

// Output blocks [b0, b1) of out (m, o, ho, wo) = the stride-1 3x3 convolution of the blocked, padded input xb (m, cb,
// hp, wp, 16) (ho = hp - 2, wo = wp - 2) with those blocks' filters transformed by `deepdsl_winograd_transform` (u, 36
// points of (b1 - b0, cb, 16, 16), each followed by DEEPDSL_WINO_SKEW floats), + bias (o) when given, through v (36,
// cb, T, 16) and products (36, b1 - b0, T, 16) of the caller's workspace; `transformed`: v already holds xb's tiles (an
// earlier range of the same chunk). Three passes, each split among the threads: the tiles' transforms by (sample,
// channel block, row of tiles); the products by output block groups (`deepdsl_tile_groups` over the T tiles as one
// row), each group's points and then its runs of tiles, so that one point's filters of a group stay in the cache over
// the tiles; the outputs by (sample, output block, row of tiles).
void deepdsl_winograd_conv(const float* xb, const float* u, const float* bias, int m, int cb, int hp, int wp, int o,
                           int b0, int b1, int transformed, float* v, float* products, float* out) {
    const int ob = b1 - b0, ho = hp - 2, wo = wp - 2;
    const int th = (ho + DEEPDSL_WINO_OUT - 1) / DEEPDSL_WINO_OUT, tw = (wo + DEEPDSL_WINO_OUT - 1) / DEEPDSL_WINO_OUT;
    const long tiles = (long)m * th * tw;
    const long v_point = (long)cb * tiles * DEEPDSL_BLOCK, m_point = (long)ob * tiles * DEEPDSL_BLOCK;
    const long u_block = (long)cb * DEEPDSL_BLOCK * DEEPDSL_BLOCK, u_point = ob * u_block + DEEPDSL_WINO_SKEW;
    const deepdsl_groups g = deepdsl_tile_groups(ob, (int)tiles);
    const int group = deepdsl_sum_blocks(1, 1);
#pragma omp parallel if (tiles * ob * DEEPDSL_BLOCK * cb * DEEPDSL_BLOCK * DEEPDSL_WINO_POINTS >= DEEPDSL_PARALLEL_MIN)
    {
        if (!transformed) deepdsl_wino_inputs(xb, m, cb, hp, wp, th, tw, v);
        long first, last;                   // (the implicit barrier above: every tile transformed)
        deepdsl_group_share(g, DEEPDSL_WINO_POINTS * tiles, ob, &first, &last);
        while (first < last) {
            const long per = DEEPDSL_WINO_POINTS * tiles;
            const int a = (int)(first / per), a0 = deepdsl_group_start(g, a);
            const int blocks = deepdsl_group_start(g, a + 1) - a0, runs = deepdsl_row_tiles(blocks, (int)tiles);
            const long xi = first % per / tiles, start = first % tiles;
            const long end_tile = last - (first - start) < tiles ? last - (first - start) : tiles;
            // this point's runs of tiles that begin in [start, end_tile): run r is [r * T / runs, (r + 1) * T / runs)
            for (int r = 0; r < runs; ++r) {
                const long q = (long)r * tiles / runs, n = (long)(r + 1) * tiles / runs - q;
                if (q < start || q >= end_tile) continue;
                const float* x = v + xi * v_point + q * DEEPDSL_BLOCK;
                const float* w = u + xi * u_point + a0 * u_block;
                float* to = products + xi * m_point + ((long)a0 * tiles + q) * DEEPDSL_BLOCK;
                for (int c0 = 0; c0 < cb; c0 += group)
                    for (int part = 0; part < deepdsl_tile_parts(blocks); ++part)
                        deepdsl_blocked_tile_pass(x + (long)c0 * tiles * DEEPDSL_BLOCK,
                                                  w + (long)c0 * DEEPDSL_BLOCK * DEEPDSL_BLOCK, u_block,
                                                  cb - c0 < group ? cb - c0 : group, 1, 1, tiles * DEEPDSL_BLOCK, 0,
                                                  blocks, (int)n, part, c0 > 0, to, tiles * DEEPDSL_BLOCK);
            }
            first += end_tile - start;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long item = 0; item < (long)m * ob * th; ++item) {
            const int s = (int)(item / ((long)ob * th)), b = (int)(item / th % ob), ty = (int)(item % th);
            deepdsl_wino_outputs(products + (long)b * tiles * DEEPDSL_BLOCK, m_point, s, ty, th, tw, ho, wo,
                                 (b0 + b) * DEEPDSL_BLOCK, o, bias, out);
        }
    }
}

// Y[.][b][t] = A y A^T of the tile t's 4 x 4 positions y of one block of the blocked output gradient gc (ho, wo,
// 16), rows p0 .. and columns q0 .. (zeros past ho and wo), `points` floats apart.
static inline void deepdsl_wino_gradient_tile(const float* gc, int ho, int wo, int p0, int q0, long points, float* y) {
    const deepdsl_wv zero = {0};
    for (int h = 0; h < DEEPDSL_BLOCK; h += DEEPDSL_WV) {
        deepdsl_wv cols[6][4];                // A y: the tile's columns transformed, [row point][column]
        #pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            deepdsl_wv d[4], t[6];
            #pragma GCC unroll 4
            for (int i = 0; i < 4; ++i)
                d[i] = p0 + i < ho && q0 + j < wo
                    ? deepdsl_load_wv(gc + ((long)(p0 + i) * wo + q0 + j) * DEEPDSL_BLOCK + h) : zero;
            deepdsl_wino_gradient4(d, t);
            #pragma GCC unroll 6
            for (int a = 0; a < 6; ++a) cols[a][j] = t[a];
        }
        #pragma GCC unroll 6
        for (int a = 0; a < 6; ++a) {
            deepdsl_wv t[6];
            deepdsl_wino_gradient4(cols[a], t);
            #pragma GCC unroll 6
            for (int b = 0; b < 6; ++b) memcpy(y + (a * 6 + b) * points + h, &t[b], sizeof t[b]);
        }
    }
}

// Y (36, b1 - b0, T, 16) = the transformed tiles of output blocks [b0, b1) of the blocked output gradient gb (m, ob,
// ho, wo, 16) (th x tw tiles a sample): this thread's share of (sample, output block, row of tiles), a worksharing
// loop of the enclosing parallel region, its implicit barrier at the end.
static inline void deepdsl_wino_gradients(const float* gb, int m, int ob, int b0, int b1, int ho, int wo, int th,
                                          int tw, float* y) {
    const int blocks = b1 - b0;
    const long tiles = (long)m * th * tw, g_block = (long)ho * wo * DEEPDSL_BLOCK;
    const long y_point = (long)blocks * tiles * DEEPDSL_BLOCK;
#pragma omp for schedule(static)
    for (long item = 0; item < (long)m * blocks * th; ++item) {
        const int s = (int)(item / ((long)blocks * th)), b = (int)(item / th % blocks), ty = (int)(item % th);
        const float* gc = gb + ((long)s * ob + b0 + b) * g_block;
        for (int tx = 0; tx < tw; ++tx) {
            const long t = ((long)s * th + ty) * tw + tx;
            deepdsl_wino_gradient_tile(gc, ho, wo, ty * DEEPDSL_WINO_OUT, tx * DEEPDSL_WINO_OUT, y_point,
                                       y + ((long)b * tiles + t) * DEEPDSL_BLOCK);
        }
    }
}

// sums (36, b1 - b0, cb, 16 inputs, 16 outputs) = (`first`) or += the sums over a chunk's tiles of Winograd's filter
// gradient for output blocks [b0, b1) of a stride-1 3x3 convolution: from the blocked, padded input xb (m, cb, hp,
// wp, 16) (ho = hp - 2, wo = wp - 2) and the blocked output gradient gb (m, ob, ho, wo, 16), through v (36, cb, T,
// 16; `transformed`: already xb's tiles) and y (36, b1 - b0, T, 16) of the caller's workspace. Three passes split
// among the threads: the input's tiles as the forward's; the output gradient's by (sample, output block, row of
// tiles); the sums by items (group of output blocks, point, input block), a thread's items contiguous, so that a
// group's transformed gradients stay in its cache over the input blocks. Each sum adds its tiles' products in
// partial sums of whole samples (`deepdsl_blocked_filter_sums` with the samples as rows of tiles: as many as
// DEEPDSL_SUM_TERMS tiles hold, one at least), added in order.
void deepdsl_winograd_filter_sums(const float* xb, const float* gb, int m, int cb, int hp, int wp, int ob, int b0,
                                  int b1, int transformed, int first, float* v, float* y, float* sums) {
    const int blocks = b1 - b0, ho = hp - 2, wo = wp - 2;
    const int th = (ho + DEEPDSL_WINO_OUT - 1) / DEEPDSL_WINO_OUT, tw = (wo + DEEPDSL_WINO_OUT - 1) / DEEPDSL_WINO_OUT;
    const long per_sample = (long)th * tw, tiles = m * per_sample;
    const long v_point = (long)cb * tiles * DEEPDSL_BLOCK, y_point = (long)blocks * tiles * DEEPDSL_BLOCK;
    const long tile = DEEPDSL_BLOCK * DEEPDSL_BLOCK;
    const deepdsl_groups g = deepdsl_even_groups(blocks, (blocks + DEEPDSL_FILTER_BLOCKS - 1) / DEEPDSL_FILTER_BLOCKS);
#pragma omp parallel if (tiles * blocks * cb * tile * DEEPDSL_WINO_POINTS >= DEEPDSL_PARALLEL_MIN)
    {
        if (!transformed) deepdsl_wino_inputs(xb, m, cb, hp, wp, th, tw, v);
        deepdsl_wino_gradients(gb, m, ob, b0, b1, ho, wo, th, tw, y);
        long begin, end;                    // (the implicit barriers above: every tile transformed)
        deepdsl_group_share(g, (long)DEEPDSL_WINO_POINTS * cb, blocks, &begin, &end);
        for (long item = begin; item < end; ++item) {
            const int a = (int)(item / ((long)DEEPDSL_WINO_POINTS * cb)), a0 = deepdsl_group_start(g, a);
            const int count = deepdsl_group_start(g, a + 1) - a0;
            const long xi = item / cb % DEEPDSL_WINO_POINTS, c = item % cb;
            float* to = sums + ((xi * blocks + a0) * cb + c) * tile;
            if (first)
                for (int b = 0; b < count; ++b) memset(to + (long)b * cb * tile, 0, sizeof(float) * tile);
            // one "sample" whose rows are the chunk's samples, each a row of its tiles
            deepdsl_blocked_filter_sums(v + xi * v_point + c * tiles * DEEPDSL_BLOCK, per_sample * DEEPDSL_BLOCK, 0,
                                        y + xi * y_point + (long)a0 * tiles * DEEPDSL_BLOCK, tiles * DEEPDSL_BLOCK, 0,
                                        1, m, (int)per_sample, count, to, (long)cb * tile);
        }
    }
}

// A pair's 3 x 3 filter gradient (3, 3, 16 inputs, 16 outputs) = G^T S G of its 36 sums S (16 x 16 each, `points`
// floats apart), a transform's vector of output channels at a time (`deepdsl_wv`).
static inline void deepdsl_wino_filter_pair(const float* sums, long points, float* dw) {
    const long tile = DEEPDSL_BLOCK * DEEPDSL_BLOCK;
    for (int k = 0; k < DEEPDSL_BLOCK; ++k)
        for (int h = 0; h < DEEPDSL_BLOCK; h += DEEPDSL_WV) {
            deepdsl_wv rows[3][6];                // G^T S over the row points, [kernel row][column point]
            #pragma GCC unroll 6
            for (int b = 0; b < 6; ++b) {
                deepdsl_wv s[6], w[3];
                #pragma GCC unroll 6
                for (int a = 0; a < 6; ++a)
                    s[a] = deepdsl_load_wv(sums + (a * 6 + b) * points + k * DEEPDSL_BLOCK + h);
                deepdsl_wino_filter_grad6(s, w);
                #pragma GCC unroll 3
                for (int i = 0; i < 3; ++i) rows[i][b] = w[i];
            }
            #pragma GCC unroll 3
            for (int i = 0; i < 3; ++i) {
                deepdsl_wv w[3];
                deepdsl_wino_filter_grad6(rows[i], w);
                #pragma GCC unroll 3
                for (int j = 0; j < 3; ++j)
                    memcpy(dw + (i * 3 + j) * tile + k * DEEPDSL_BLOCK + h, &w[j], sizeof w[j]);
            }
        }
}

// dwb (ob, cb, 3, 3, 16 inputs, 16 outputs) = G^T S G of each block pair's 36 sums S (sums (36, ob, cb, 16, 16), from
// `deepdsl_winograd_filter_sums`): the blocked filter gradient, a pair's 36 points gathered on the stack first (36 KB,
// each read whole: read in place, the transform's loads went to 36 places a point's stride apart, 16 % of a
// 512-channel layer's filter gradient on two threads).
void deepdsl_winograd_filter_out(const float* sums, int ob, int cb, float* dwb) {
    const long pairs = (long)ob * cb, tile = DEEPDSL_BLOCK * DEEPDSL_BLOCK;
#pragma omp parallel for schedule(static) if (pairs * DEEPDSL_WINO_POINTS * tile >= DEEPDSL_EW_PARALLEL_MIN)
    for (long pair = 0; pair < pairs; ++pair) {
        float points[DEEPDSL_WINO_POINTS][DEEPDSL_BLOCK * DEEPDSL_BLOCK];
        for (int xi = 0; xi < DEEPDSL_WINO_POINTS; ++xi)
            memcpy(points[xi], sums + (xi * pairs + pair) * tile, sizeof points[xi]);
        deepdsl_wino_filter_pair(points[0], tile, dwb + pair * 9 * tile);
    }
}

#if !defined(__AVX512F__)
// AVX2: input channels [k0, k0 + IC) of `deepdsl_wino_pair_point`'s sums (IC a constant: its sums in registers).
static inline __attribute__((always_inline)) void deepdsl_wino_pair_part(const float* v, const float* y, long tiles,
                                                                         long group, int k0, int IC, float* sums) {
    for (long t0 = 0; t0 < tiles; t0 += group) {
        __m256 lo[6], hi[6];
        #pragma GCC unroll 6
        for (int k = 0; k < IC; ++k) lo[k] = hi[k] = _mm256_setzero_ps();
        for (long t = t0; t < tiles && t < t0 + group; ++t) {
            __m256 g0 = _mm256_loadu_ps(y + t * DEEPDSL_BLOCK), g1 = _mm256_loadu_ps(y + t * DEEPDSL_BLOCK + 8);
            DEEPDSL_IN_REGISTER(g0);
            DEEPDSL_IN_REGISTER(g1);
            #pragma GCC unroll 6
            for (int k = 0; k < IC; ++k) {
                const __m256 b = _mm256_broadcast_ss(v + t * DEEPDSL_BLOCK + k0 + k);
                lo[k] = _mm256_fmadd_ps(b, g0, lo[k]);
                hi[k] = _mm256_fmadd_ps(b, g1, hi[k]);
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
#endif

// sums (16 inputs x 16 outputs) = the sum over `tiles` tiles of one point's products of a pair of blocks, v[t][k] by
// y[t][0..15] for input channel k: from zero, partial sums of `group` tiles (whole samples) in fused multiply-adds
// from zero, each added in order: the products and partial sums of `deepdsl_blocked_filter_sums` over the batch as
// one chunk, so the same bits (AVX2: input channels 6, 6 and 4 at a time, two halves each, as its AVX2 sums).
static inline void deepdsl_wino_pair_point(const float* v, const float* y, long tiles, long group, float* sums) {
    memset(sums, 0, sizeof(float) * DEEPDSL_BLOCK * DEEPDSL_BLOCK);
#if defined(__AVX512F__)
    for (long t0 = 0; t0 < tiles; t0 += group) {
        __m512 acc[DEEPDSL_BLOCK];
        #pragma GCC unroll 16
        for (int k = 0; k < DEEPDSL_BLOCK; ++k) acc[k] = _mm512_setzero_ps();
        for (long t = t0; t < tiles && t < t0 + group; ++t) {
            const __m512 g = _mm512_loadu_ps(y + t * DEEPDSL_BLOCK);
            #pragma GCC unroll 16
            for (int k = 0; k < DEEPDSL_BLOCK; ++k)
                acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(v[t * DEEPDSL_BLOCK + k]), g, acc[k]);
        }
        #pragma GCC unroll 16
        for (int k = 0; k < DEEPDSL_BLOCK; ++k) {
            float* to = sums + k * DEEPDSL_BLOCK;
            _mm512_storeu_ps(to, _mm512_add_ps(_mm512_loadu_ps(to), acc[k]));
        }
    }
#else
    deepdsl_wino_pair_part(v, y, tiles, group, 0, 6, sums);
    deepdsl_wino_pair_part(v, y, tiles, group, 6, 6, sums);
    deepdsl_wino_pair_part(v, y, tiles, group, 12, 4, sums);
#endif
}

// dw (o, c, 3, 3) = Winograd's filter gradient of a stride-1 3x3 convolution from a whole batch at once, where its
// transformed tiles fit (`contract.winograd_pairs`: a range's sums, written and read back for every chunk, cost more
// than the whole batch's tiles held): from the blocked, padded input xb (m, cb, hp, wp, 16) and the blocked output
// gradient gb (m, ob, ho, wo, 16), through v (36, cb, T, 16) and y (36, ob, T, 16) of the caller's workspace. The
// tiles transformed as `deepdsl_winograd_filter_sums` does, then each pair of blocks by one thread: its 36 sums on
// the stack (36 KB, `deepdsl_wino_pair_point`: that function's sums and partial sums over the batch as one chunk),
// G^T S G at once (9 KB), written out as `deepdsl_unblocked_filters` writes the blocked gradient. The same bits as
// the sums, `deepdsl_winograd_filter_out` and the unblocking.
void deepdsl_winograd_filter_pairs(const float* xb, const float* gb, int m, int cb, int hp, int wp, int ob, int o,
                                   int c, float* v, float* y, float* dw) {
    const int ho = hp - 2, wo = wp - 2;
    const int th = (ho + DEEPDSL_WINO_OUT - 1) / DEEPDSL_WINO_OUT, tw = (wo + DEEPDSL_WINO_OUT - 1) / DEEPDSL_WINO_OUT;
    const long per_sample = (long)th * tw, tiles = m * per_sample, tile = DEEPDSL_BLOCK * DEEPDSL_BLOCK;
    const long group = (per_sample >= DEEPDSL_SUM_TERMS ? 1 : DEEPDSL_SUM_TERMS / per_sample) * per_sample;
    const long v_point = (long)cb * tiles * DEEPDSL_BLOCK, y_point = (long)ob * tiles * DEEPDSL_BLOCK;
#pragma omp parallel if (tiles * ob * cb * tile * DEEPDSL_WINO_POINTS >= DEEPDSL_PARALLEL_MIN)
    {
        deepdsl_wino_inputs(xb, m, cb, hp, wp, th, tw, v);
        deepdsl_wino_gradients(gb, m, ob, 0, ob, ho, wo, th, tw, y);
#pragma omp for schedule(static)
        for (long pair = 0; pair < (long)ob * cb; ++pair) {
            const long a = pair / cb, c_block = pair % cb;
            float sums[DEEPDSL_WINO_POINTS][DEEPDSL_BLOCK * DEEPDSL_BLOCK];
            for (int xi = 0; xi < DEEPDSL_WINO_POINTS; ++xi)
                deepdsl_wino_pair_point(v + xi * v_point + c_block * tiles * DEEPDSL_BLOCK,
                                        y + xi * y_point + a * tiles * DEEPDSL_BLOCK, tiles, group, sums[xi]);
            float blocks[9 * DEEPDSL_BLOCK * DEEPDSL_BLOCK];
            deepdsl_wino_filter_pair(sums[0], tile, blocks);
            deepdsl_unblocked_filter_pair(blocks, o, c, 3, 3, (int)a, (int)c_block, dw);
        }
    }
}

#else
#define DEEPDSL_WINOGRAD 0
#endif

// Whether this library has the Winograd kernels (those of the blocked convolutions): 1 or 0.
int deepdsl_winograd_kernels(void) { return DEEPDSL_WINOGRAD; }
