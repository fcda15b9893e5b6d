// Scaled dot-product attention and its gradient (deepdsl.ops.attention), included by cpu_ops.c.
//
// out = softmax(q k^T * scale + bias) v for each unit (a batch index and head) of queries q (T, d), keys k (S, d)
// and values v (S, e); `causal`: query i weighs keys 0..i only. The forward weighs a tile of DEEPDSL_ATT_ROWS
// queries against tiles of DEEPDSL_ATT_COLS keys with an online softmax (the running maximum and sum of each row,
// the partial output rescaled when the maximum grows: FlashAttention's method), so no (T, S) matrix is stored; the
// gradient recomputes a tile's weights from its rows' log-sum-exp (a first pass over the keys) and the rows' sums
// dO . O. Scratch is on the stack (tiles of at most DEEPDSL_ATT_MAX_WIDTH features); the plan's workspace is
// numpy's kernel's.
//
// A bias is read through per-unit offsets and row and column strides (0 where it broadcasts). A key left out (a
// causal key after the query, a bias of -inf) weighs exactly 0; a row with every key left out gives NaN, as the
// softmax of its scores does.
//
// Threads: the forward splits (unit, query tile) items, the gradient whole units (a unit's key and value gradients
// add up over its query tiles in order). Every output is summed by one thread in a fixed order: the results do not
// depend on the thread count.

#define DEEPDSL_ATT_ROWS 16
#define DEEPDSL_ATT_COLS 64
#define DEEPDSL_ATT_MAX_WIDTH 256

// The attention's view of one unit's bias: element (i, j) at bias[i * row + j * col]; NULL without a bias.
typedef struct {
    const float* bias;
    long row, col;
} deepdsl_att_bias;

// scores[r][c] = (q[i0 + r] . k[j0 + c]) * scale + bias(i0 + r, j0 + c) for r < rows, c < cols; -inf where the key
// is left out (causal, past the keys); `kt` receives the key tile transposed (d by DEEPDSL_ATT_COLS).
static void deepdsl_att_scores(const float* q, const float* k, deepdsl_att_bias b, long d, long i0, long rows,
                               long j0, long cols, float scale, int causal, float* kt, float* scores) {
    for (long t = 0; t < d; ++t)
        for (long c = 0; c < cols; ++c) kt[t * DEEPDSL_ATT_COLS + c] = k[(j0 + c) * d + t];
    for (long r = 0; r < rows; ++r) {
        float* sr = scores + r * DEEPDSL_ATT_COLS;
        const float* qr = q + (i0 + r) * d;
#pragma omp simd
        for (long c = 0; c < cols; ++c) sr[c] = 0.0f;
        for (long t = 0; t < d; ++t) {
            const float x = qr[t];
            const float* kr = kt + t * DEEPDSL_ATT_COLS;
#pragma omp simd
            for (long c = 0; c < cols; ++c) sr[c] += x * kr[c];
        }
        if (b.bias) {
            const float* br = b.bias + (i0 + r) * b.row + j0 * b.col;
#pragma omp simd
            for (long c = 0; c < cols; ++c) sr[c] = sr[c] * scale + br[c * b.col];
        } else {
#pragma omp simd
            for (long c = 0; c < cols; ++c) sr[c] *= scale;
        }
        if (causal)
            for (long c = (i0 + r + 1 > j0 ? i0 + r + 1 - j0 : 0); c < cols; ++c) sr[c] = -INFINITY;
    }
}

// The keys a tile of queries i0 .. i0 + rows weighs: all, or those up to its last query's.
static inline long deepdsl_att_keys(long s, int causal, long i0, long rows) {
    return causal ? (i0 + rows < s ? i0 + rows : s) : s;
}

// The running maximum m and sum l of a row's exponentials after the scores sr[0 .. cols); returns the factor that
// rescales what was summed before (0 or 1 where nothing was).
static inline float deepdsl_att_online(float* sr, long cols, float* m, float* l, int keep_weights) {
    float top = -INFINITY;
    for (long c = 0; c < cols; ++c) top = deepdsl_maxf(top, sr[c]);
    const float grown = deepdsl_maxf(*m, top);
    if (grown == -INFINITY) {           // every key so far left out
        if (keep_weights)
            for (long c = 0; c < cols; ++c) sr[c] = 0.0f;
        return 1.0f;
    }
    const float alpha = expf(*m - grown);
    float sum = 0.0f;
    for (long c = 0; c < cols; ++c) {
        const float p = expf(sr[c] - grown);
        if (keep_weights) sr[c] = p;
        sum += p;
    }
    *l = *l * alpha + sum;
    *m = grown;
    return alpha;
}

void deepdsl_attention(const float* q, const float* k, const float* v, const float* bias, const long* bias_units,
                       long bias_row, long bias_col, long units, long t, long s, long d, long e, float scale,
                       int causal, float* out) {
    const long tiles = (t + DEEPDSL_ATT_ROWS - 1) / DEEPDSL_ATT_ROWS;
#pragma omp parallel for schedule(static) if (units * t * s * (d + e) >= DEEPDSL_PARALLEL_MIN)
    for (long item = 0; item < units * tiles; ++item) {
        const long u = item / tiles, i0 = (item % tiles) * DEEPDSL_ATT_ROWS;
        const long rows = t - i0 < DEEPDSL_ATT_ROWS ? t - i0 : DEEPDSL_ATT_ROWS;
        const float *qu = q + u * t * d, *ku = k + u * s * d, *vu = v + u * s * e;
        const deepdsl_att_bias b = {bias ? bias + bias_units[u] : 0, bias_row, bias_col};
        float kt[d * DEEPDSL_ATT_COLS], scores[DEEPDSL_ATT_ROWS * DEEPDSL_ATT_COLS], acc[DEEPDSL_ATT_ROWS * e];
        float m[DEEPDSL_ATT_ROWS], l[DEEPDSL_ATT_ROWS];
        for (long r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
        for (long x = 0; x < rows * e; ++x) acc[x] = 0.0f;
        const long keys = deepdsl_att_keys(s, causal, i0, rows);
        for (long j0 = 0; j0 < keys; j0 += DEEPDSL_ATT_COLS) {
            const long cols = keys - j0 < DEEPDSL_ATT_COLS ? keys - j0 : DEEPDSL_ATT_COLS;
            deepdsl_att_scores(qu, ku, b, d, i0, rows, j0, cols, scale, causal, kt, scores);
            for (long r = 0; r < rows; ++r) {
                float* sr = scores + r * DEEPDSL_ATT_COLS;
                float* ar = acc + r * e;
                const float alpha = deepdsl_att_online(sr, cols, m + r, l + r, 1);
                if (alpha != 1.0f) {
#pragma omp simd
                    for (long x = 0; x < e; ++x) ar[x] *= alpha;
                }
                for (long c = 0; c < cols; ++c) {
                    const float p = sr[c];
                    const float* vr = vu + (j0 + c) * e;
#pragma omp simd
                    for (long x = 0; x < e; ++x) ar[x] += p * vr[x];
                }
            }
        }
        for (long r = 0; r < rows; ++r) {
            float* orow = out + (u * t + i0 + r) * e;
            const float* ar = acc + r * e;
            const float sum = l[r];
#pragma omp simd
            for (long x = 0; x < e; ++x) orow[x] = ar[x] / sum;
        }
    }
}

// out = dq, dk, dv one after the other (units * t * d, units * s * d, units * s * e floats) of attention with output
// o and output gradient g.
void deepdsl_attention_grad(const float* q, const float* k, const float* v, const float* o, const float* g,
                            const float* bias, const long* bias_units, long bias_row, long bias_col, long units,
                            long t, long s, long d, long e, float scale, int causal, float* out) {
    float* dq_all = out;
    float* dk_all = out + units * t * d;
    float* dv_all = dk_all + units * s * d;
#pragma omp parallel for schedule(static) if (units * t * s * (d + e) >= DEEPDSL_PARALLEL_MIN)
    for (long u = 0; u < units; ++u) {
        const float *qu = q + u * t * d, *ku = k + u * s * d, *vu = v + u * s * e, *ou = o + u * t * e,
                    *gu = g + u * t * e;
        float *dq = dq_all + u * t * d, *dk = dk_all + u * s * d, *dv = dv_all + u * s * e;
        const deepdsl_att_bias b = {bias ? bias + bias_units[u] : 0, bias_row, bias_col};
        float kt[d * DEEPDSL_ATT_COLS], vt[e * DEEPDSL_ATT_COLS];
        float p[DEEPDSL_ATT_ROWS * DEEPDSL_ATT_COLS], dp[DEEPDSL_ATT_ROWS * DEEPDSL_ATT_COLS];
        float lse[DEEPDSL_ATT_ROWS], delta[DEEPDSL_ATT_ROWS];
        for (long x = 0; x < t * d; ++x) dq[x] = 0.0f;
        for (long x = 0; x < s * d; ++x) dk[x] = 0.0f;
        for (long x = 0; x < s * e; ++x) dv[x] = 0.0f;
        for (long i0 = 0; i0 < t; i0 += DEEPDSL_ATT_ROWS) {
            const long rows = t - i0 < DEEPDSL_ATT_ROWS ? t - i0 : DEEPDSL_ATT_ROWS;
            const long keys = deepdsl_att_keys(s, causal, i0, rows);
            // the rows' log-sum-exp, a first pass over the keys; the rows' dO . O
            float m[DEEPDSL_ATT_ROWS], l[DEEPDSL_ATT_ROWS];
            for (long r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
            for (long j0 = 0; j0 < keys; j0 += DEEPDSL_ATT_COLS) {
                const long cols = keys - j0 < DEEPDSL_ATT_COLS ? keys - j0 : DEEPDSL_ATT_COLS;
                deepdsl_att_scores(qu, ku, b, d, i0, rows, j0, cols, scale, causal, kt, p);
                for (long r = 0; r < rows; ++r) deepdsl_att_online(p + r * DEEPDSL_ATT_COLS, cols, m + r, l + r, 0);
            }
            for (long r = 0; r < rows; ++r) {
                lse[r] = m[r] + logf(l[r]);
                const float *gr = gu + (i0 + r) * e, *orow = ou + (i0 + r) * e;
                float sum = 0.0f;
                for (long x = 0; x < e; ++x) sum += gr[x] * orow[x];
                delta[r] = sum;
            }
            for (long j0 = 0; j0 < keys; j0 += DEEPDSL_ATT_COLS) {
                const long cols = keys - j0 < DEEPDSL_ATT_COLS ? keys - j0 : DEEPDSL_ATT_COLS;
                deepdsl_att_scores(qu, ku, b, d, i0, rows, j0, cols, scale, causal, kt, p);
                for (long x = 0; x < e; ++x)
                    for (long c = 0; c < cols; ++c) vt[x * DEEPDSL_ATT_COLS + c] = vu[(j0 + c) * e + x];
                for (long r = 0; r < rows; ++r) {
                    float *pr = p + r * DEEPDSL_ATT_COLS, *dpr = dp + r * DEEPDSL_ATT_COLS;
                    const float* gr = gu + (i0 + r) * e;
                    const float top = lse[r], dr = delta[r];
                    for (long c = 0; c < cols; ++c) pr[c] = pr[c] == -INFINITY ? 0.0f : expf(pr[c] - top);
#pragma omp simd
                    for (long c = 0; c < cols; ++c) dpr[c] = 0.0f;
                    for (long x = 0; x < e; ++x) {          // dp = g v^T
                        const float gx = gr[x];
                        const float* vr = vt + x * DEEPDSL_ATT_COLS;
#pragma omp simd
                        for (long c = 0; c < cols; ++c) dpr[c] += gx * vr[c];
                    }
#pragma omp simd
                    for (long c = 0; c < cols; ++c) dpr[c] = pr[c] * (dpr[c] - dr) * scale;   // the scores' gradient
                }
                for (long c = 0; c < cols; ++c) {            // dv += p^T g, dk += ds^T q
                    float *dvr = dv + (j0 + c) * e, *dkr = dk + (j0 + c) * d;
                    for (long r = 0; r < rows; ++r) {
                        const float pc = p[r * DEEPDSL_ATT_COLS + c], sc = dp[r * DEEPDSL_ATT_COLS + c];
                        const float *gr = gu + (i0 + r) * e, *qr = qu + (i0 + r) * d;
#pragma omp simd
                        for (long x = 0; x < e; ++x) dvr[x] += pc * gr[x];
#pragma omp simd
                        for (long x = 0; x < d; ++x) dkr[x] += sc * qr[x];
                    }
                }
                for (long r = 0; r < rows; ++r) {            // dq += ds k
                    float* dqr = dq + (i0 + r) * d;
                    for (long c = 0; c < cols; ++c) {
                        const float sc = dp[r * DEEPDSL_ATT_COLS + c];
                        const float* kr = ku + (j0 + c) * d;
#pragma omp simd
                        for (long x = 0; x < d; ++x) dqr[x] += sc * kr[x];
                    }
                }
            }
        }
    }
}
