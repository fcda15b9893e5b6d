// The row passes of attention and its gradient (deepdsl.ops.attention), included by cpu_ops.c. The products run
// as every product does (deepdsl_gemm, cut by their shapes); runtime/cpu/attention.py weighs a block of queries of
// as many units (a batch index and head) as the workspace holds at a time:
//   scores = q k^T (a product into the workspace), then deepdsl_attention_weights: the scores scaled, the bias
//   added, the keys after a causal query left out, and each row's softmax, in place; out = weights v (a product);
//   the gradient recomputes the weights so, then deepdsl_attention_dscores turns the weights' gradient g v^T into the
//   scores' gradient.
// One thread computes a whole row, in a fixed order: the results do not depend on the thread count.

#if DEEPDSL_MASKED
// deepdsl_expf_poly (deepdsl_math.h) on eight lanes: n rounded by adding and subtracting 1.5 * 2^23
#if defined(__FMA__)
// (x - 0 is x, so that a vector operand costs nothing; a float is broadcast)
#define DEEPDSL_MADD8(a, b, c)                                                                                      \
    ((deepdsl_v8f)_mm256_fmadd_ps((__m256)((a) - (deepdsl_v8f){0}), (__m256)((b) - (deepdsl_v8f){0}),              \
                                  (__m256)((c) - (deepdsl_v8f){0})))
#else
#define DEEPDSL_MADD8(a, b, c) ((a) * (b) + (c))
#endif
static inline __attribute__((always_inline)) deepdsl_v8f deepdsl_exp8(deepdsl_v8f x) {
    const deepdsl_v8f big = (deepdsl_v8f){0} + 12582912.0f;
    const deepdsl_v8f t = (x * DEEPDSL_LOG2E + big) - big;
    deepdsl_v8f y;
    DEEPDSL_EXP_REDUCED(x, t, y, DEEPDSL_MADD8);
    const deepdsl_v8i n = __builtin_convertvector(t, deepdsl_v8i), half = n >> 1;
    const deepdsl_v8f a = (deepdsl_v8f)((half + 127) << 23), b = (deepdsl_v8f)((n - half + 127) << 23);
    deepdsl_v8f e = (y * a) * b;
    const deepdsl_v8f zero = {0}, inf = zero + INFINITY;
    e = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, x < DEEPDSL_EXP_LOW, zero, e);
    e = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, x > DEEPDSL_EXP_HIGH, inf, e);
    return DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, x != x, x, e);
}
#endif

// One row of deepdsl_attention_weights: its first `keys` scores scaled, the bias row b added (its keys `col` apart:
// 0 or 1), then their softmax; the scores after them 0.
static void deepdsl_att_softmax_row(float* row, long keys, long s, float scale, const float* b, long col) {
#if DEEPDSL_MASKED
    const deepdsl_v8f none = (deepdsl_v8f){0} - INFINITY;
    deepdsl_v8f top8 = none, sum8 = {0};
    for (long j = 0; j < keys; j += 8) {
        const deepdsl_v8i in = deepdsl_inside((int)j, (int)keys);
        deepdsl_v8f v = deepdsl_load_in(row + j, j, keys) * scale;
        if (b) v += col ? deepdsl_load_in(b + j, j, keys) : (deepdsl_v8f){0} + b[0];
        v = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, in, v, none);
        deepdsl_store_in(row + j, j, keys, v);
        top8 = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, v > top8, v, top8);
    }
    float top = top8[0];
    for (int l = 1; l < 8; ++l) top = top8[l] > top ? top8[l] : top;
    for (long j = 0; j < keys; j += 8) {
        const deepdsl_v8i in = deepdsl_inside((int)j, (int)keys);
        const deepdsl_v8f e = deepdsl_exp8(deepdsl_load_in(row + j, j, keys) - top);
        deepdsl_store_in(row + j, j, keys, e);
        sum8 += DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, in, e, (deepdsl_v8f){0});
    }
    float sum = sum8[0];
    for (int l = 1; l < 8; ++l) sum += sum8[l];
    const float inverse = 1.0f / sum;
    for (long j = 0; j < keys; j += 8) deepdsl_store_in(row + j, j, keys, deepdsl_load_in(row + j, j, keys) * inverse);
#else
    float top = -INFINITY, sum = 0.0f;
    for (long j = 0; j < keys; ++j) {
        row[j] = row[j] * scale + (b ? b[j * col] : 0.0f);
        top = row[j] > top ? row[j] : top;
    }
    for (long j = 0; j < keys; ++j) sum += row[j] = deepdsl_expf_poly(row[j] - top);
    const float inverse = 1.0f / sum;
    for (long j = 0; j < keys; ++j) row[j] *= inverse;
#endif
    for (long j = keys; j < s; ++j) row[j] = 0.0f;
}

// w: scores of `rows` queries (r0, r0 + 1, ...) of each of `units` units against s keys, (units, rows, s). In place:
// w * scale + bias (the bias of unit u at bias + bias_units[u], element (i, j) at i * bias_row + j * bias_col, the
// column stride 0 or 1; none when bias is NULL), keys j > i left out when causal, then each row's softmax. A row
// whose keys are all left out (or that holds a NaN) gives NaN, as the softmax of its scores does.
void deepdsl_attention_weights(float* w, long units, long rows, long s, long r0, float scale, const float* bias,
                               const long* bias_units, long bias_row, long bias_col, int causal) {
#pragma omp parallel for schedule(static) if (units * rows * s >= DEEPDSL_PARALLEL_MIN)
    for (long item = 0; item < units * rows; ++item) {
        const long u = item / rows, i = r0 + item % rows;
        const long keys = causal && i + 1 < s ? i + 1 : s;
        deepdsl_att_softmax_row(w + item * s, keys, s, scale, bias ? bias + bias_units[u] + i * bias_row : 0,
                                bias_col);
    }
}

// out = w * mask * factor (factor = 1 / keep): a block's weights kept by dropout, as deepdsl_attention_weights's
// block; mask (0 or 1) of unit u's row r0 at mask + u * mask_unit, its rows s apart. out may be w.
void deepdsl_attention_kept(const float* w, const unsigned char* mask, float* out, long units, long rows, long s,
                            long mask_unit, float factor) {
#pragma omp parallel for schedule(static) if (units * rows * s >= DEEPDSL_PARALLEL_MIN)
    for (long item = 0; item < units * rows; ++item) {
        const unsigned char* m = mask + (item / rows) * mask_unit + (item % rows) * s;
        const float* wr = w + item * s;
        float* o = out + item * s;
#pragma omp simd
        for (long j = 0; j < s; ++j) o[j] = wr[j] * (float)m[j] * factor;
    }
}

// dw = w * (dw - delta) * scale, in place over dw: the scores' gradient from the weights w and their gradient dw =
// g v^T, for the same block as deepdsl_attention_weights; delta (units, t): each query's g . out. With dropout
// (mask not NULL, as deepdsl_attention_kept's): dw = w * (dw * mask * factor - delta) * scale.
void deepdsl_attention_dscores(const float* w, float* dw, const float* delta, long units, long rows, long s, long r0,
                               long t, float scale, const unsigned char* mask, long mask_unit, float factor) {
#pragma omp parallel for schedule(static) if (units * rows * s >= DEEPDSL_PARALLEL_MIN)
    for (long item = 0; item < units * rows; ++item) {
        const float d = delta[(item / rows) * t + r0 + item % rows];
        const float* wr = w + item * s;
        float* gr = dw + item * s;
        if (mask) {
            const unsigned char* m = mask + (item / rows) * mask_unit + (item % rows) * s;
#pragma omp simd
            for (long j = 0; j < s; ++j) gr[j] = wr[j] * (gr[j] * (float)m[j] * factor - d) * scale;
            continue;
        }
#if DEEPDSL_MASKED
        for (long j = 0; j < s; j += 8)
            deepdsl_store_in(gr + j, j, s, deepdsl_load_in(wr + j, j, s) * (deepdsl_load_in(gr + j, j, s) - d) * scale);
#else
        for (long j = 0; j < s; ++j) gr[j] = wr[j] * (gr[j] - d) * scale;
#endif
    }
}

// Attention of small units, each whole on one thread with nothing but its own arrays on the stack: queries and keys of
// at most DEEPDSL_ATTENTION_UNIT of at most as many features (the units contract.attention_in_units gives these
// kernels). Where the products of such units go through the BLAS one unit at a time, its calls cost more than their
// arithmetic (a ViT's 16 tokens of 16 features a head). A unit's weights are held transposed, a query's in a lane of
// its own, so that its softmax needs no sum across the lanes of a vector. Each sum below adds in one order, the lanes
// of a vector being other outputs: the bits depend on neither the thread count nor the vector width (AVX2 and AVX-512
// give the same), and they differ from the BLAS's products and the row passes above by rounding only. A unit's arrays:
// q (t, d), k (s, d), v (s, e), out (t, e), its bias and mask as deepdsl_attention_weights's and
// deepdsl_attention_kept's (rows s apart). The arrays of a unit's own whose rows run over its queries (its weights
// transposed, q^T, g^T) hold whole vectors of 8 floats a row, zeros past the last query (deepdsl_att_width): their
// passes take no masked loads or stores (slow on AMD's processors), and the products writing them no copy of a partial
// strip of b; the padding's lanes never reach an output.
#define DEEPDSL_ATTENTION_UNIT 64      /* contract.ATTENTION_UNIT */
#define DEEPDSL_ATTENTION_TILE (DEEPDSL_ATTENTION_UNIT * DEEPDSL_ATTENTION_UNIT)

// the floats of a row of a unit's arrays over its t queries: t rounded up to whole vectors of 8
static inline long deepdsl_att_width(long t) { return (t + 7) / 8 * 8; }

// out (m, n; rows ldc apart) = a b, n at most DEEPDSL_ATTENTION_UNIT: out[i, j] = the sum over c < k of
// a[i * a_row + c * a_col] * b[c * ldb + j], c in order, by multiply-adds from zero. With the matrix
// products' tiles (deepdsl_sg_tile: AVX2 and fused multiply-adds, or AVX-512), six rows of a at a time against a
// strip of b's columns, whose sums stay in registers while c runs; b's rows are copied into `pad`'s wider ones (k
// rows of a whole number of vectors) where they end inside a vector, so that no load reaches past b. Each lane sums
// alone: the bits are the same with vectors of 16 floats and of 8.
static void deepdsl_att_product(const float* a, long a_row, long a_col, const float* b, long ldb, long m, long k,
                                long n, float* out, long ldc, float* pad) {
#ifdef DEEPDSL_SG_LANES
    const long vectors = (n + DEEPDSL_SG_LANES - 1) / DEEPDSL_SG_LANES;
    if (n % DEEPDSL_SG_LANES) {
        const long width = vectors * DEEPDSL_SG_LANES;
        deepdsl_sg_rows(b, ldb, k, n, width, width, pad);
        b = pad;
        ldb = width;
    }
    for (long j0 = 0; j0 < n; j0 += DEEPDSL_SG_WIDTH) {
        const long columns = n - j0 < DEEPDSL_SG_WIDTH ? n - j0 : DEEPDSL_SG_WIDTH;
        const int V = (int)((columns + DEEPDSL_SG_LANES - 1) / DEEPDSL_SG_LANES);
        const int partial = columns % DEEPDSL_SG_LANES != 0;
        const deepdsl_sg_m last = deepdsl_sg_mask(columns - (V - 1) * DEEPDSL_SG_LANES);
        for (long i = 0; i < m; i += DEEPDSL_SG_ROWS) {
            const int R = (int)(m - i < DEEPDSL_SG_ROWS ? m - i : DEEPDSL_SG_ROWS);
            deepdsl_sg_tile_any(R, V, k, a + i * a_row, a_row, a_col, b + j0, ldb, partial, last,
                                out + i * ldc + j0, ldc, 0, NULL);
        }
    }
#else
    (void)pad;          // (fused where the processor has fused multiply-adds: DEEPDSL_FMAF)
    for (long i = 0; i < m; ++i) {
        float* o = out + i * ldc;
        for (long j = 0; j < n; ++j) o[j] = 0.0f;
        for (long c = 0; c < k; ++c) {
            const float x = a[i * a_row + c * a_col];
            for (long j = 0; j < n; ++j) o[j] = DEEPDSL_FMAF(o[j], x, b[c * ldb + j]);
        }
    }
#endif
}

// The softmax of each column of x (s, n), n a multiple of 8, in place: a column's maximum, then exp(x - maximum)
// (deepdsl_exp8: deepdsl_expf_poly's bits) summed over the rows in order, then x times 1 / sum; eight columns at a
// time, their maxima and sums in a vector each (max_ps(v, top) is v > top ? v : top, as the scalar loop's).
static void deepdsl_att_softmax_columns(float* x, long s, long n) {
#if DEEPDSL_MASKED
    for (long l = 0; l < n; l += 8) {
        deepdsl_v8f top = (deepdsl_v8f){0} - INFINITY, sum = {0};
        for (long j = 0; j < s; ++j)
            top = (deepdsl_v8f)_mm256_max_ps((__m256)deepdsl_load8(x + j * n + l), (__m256)top);
        for (long j = 0; j < s; ++j) {
            const deepdsl_v8f e = deepdsl_exp8(deepdsl_load8(x + j * n + l) - top);
            sum += e;
            memcpy(x + j * n + l, &e, sizeof e);
        }
        const deepdsl_v8f inverse = 1.0f / sum;
        for (long j = 0; j < s; ++j) {
            const deepdsl_v8f w = deepdsl_load8(x + j * n + l) * inverse;
            memcpy(x + j * n + l, &w, sizeof w);
        }
    }
#else
    for (long i = 0; i < n; ++i) {
        float top = -INFINITY, sum = 0.0f;
        for (long j = 0; j < s; ++j) top = x[j * n + i] > top ? x[j * n + i] : top;
        for (long j = 0; j < s; ++j) sum += x[j * n + i] = deepdsl_expf_poly(x[j * n + i] - top);
        const float inverse = 1.0f / sum;
        for (long j = 0; j < s; ++j) x[j * n + i] *= inverse;
    }
#endif
}

// One unit's weights, transposed: wt (s, tp: tp = deepdsl_att_width(t)), wt[j, i] the weight of key j for query i:
// the scores k q^T scaled, the bias added, the keys after a causal query left out, and each query's softmax over
// its keys; with a mask m: mt = m^T * factor (0 or factor: wt * mt rounds as (wt * m) * factor does) and kept = wt *
// mt. A query's lanes are its own: its maximum and sum run over the keys in order, whatever the vectors' width.
// The lanes past t hold the softmax of zeros (mt and kept: 0). qt: scratch (d, tp). q's and k's rows ld apart.
static void deepdsl_att_unit_weights(const float* q, const float* k, long ld, long t, long s, long d, float scale,
                                     const float* b, long bias_row, long bias_col, int causal,
                                     const unsigned char* m, float factor, float* qt, float* wt, float* mt,
                                     float* kept, float* pad) {
    const long tp = deepdsl_att_width(t);
    deepdsl_transpose_into(q, t, d, ld, qt, tp);
    deepdsl_att_product(k, ld, 1, qt, tp, s, d, tp, wt, tp, pad);
    for (long j = 0; j < s; ++j) {
        float* r = wt + j * tp;
#pragma omp simd
        for (long i = 0; i < tp; ++i) r[i] *= scale;
        if (b) {
            for (long i = 0; i < t; ++i) r[i] += b[i * bias_row + j * bias_col];
        }
        if (causal) {                                 // key j after queries i < j
            const long after = j < t ? j : t;
            const deepdsl_v8f none = (deepdsl_v8f){0} - INFINITY;
            long i = 0;
            for (; i + 8 <= after; i += 8) memcpy(r + i, &none, sizeof none);
            for (; i < after; ++i) r[i] = -INFINITY;
        }
    }
    deepdsl_att_softmax_columns(wt, s, tp);
    if (m) {                                          // m * factor in kept (t, s), then transposed into mt
#pragma omp simd
        for (long x = 0; x < t * s; ++x) kept[x] = (float)m[x] * factor;
        deepdsl_transpose_into(kept, t, s, s, mt, tp);
#pragma omp simd
        for (long x = 0; x < s * tp; ++x) kept[x] = wt[x] * mt[x];
    }
}

// Where a unit's arrays start and how far apart its rows are: units one after the other (heads 0), or the units
// (n, h) of arrays stored (N, rows, H, width), their rows H * width apart (attention's `heads`: a projection's
// output reshaped, read and written in place of its transposes).
static inline long deepdsl_att_base(long u, long heads, long rows, long width) {
    return heads ? ((u / heads) * rows * heads + u % heads) * width : u * rows * width;
}
static inline long deepdsl_att_ld(long heads, long width) { return heads ? heads * width : width; }

// out = (softmax(q k^T * scale + bias) [* mask * factor]) v for each of `units` units (their arrays one after the
// other, or with `heads`, as deepdsl_att_base places them). Returns 0, computing nothing, where a size exceeds
// DEEPDSL_ATTENTION_UNIT.
int deepdsl_attention_units(const float* q, const float* k, const float* v, float* out, long units, long t, long s,
                            long d, long e, long heads, float scale, const float* bias, const long* bias_units,
                            long bias_row, long bias_col, int causal, const unsigned char* mask, long mask_unit,
                            float factor) {
    const long most = DEEPDSL_ATTENTION_UNIT;
    if (t > most || s > most || d > most || e > most) return 0;
    const long ld = deepdsl_att_ld(heads, d), le = deepdsl_att_ld(heads, e);
#pragma omp parallel for schedule(static) if (units * t * s * (d + e) >= DEEPDSL_PARALLEL_MIN)
    for (long u = 0; u < units; ++u) {
        float qt[DEEPDSL_ATTENTION_TILE], wt[DEEPDSL_ATTENTION_TILE], mt[DEEPDSL_ATTENTION_TILE];
        float kept[DEEPDSL_ATTENTION_TILE], pad[DEEPDSL_ATTENTION_TILE];
        const unsigned char* m = mask ? mask + u * mask_unit : 0;
        deepdsl_att_unit_weights(q + deepdsl_att_base(u, heads, t, d), k + deepdsl_att_base(u, heads, s, d), ld, t, s,
                                 d, scale, bias ? bias + bias_units[u] : 0, bias_row, bias_col, causal, m, factor,
                                 qt, wt, mt, kept, pad);
        deepdsl_att_product(m ? kept : wt, 1, deepdsl_att_width(t), v + deepdsl_att_base(u, heads, s, e), le, t, s,
                            e, out + deepdsl_att_base(u, heads, t, e), le, pad);                // out = w v
    }
    return 1;
}

// The gradient of deepdsl_attention_units: dq (units, t, d), dk (units, s, d), dv (units, s, e) (placed as q, k and
// v are) from its output o and o's gradient g, the weights recomputed as the forward computes them (the same
// bits). delta, each query's g . o, sums its features in order; then as deepdsl_attention_dscores: ds = w * (g v^T
// [* mask * factor] - delta) * scale; dq = ds k, dk = ds^T q, dv = (w [* mask * factor])^T g. Returns 0 as
// deepdsl_attention_units.
int deepdsl_attention_units_grad(const float* q, const float* k, const float* v, const float* o, const float* g,
                                 float* dq, float* dk, float* dv, long units, long t, long s, long d, long e,
                                 long heads, float scale, const float* bias, const long* bias_units, long bias_row,
                                 long bias_col, int causal, const unsigned char* mask, long mask_unit, float factor) {
    const long most = DEEPDSL_ATTENTION_UNIT;
    if (t > most || s > most || d > most || e > most) return 0;
    const long ld = deepdsl_att_ld(heads, d), le = deepdsl_att_ld(heads, e);
#pragma omp parallel for schedule(static) if (units * t * s * (d + e) >= DEEPDSL_PARALLEL_MIN)
    for (long u = 0; u < units; ++u) {
        float qt[DEEPDSL_ATTENTION_TILE], wt[DEEPDSL_ATTENTION_TILE], mt[DEEPDSL_ATTENTION_TILE];
        float kept[DEEPDSL_ATTENTION_TILE], dst[DEEPDSL_ATTENTION_TILE], pad[DEEPDSL_ATTENTION_TILE];
        float delta[DEEPDSL_ATTENTION_UNIT];
        const long at_q = deepdsl_att_base(u, heads, t, d), at_k = deepdsl_att_base(u, heads, s, d);
        const long at_o = deepdsl_att_base(u, heads, t, e), at_v = deepdsl_att_base(u, heads, s, e);
        const float *qu = q + at_q, *ku = k + at_k, *vu = v + at_v, *gu = g + at_o, *ou = o + at_o;
        const unsigned char* m = mask ? mask + u * mask_unit : 0;
        deepdsl_att_unit_weights(qu, ku, ld, t, s, d, scale, bias ? bias + bias_units[u] : 0, bias_row, bias_col,
                                 causal, m, factor, qt, wt, mt, kept, pad);
        const long tp = deepdsl_att_width(t);
        deepdsl_att_product(m ? kept : wt, tp, 1, gu, le, s, t, e, dv + at_v, le, pad);         // dv = w^T g
        deepdsl_transpose_into(gu, t, e, le, qt, tp);                                         // (q^T is read no more)
        deepdsl_att_product(vu, le, 1, qt, tp, s, e, tp, dst, tp, pad);                      // (g v^T)^T = v g^T
        for (long i = 0; i < tp; ++i) delta[i] = 0.0f;
        for (long c = 0; c < e; ++c) {
            const float* gc = qt + c * tp;                                                   // g^T's row c
#pragma omp simd
            for (long i = 0; i < t; ++i) delta[i] += gc[i] * ou[i * le + c];
        }
        for (long j = 0; j < s; ++j) {
            const float* wr = wt + j * tp;
            float* r = dst + j * tp;
            if (m) {
                const float* mr = mt + j * tp;
#pragma omp simd
                for (long i = 0; i < tp; ++i) r[i] = wr[i] * (r[i] * mr[i] - delta[i]) * scale;
            } else {
#pragma omp simd
                for (long i = 0; i < tp; ++i) r[i] = wr[i] * (r[i] - delta[i]) * scale;
            }
        }
        deepdsl_att_product(dst, 1, tp, ku, ld, t, s, d, dq + at_q, ld, pad);                // dq = ds k
        deepdsl_att_product(dst, tp, 1, qu, ld, s, t, d, dk + at_k, ld, pad);                // dk = ds^T q
    }
    return 1;
}
