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
static inline __attribute__((always_inline)) deepdsl_v8f deepdsl_exp8(deepdsl_v8f x) {
    const deepdsl_v8f big = (deepdsl_v8f){0} + 12582912.0f;
    const deepdsl_v8f t = (x * DEEPDSL_LOG2E + big) - big;
    deepdsl_v8f y;
    DEEPDSL_EXP_REDUCED(x, t, y);
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
        deepdsl_v8f v = deepdsl_load(row + j, in) * scale;
        if (b) v += col ? deepdsl_load(b + j, in) : (deepdsl_v8f){0} + b[0];
        v = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, in, v, none);
        deepdsl_store(row + j, in, v);
        top8 = DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, v > top8, v, top8);
    }
    float top = top8[0];
    for (int l = 1; l < 8; ++l) top = top8[l] > top ? top8[l] : top;
    for (long j = 0; j < keys; j += 8) {
        const deepdsl_v8i in = deepdsl_inside((int)j, (int)keys);
        const deepdsl_v8f e = deepdsl_exp8(deepdsl_load(row + j, in) - top);
        deepdsl_store(row + j, in, e);
        sum8 += DEEPDSL_SELECT(deepdsl_v8f, deepdsl_v8i, in, e, (deepdsl_v8f){0});
    }
    float sum = sum8[0];
    for (int l = 1; l < 8; ++l) sum += sum8[l];
    const float inverse = 1.0f / sum;
    for (long j = 0; j < keys; j += 8) {
        const deepdsl_v8i in = deepdsl_inside((int)j, (int)keys);
        deepdsl_store(row + j, in, deepdsl_load(row + j, in) * inverse);
    }
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
        for (long j = 0; j < s; j += 8) {
            const deepdsl_v8i in = deepdsl_inside((int)j, (int)s);
            deepdsl_store(gr + j, in, deepdsl_load(wr + j, in) * (deepdsl_load(gr + j, in) - d) * scale);
        }
#else
        for (long j = 0; j < s; ++j) gr[j] = wr[j] * (gr[j] - d) * scale;
#endif
    }
}
