// The generic kernels of the CUDA backend (deepdsl_runtime.cuda): every op of the IR except matrix products
// (cuBLAS, or gemm.cu) and the fused elementwise expressions (generated per network, generated/<net>.cu).
//
// Semantics are those of the CPU backend (deepdsl_runtime.cpu), including the order in which window sums add up,
// so most results agree bit for bit and the rest (exp, log, pow, GEMM) to float32 rounding. Each kernel is a
// DEEPDSL_HD function of one output element, row or column plus a __global__ wrapper; the wrappers' launch
// geometry is computed by deepdsl_runtime.cuda.layout. See deepdsl_common.cuh for why the functions compile on
// the host too.
//
// Aliasing the memory plan allows, and how the kernels honour it:
// - softmax, log_softmax, lrn, lrn_bwd may write over their first input: one thread owns a whole row (softmax) or
//   a whole channel column (LRN) and reads every value it needs of its input before it overwrites it (LRN keeps
//   the window in a ring).
// - layer_norm_grad may write over its output gradient g: one thread owns a whole row, and reads each value of the
//   row before it overwrites it.
// - elementwise kernels may write over an input of the output's shape: each thread reads its element first.
// - pooling may write its output over its dying input from the same start ("takes over"): the launcher then runs
//   the *_range kernels over sample ranges that cannot race, and the *_ordered kernels (one block, tiles in
//   order, read then write) where no such range exists (deepdsl_runtime.cuda.layout.takeover_waves).
#include "deepdsl_common.cuh"

#ifdef __CUDA_ARCH__
#define DEEPDSL_FMUL(a, b) __fmul_rn((a), (b))
#define DEEPDSL_FADD(a, b) __fadd_rn((a), (b))
#else
#define DEEPDSL_FMUL(a, b) ((a) * (b))
#define DEEPDSL_FADD(a, b) ((a) + (b))
#endif

#define DEEPDSL_LRN_MAX_SIZE 16
#define DEEPDSL_ORDERED_THREADS 1024

// ---------------------------------------------------------------------------------------------------------------
// filling and copying

DEEPDSL_HD void deepdsl_fill_u32_at(unsigned i, unsigned* out, unsigned bits) { out[i] = bits; }
DEEPDSL_HD void deepdsl_fill_u8_at(unsigned i, deepdsl_u8* out, unsigned value) {
    out[i] = static_cast<deepdsl_u8>(value);
}

// dst[r * dst_pitch + c] = src[r * src_pitch + c] for r < rows, c < cols (concat, slice, pad_axis): elements of
// type T (4-byte words or bytes)
template <typename T>
DEEPDSL_HD void deepdsl_copy2d_at(unsigned i, unsigned cols, const T* src, unsigned src_pitch, T* dst,
                                  unsigned dst_pitch) {
    const unsigned r = i / cols, c = i % cols;
    dst[r * dst_pitch + c] = src[r * src_pitch + c];
}

// broadcast_to: the identity with broadcasting (the elementwise machinery of deepdsl_common.cuh)
template <int ND>
DEEPDSL_HD void deepdsl_broadcast_at(unsigned i, const EwShape& s, float* out, const EwArg& a) {
    out[i] = EwIndex<ND>(s, i).load(a);
}

// (A, B, S) -> (B, A, S): gradients regrouped by channel for the filter gradient's single GEMM
DEEPDSL_HD void deepdsl_swap01_at(unsigned i, unsigned a, unsigned b, unsigned s, const float* src, float* dst) {
    const unsigned k = i % s, t = i / s, ai = t % a, bi = t / a;    // i indexes dst (bi, ai, k)
    dst[i] = src[(ai * b + bi) * s + k];
}

// (P, A, M, B, R) -> (P, B, M, A, R): two axes of a tensor swapped (attention's heads and tokens); i indexes dst
DEEPDSL_HD void deepdsl_transpose_at(unsigned i, unsigned a, unsigned m, unsigned b, unsigned r, const float* src,
                                     float* dst) {
    const unsigned k = i % r;
    unsigned t = i / r;
    const unsigned ai = t % a;
    t /= a;
    const unsigned mi = t % m;
    t /= m;
    const unsigned bi = t % b, pi = t / b;
    dst[i] = src[(((pi * a + ai) * m + mi) * b + bi) * r + k];
}

// out[n, o, :] += bias[o] for out (N, O, S)
DEEPDSL_HD void deepdsl_add_bias_at(unsigned i, unsigned o, unsigned s, const float* bias, float* out) {
    out[i] += bias[(i / s) % o];
}

// ---------------------------------------------------------------------------------------------------------------
// sum_to: the runtime collapses the reduction to out[b] = sum over a, c of x[(a * B + b) * C + c] (a leading and a
// trailing summed block around the kept one) or, for other patterns, to up to four dimensions with a mask of the
// summed ones (deepdsl_runtime.cuda.layout.sum_plan).

// thread `lane` of `lanes` (threadIdx.y of blockDim.y) adds rows lane, lane + lanes, ... of column b (C == 1)
DEEPDSL_HD float deepdsl_sum_rows_partial(unsigned col, unsigned lane, unsigned lanes, unsigned a, unsigned b,
                                          const float* x) {
    float s = 0.0f;
    for (unsigned r = lane; r < a; r += lanes) s += x[r * b + col];
    return s;
}

// thread `lane` of `lanes` adds elements lane, lane + lanes, ... of the (a, c) block of output b
DEEPDSL_HD float deepdsl_sum_middle_partial(unsigned col, unsigned lane, unsigned lanes, unsigned a, unsigned b,
                                            unsigned c, const float* x) {
    float s = 0.0f;
    const unsigned count = a * c;
    for (unsigned k = lane; k < count; k += lanes) s += x[((k / c) * b + col) * c + k % c];
    return s;
}

struct SumShape {
    unsigned d[4];           // collapsed input dimensions
    unsigned reduced;        // bit j: dimension j is summed
};

DEEPDSL_HD void deepdsl_sum_generic_at(unsigned o, const SumShape& s, unsigned count, const float* x, float* out) {
    unsigned stride[4];
    stride[3] = 1;
    for (int j = 2; j >= 0; --j) stride[j] = stride[j + 1] * s.d[j + 1];
    unsigned base = 0, t = o;
    for (int j = 3; j >= 0; --j)
        if (!((s.reduced >> j) & 1u)) {
            base += (t % s.d[j]) * stride[j];
            t /= s.d[j];
        }
    float acc = 0.0f;
    for (unsigned r = 0; r < count; ++r) {
        unsigned offset = base, u = r;
        for (int j = 3; j >= 0; --j)
            if ((s.reduced >> j) & 1u) {
                offset += (u % s.d[j]) * stride[j];
                u /= s.d[j];
            }
        acc += x[offset];
    }
    out[o] = acc;
}

// ---------------------------------------------------------------------------------------------------------------
// losses: one thread per row (rows are short: the classes)

// causal: rows in blocks of `classes`, row i of a block over columns 0..i only (the others 0)
DEEPDSL_HD void deepdsl_softmax_row(unsigned i, unsigned classes, const float* x, float* out, int log_domain,
                                    int causal) {
    const float* row = x + static_cast<size_t>(i) * classes;
    float* o = out + static_cast<size_t>(i) * classes;
    const unsigned valid = causal ? i % classes + 1 : classes;
    float m = row[0];
    for (unsigned j = 1; j < valid; ++j) m = fmaxf(m, row[j]);
    float total = 0.0f;
    for (unsigned j = 0; j < valid; ++j) total += expf(row[j] - m);
    if (log_domain) {
        const float log_total = logf(total);
        for (unsigned j = 0; j < classes; ++j) o[j] = (row[j] - m) - log_total;     // row[j] read before o[j]
    } else {
        for (unsigned j = 0; j < valid; ++j) o[j] = expf(row[j] - m) / total;
        for (unsigned j = valid; j < classes; ++j) o[j] = 0.0f;
    }
}

// out[i] = x[i, labels[i]]; NaN for a label outside [0, classes), so a bad label stops training (loss not finite)
DEEPDSL_HD void deepdsl_pick_at(unsigned i, unsigned classes, const float* x, const int* labels, float* out) {
    const int label = labels[i];
    out[i] = (label >= 0 && static_cast<unsigned>(label) < classes) ? x[i * classes + label]
                                                                      : nanf("");
}

DEEPDSL_HD void deepdsl_unpick_at(unsigned i, unsigned classes, const float* g, const int* labels, float* out) {
    const unsigned row = i / classes;
    out[i] = (static_cast<int>(i % classes) == labels[row]) ? g[row] : 0.0f;
}

// ---------------------------------------------------------------------------------------------------------------
// attention (deepdsl.ops.attention): one thread per query row (the output, the queries' gradient, the row
// statistics) or key row (the keys' and values' gradients); each recomputes the scores it needs, so no (T, S)
// matrix is stored. The bias of unit u starts at bias + AttLead::offset(u) (up to four leading axes, element strides
// 0 where it broadcasts) and its element (i, j) is at i * row + j * col. With dropout, unit u's 0/1 mask (uint8)
// starts at mask + u * t * s, its element (i, j) at i * s + j, and a weight p counts as p * mask * drop (drop = 1 /
// keep); without, mask is NULL.
struct AttLead {
    unsigned size[4], stride[4];
    DEEPDSL_HD unsigned offset(unsigned u) const {
        unsigned at = 0;
        for (int a = 3; a >= 0; --a) {
            at += (u % size[a]) * stride[a];
            u /= size[a];
        }
        return at;
    }
};
struct AttShape {
    unsigned t, s, d, e, row, col;
    float scale;
    int causal;
    float drop;
    unsigned heads;
    // where unit u's rows of `width` floats start, and how far apart they are: units one after the other (heads 0),
    // or the units (n, h) of an array stored (N, rows, H, width) (attention's `heads`)
    DEEPDSL_HD size_t base(unsigned u, unsigned rows, unsigned width) const {
        return heads ? (static_cast<size_t>(u / heads) * rows * heads + u % heads) * width
                     : static_cast<size_t>(u) * rows * width;
    }
    DEEPDSL_HD unsigned ld(unsigned width) const { return heads ? heads * width : width; }
};

// weight p of (i, j) as dropout keeps it (p itself without a mask; mask: the unit's)
DEEPDSL_HD float deepdsl_att_kept(const AttShape& a, const unsigned char* mask, float p, unsigned i, unsigned j) {
    return mask ? p * static_cast<float>(mask[i * a.s + j]) * a.drop : p;
}

DEEPDSL_HD float deepdsl_att_score(const AttShape& a, const float* q, const float* k, const float* bias, unsigned i,
                                   unsigned j) {
    if (a.causal && j > i) return DEEPDSL_NEG_INF;
    float dot = 0.0f;
    const unsigned ld = a.ld(a.d);
    for (unsigned x = 0; x < a.d; ++x) dot += q[i * ld + x] * k[j * ld + x];
    dot *= a.scale;
    return bias ? dot + bias[i * a.row + j * a.col] : dot;
}

// the log-sum-exp of query i's scores (-inf when every key is left out)
DEEPDSL_HD float deepdsl_att_lse(const AttShape& a, const float* q, const float* k, const float* bias, unsigned i) {
    float m = DEEPDSL_NEG_INF;
    for (unsigned j = 0; j < a.s; ++j) m = deepdsl_maxf(m, deepdsl_att_score(a, q, k, bias, i, j));
    if (m == DEEPDSL_NEG_INF) return m;
    float total = 0.0f;
    for (unsigned j = 0; j < a.s; ++j) total += expf(deepdsl_att_score(a, q, k, bias, i, j) - m);
    return m + logf(total);
}

DEEPDSL_HD float deepdsl_att_weight(float score, float lse) { return score == DEEPDSL_NEG_INF ? 0.0f : expf(score - lse); }

// item (u, i): out row i of unit u
DEEPDSL_HD void deepdsl_attention_at(unsigned item, const AttShape& a, const AttLead& lead, const float* q,
                                     const float* k, const float* v, const float* bias, const unsigned char* mask,
                                     float* out) {
    const unsigned u = item / a.t, i = item % a.t, le = a.ld(a.e);
    q += a.base(u, a.t, a.d), k += a.base(u, a.s, a.d);
    v += a.base(u, a.s, a.e), bias = bias ? bias + lead.offset(u) : bias;
    mask = mask ? mask + static_cast<size_t>(u) * a.t * a.s : mask;
    float* o = out + a.base(u, a.t, a.e) + static_cast<size_t>(i) * le;
    const float lse = deepdsl_att_lse(a, q, k, bias, i);
    for (unsigned x = 0; x < a.e; ++x) o[x] = 0.0f;
    for (unsigned j = 0; j < a.s; ++j) {
        const float p = deepdsl_att_kept(a, mask, lse == DEEPDSL_NEG_INF ? nanf("")
                                         : deepdsl_att_weight(deepdsl_att_score(a, q, k, bias, i, j), lse), i, j);
        for (unsigned x = 0; x < a.e; ++x) o[x] += p * v[j * le + x];
    }
}

// item (u, i) of a chunk of units: the row's log-sum-exp and dO . O into stats (lse, then delta, per chunk)
DEEPDSL_HD void deepdsl_attention_stats_at(unsigned item, unsigned items, const AttShape& a, const AttLead& lead,
                                           unsigned first, const float* q, const float* k, const float* o,
                                           const float* g, const float* bias, float* stats) {
    const unsigned u = first + item / a.t, i = item % a.t;
    q += a.base(u, a.t, a.d), k += a.base(u, a.s, a.d);
    bias = bias ? bias + lead.offset(u) : bias;
    stats[item] = deepdsl_att_lse(a, q, k, bias, i);
    float dot = 0.0f;
    const size_t row = a.base(u, a.t, a.e) + static_cast<size_t>(i) * a.ld(a.e);
    for (unsigned x = 0; x < a.e; ++x) dot += g[row + x] * o[row + x];
    stats[items + item] = dot;
}

// the scores' gradient at (i, j): p (g_i . v_j [* mask * drop] - delta_i) * scale
DEEPDSL_HD float deepdsl_att_dscore(const AttShape& a, float p, const float* g, const float* v,
                                    const unsigned char* mask, unsigned i, unsigned j, float delta) {
    float dot = 0.0f;
    const unsigned le = a.ld(a.e);
    for (unsigned x = 0; x < a.e; ++x) dot += g[i * le + x] * v[j * le + x];
    return p * (deepdsl_att_kept(a, mask, dot, i, j) - delta) * a.scale;
}

// item (u, i) of a chunk: dq row i; item (u, j): dk and dv rows j (`keys`)
DEEPDSL_HD void deepdsl_attention_grad_at(unsigned item, unsigned items, int keys, const AttShape& a,
                                          const AttLead& lead, unsigned first, const float* q, const float* k,
                                          const float* v, const float* g, const float* bias,
                                          const unsigned char* mask, const float* stats, float* dq, float* dk,
                                          float* dv) {
    const unsigned rows = keys ? a.s : a.t;
    const unsigned u = first + item / rows, at = item % rows, base = (item / rows) * a.t;
    const unsigned ld = a.ld(a.d), le = a.ld(a.e);
    q += a.base(u, a.t, a.d), k += a.base(u, a.s, a.d);
    v += a.base(u, a.s, a.e), g += a.base(u, a.t, a.e);
    bias = bias ? bias + lead.offset(u) : bias;
    mask = mask ? mask + static_cast<size_t>(u) * a.t * a.s : mask;
    const float *lse = stats + base, *delta = stats + items + base;
    if (!keys) {
        float* out = dq + a.base(u, a.t, a.d) + static_cast<size_t>(at) * ld;
        for (unsigned x = 0; x < a.d; ++x) out[x] = 0.0f;
        for (unsigned j = 0; j < a.s; ++j) {
            const float p = deepdsl_att_weight(deepdsl_att_score(a, q, k, bias, at, j), lse[at]);
            const float ds = deepdsl_att_dscore(a, p, g, v, mask, at, j, delta[at]);
            for (unsigned x = 0; x < a.d; ++x) out[x] += ds * k[j * ld + x];
        }
        return;
    }
    float* kout = dk + a.base(u, a.s, a.d) + static_cast<size_t>(at) * ld;
    float* vout = dv + a.base(u, a.s, a.e) + static_cast<size_t>(at) * le;
    for (unsigned x = 0; x < a.d; ++x) kout[x] = 0.0f;
    for (unsigned x = 0; x < a.e; ++x) vout[x] = 0.0f;
    for (unsigned i = 0; i < a.t; ++i) {
        const float p = deepdsl_att_weight(deepdsl_att_score(a, q, k, bias, i, at), lse[i]);
        const float ds = deepdsl_att_dscore(a, p, g, v, mask, i, at, delta[i]);
        const float kept = deepdsl_att_kept(a, mask, p, i, at);
        for (unsigned x = 0; x < a.e; ++x) vout[x] += kept * g[i * le + x];
        for (unsigned x = 0; x < a.d; ++x) kout[x] += ds * q[i * ld + x];
    }
}

// 1 when the row's first largest score is at its label
DEEPDSL_HD unsigned deepdsl_precision_row(unsigned i, unsigned classes, const float* x, const int* labels) {
    const float* row = x + static_cast<size_t>(i) * classes;
    unsigned best = 0;
    for (unsigned j = 1; j < classes; ++j)
        if (row[j] > row[best]) best = j;
    return static_cast<int>(best) == labels[i] ? 1u : 0u;
}

// how many scores of the row come before its label's sorted by decreasing score, ties in column order (0 exactly
// where deepdsl_precision_row counts the row); NaN for a label out of range
DEEPDSL_HD void deepdsl_label_rank_at(unsigned i, unsigned classes, const float* x, const int* labels, float* out) {
    const int label = labels[i];
    if (label < 0 || static_cast<unsigned>(label) >= classes) { out[i] = nanf(""); return; }
    const float* row = x + static_cast<size_t>(i) * classes;
    const float own = row[label];
    unsigned ahead = 0;
    for (unsigned j = 0; j < classes; ++j)
        ahead += (row[j] > own || (row[j] == own && j < static_cast<unsigned>(label))) ? 1u : 0u;
    out[i] = static_cast<float>(ahead);
}

// ---------------------------------------------------------------------------------------------------------------
// pooling over (planes = N * C, H, W) -> (planes, Ho, Wo); windows k x k, `stride`, `pad`; positions outside the
// input (padding, and in ceil mode the part of the last window beyond the edge) take no part.

struct PoolGeom {
    unsigned planes, h, w, ho, wo, k, stride, pad;
};

// best value and its window index (row * k + column) of the first maximum, as the CPU's strict comparison
DEEPDSL_HD float deepdsl_max_window(unsigned o, const PoolGeom& g, const float* x, unsigned* arg) {
    const unsigned q = o % g.wo, t = o / g.wo, p = t % g.ho, plane = t / g.ho;
    const float* xp = x + static_cast<size_t>(plane) * g.h * g.w;
    const int r0 = static_cast<int>(p * g.stride) - static_cast<int>(g.pad);
    const int c0 = static_cast<int>(q * g.stride) - static_cast<int>(g.pad);
    float best = DEEPDSL_NEG_INF;
    unsigned best_at = 0;
    for (unsigned i = 0; i < g.k; ++i) {
        const int r = r0 + static_cast<int>(i);
        for (unsigned j = 0; j < g.k; ++j) {
            const int c = c0 + static_cast<int>(j);
            const bool inside = r >= 0 && r < static_cast<int>(g.h) && c >= 0 && c < static_cast<int>(g.w);
            const float v = inside ? xp[r * static_cast<int>(g.w) + c] : DEEPDSL_NEG_INF;
            if ((i == 0 && j == 0) || v > best) {
                best = v;
                best_at = i * g.k + j;
            }
        }
    }
    *arg = best_at;
    return best;
}

DEEPDSL_HD float deepdsl_max_pool_value(unsigned o, const PoolGeom& g, const float* x) {
    unsigned arg;
    return deepdsl_max_window(o, g, x, &arg);
}

DEEPDSL_HD deepdsl_u8 deepdsl_max_pool_argmax_value(unsigned o, const PoolGeom& g, const float* x) {
    unsigned arg;
    deepdsl_max_window(o, g, x, &arg);
    return static_cast<deepdsl_u8>(arg);
}

// the number of elements window (p, q) divides by (PyTorch's rule, as cpu.avg_pool_divisor)
DEEPDSL_HD unsigned deepdsl_avg_divisor(unsigned p, unsigned q, const PoolGeom& g, int include_pad) {
    const int hs = static_cast<int>(p * g.stride) - static_cast<int>(g.pad);
    const int ws = static_cast<int>(q * g.stride) - static_cast<int>(g.pad);
    const int he = hs + static_cast<int>(g.k) < static_cast<int>(g.h + g.pad) ? hs + static_cast<int>(g.k)
                                                                                 : static_cast<int>(g.h + g.pad);
    const int we = ws + static_cast<int>(g.k) < static_cast<int>(g.w + g.pad) ? ws + static_cast<int>(g.k)
                                                                                 : static_cast<int>(g.w + g.pad);
    if (include_pad) return static_cast<unsigned>((he - hs) * (we - ws));
    const int h0 = hs > 0 ? hs : 0, w0 = ws > 0 ? ws : 0;
    const int h1 = he < static_cast<int>(g.h) ? he : static_cast<int>(g.h);
    const int w1 = we < static_cast<int>(g.w) ? we : static_cast<int>(g.w);
    return static_cast<unsigned>((h1 - h0) * (w1 - w0));
}

DEEPDSL_HD float deepdsl_avg_pool_value(unsigned o, const PoolGeom& g, int include_pad, const float* x) {
    const unsigned q = o % g.wo, t = o / g.wo, p = t % g.ho, plane = t / g.ho;
    const float* xp = x + static_cast<size_t>(plane) * g.h * g.w;
    const int r0 = static_cast<int>(p * g.stride) - static_cast<int>(g.pad);
    const int c0 = static_cast<int>(q * g.stride) - static_cast<int>(g.pad);
    float total = 0.0f;
    for (unsigned i = 0; i < g.k; ++i) {
        const int r = r0 + static_cast<int>(i);
        for (unsigned j = 0; j < g.k; ++j) {
            const int c = c0 + static_cast<int>(j);
            if (r >= 0 && r < static_cast<int>(g.h) && c >= 0 && c < static_cast<int>(g.w))
                total += xp[r * static_cast<int>(g.w) + c];
        }
    }
    return total / static_cast<float>(deepdsl_avg_divisor(p, q, g, include_pad));
}

// Backward ops gather: input position (plane, h, w) adds the gradients of the windows holding it, windows taken
// by offset (i, j) in increasing order -- the order in which the CPU backend adds them up.
struct PoolRange {
    int lo, hi;              // windows lo..hi (inclusive) along one axis hold the position
};

DEEPDSL_HD PoolRange deepdsl_pool_windows(unsigned pos, unsigned out_size, const PoolGeom& g) {
    const int padded = static_cast<int>(pos + g.pad), s = static_cast<int>(g.stride), k = static_cast<int>(g.k);
    PoolRange r;
    r.hi = padded / s;
    if (r.hi > static_cast<int>(out_size) - 1) r.hi = static_cast<int>(out_size) - 1;
    r.lo = padded >= k ? (padded - k) / s + 1 : 0;
    return r;
}

DEEPDSL_HD float deepdsl_max_pool_bwd_value(unsigned idx, const PoolGeom& g, const float* grad,
                                            const deepdsl_u8* argmax) {
    const unsigned w = idx % g.w, t = idx / g.w, h = t % g.h, plane = t / g.h;
    const PoolRange rp = deepdsl_pool_windows(h, g.ho, g), rq = deepdsl_pool_windows(w, g.wo, g);
    const size_t base = static_cast<size_t>(plane) * g.ho * g.wo;
    float total = 0.0f;
    for (int p = rp.hi; p >= rp.lo; --p) {                 // window offset i = h + pad - p * stride increases
        const unsigned i = h + g.pad - static_cast<unsigned>(p) * g.stride;
        for (int q = rq.hi; q >= rq.lo; --q) {
            const unsigned j = w + g.pad - static_cast<unsigned>(q) * g.stride;
            const size_t o = base + static_cast<unsigned>(p) * g.wo + static_cast<unsigned>(q);
            if (argmax[o] == i * g.k + j) total += grad[o];
        }
    }
    return total;
}

DEEPDSL_HD float deepdsl_avg_pool_bwd_value(unsigned idx, const PoolGeom& g, int include_pad, const float* grad) {
    const unsigned w = idx % g.w, t = idx / g.w, h = t % g.h, plane = t / g.h;
    const PoolRange rp = deepdsl_pool_windows(h, g.ho, g), rq = deepdsl_pool_windows(w, g.wo, g);
    const size_t base = static_cast<size_t>(plane) * g.ho * g.wo;
    float total = 0.0f;
    for (int p = rp.hi; p >= rp.lo; --p)
        for (int q = rq.hi; q >= rq.lo; --q) {
            const size_t o = base + static_cast<unsigned>(p) * g.wo + static_cast<unsigned>(q);
            total += grad[o] / static_cast<float>(deepdsl_avg_divisor(p, q, g, include_pad));
        }
    return total;
}

// ---------------------------------------------------------------------------------------------------------------
// local response normalization across channels: one thread per (sample, spatial position) column, channels in
// increasing order. s_c = k + alpha/size * sum of x^2 over channels c - size/2 .. c + (size-1)/2 (clipped), added
// in the CPU's order; the products and sums are rounded separately (no fused multiply-add) as numpy computes them.

DEEPDSL_HD float deepdsl_lrn_scale(const float* x, unsigned base, unsigned spatial, unsigned c, unsigned channels,
                                   int size, float alpha_over_size, float k) {
    const int front = size / 2, back = (size - 1) / 2;
    const float xc = x[base + c * spatial];
    float s = DEEPDSL_FMUL(xc, xc);
    for (int d = 1; d <= front; ++d)
        if (static_cast<int>(c) >= d) {
            const float v = x[base + (c - d) * spatial];
            s = DEEPDSL_FADD(s, DEEPDSL_FMUL(v, v));
        }
    for (int d = 1; d <= back; ++d)
        if (c + d < channels) {
            const float v = x[base + (c + d) * spatial];
            s = DEEPDSL_FADD(s, DEEPDSL_FMUL(v, v));
        }
    return DEEPDSL_FADD(DEEPDSL_FMUL(s, alpha_over_size), k);
}

// forward; out may be x: the window of original values ahead of the write position is kept in a ring
DEEPDSL_HD void deepdsl_lrn_column(unsigned col, unsigned channels, unsigned spatial, int size, float alpha_over_size,
                                   float k, float neg_beta, const float* x, float* out) {
    const unsigned base = (col / spatial) * channels * spatial + col % spatial;
    const int front = size / 2, back = (size - 1) / 2, ring_size = size;
    float ring[DEEPDSL_LRN_MAX_SIZE];                    // x[c'] at c' % size for c' in [c - front, c + back]
    for (int c = 0; c <= back && c < static_cast<int>(channels); ++c) ring[c % ring_size] = x[base + c * spatial];
    for (unsigned c = 0; c < channels; ++c) {
        if (c > 0 && c + back < channels) ring[(c + back) % ring_size] = x[base + (c + back) * spatial];
        const float xc = ring[c % ring_size];
        float s = DEEPDSL_FMUL(xc, xc);
        for (int d = 1; d <= front; ++d)
            if (static_cast<int>(c) >= d) {
                const float v = ring[(c - d) % ring_size];
                s = DEEPDSL_FADD(s, DEEPDSL_FMUL(v, v));
            }
        for (int d = 1; d <= back; ++d)
            if (c + d < channels) {
                const float v = ring[(c + d) % ring_size];
                s = DEEPDSL_FADD(s, DEEPDSL_FMUL(v, v));
            }
        s = DEEPDSL_FADD(DEEPDSL_FMUL(s, alpha_over_size), k);
        out[base + c * spatial] = DEEPDSL_FMUL(xc, powf(s, neg_beta));
    }
}

// backward: dx_c = g_c s_c^-beta - (2 alpha beta / size) x_c sum_{c'} g_c' x_c' s_c'^(-beta-1) over c' in
// [c - (size-1)/2, c + size/2]; dx may be g: a_c' = g_c' x_c' s_c'^(-beta-1) is made (from g_c' not yet
// overwritten) size/2 channels ahead and kept in a ring, with s_c'
DEEPDSL_HD void deepdsl_lrn_bwd_column(unsigned col, unsigned channels, unsigned spatial, int size,
                                       float alpha_over_size, float k, float neg_beta, float neg_beta_minus_one,
                                       float two_alpha_beta_over_size, const float* g, const float* x, float* out) {
    const unsigned base = (col / spatial) * channels * spatial + col % spatial;
    const int behind = (size - 1) / 2, ahead = size / 2, ring_size = size;
    float a_ring[DEEPDSL_LRN_MAX_SIZE], s_ring[DEEPDSL_LRN_MAX_SIZE];
    for (int c = 0; c <= ahead && c < static_cast<int>(channels); ++c) {
        const float s = deepdsl_lrn_scale(x, base, spatial, c, channels, size, alpha_over_size, k);
        s_ring[c % ring_size] = s;
        a_ring[c % ring_size] =
            DEEPDSL_FMUL(DEEPDSL_FMUL(powf(s, neg_beta_minus_one), g[base + c * spatial]), x[base + c * spatial]);
    }
    for (unsigned c = 0; c < channels; ++c) {
        const unsigned next = c + ahead;
        if (c > 0 && next < channels) {
            const float s = deepdsl_lrn_scale(x, base, spatial, next, channels, size, alpha_over_size, k);
            s_ring[next % ring_size] = s;
            a_ring[next % ring_size] =
                DEEPDSL_FMUL(DEEPDSL_FMUL(powf(s, neg_beta_minus_one), g[base + next * spatial]), x[base + next * spatial]);
        }
        float spread = a_ring[c % ring_size];
        for (int d = 1; d <= behind; ++d)
            if (static_cast<int>(c) >= d) spread = DEEPDSL_FADD(spread, a_ring[(c - d) % ring_size]);
        for (int d = 1; d <= ahead; ++d)
            if (c + d < channels) spread = DEEPDSL_FADD(spread, a_ring[(c + d) % ring_size]);
        const float xc = x[base + c * spatial];
        spread = DEEPDSL_FMUL(DEEPDSL_FMUL(spread, xc), two_alpha_beta_over_size);
        const float first = DEEPDSL_FMUL(powf(s_ring[c % ring_size], neg_beta), g[base + c * spatial]);
        out[base + c * spatial] = first - spread;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// convolution: im2col + GEMM (cuBLAS strided batched), col2im by gathering

struct ConvGeom {
    unsigned c, h, w, kh, kw, ho, wo, stride, pad;
};

// cols[n * sample_stride + r * row_stride + s] = x[n, c, p*stride - pad + i, q*stride - pad + j] (0 outside x)
// with r = (c * kh + i) * kw + j, s = p * wo + q, for the m samples of a chunk (x points at its first sample). Item
// idx is one position s of one channel c of one sample n, and writes its kh * kw rows: neighbouring items write
// neighbouring floats of each row, and the index arithmetic (divisions by sizes known only at run time) is done once
// per item rather than once per element.
DEEPDSL_HD void deepdsl_im2col_at(unsigned idx, const ConvGeom& g, unsigned sample_stride, unsigned row_stride,
                                  const float* x, float* cols) {
    const unsigned plane = g.ho * g.wo;
    const unsigned s = idx % plane, t = idx / plane, c = t % g.c, n = t / g.c;
    const unsigned q = s % g.wo, p = s / g.wo;
    const int top = static_cast<int>(p * g.stride) - static_cast<int>(g.pad);
    const int left = static_cast<int>(q * g.stride) - static_cast<int>(g.pad);
    const float* xc = x + (static_cast<size_t>(n) * g.c + c) * g.h * g.w;
    float* to = cols + static_cast<size_t>(n) * sample_stride + static_cast<size_t>(c) * g.kh * g.kw * row_stride + s;
    for (unsigned i = 0; i < g.kh; ++i) {
        const int hh = top + static_cast<int>(i);
        const bool row_inside = hh >= 0 && hh < static_cast<int>(g.h);
        for (unsigned j = 0; j < g.kw; ++j) {
            const int ww = left + static_cast<int>(j);
            float v = 0.0f;
            if (row_inside && ww >= 0 && ww < static_cast<int>(g.w)) v = xc[static_cast<size_t>(hh) * g.w + ww];
            to[static_cast<size_t>(i * g.kw + j) * row_stride] = v;
        }
    }
}

// dx[n, c, h, w] = sum over kernel offsets (i, j) in increasing order of dcols[n, (c, i, j), p, q] with
// h = p*stride - pad + i, w = q*stride - pad + j (dcols per sample: (C*kh*kw, Ho*Wo)). The offsets that reach (h, w)
// are every stride-th from the first whose p (q) is below Ho (Wo): found once, so the loops below take only those,
// with p and q counting down, and no division per offset.
DEEPDSL_HD void deepdsl_col2im_at(unsigned idx, const ConvGeom& g, const float* dcols, float* dx) {
    const unsigned w = idx % g.w, t = idx / g.w, h = t % g.h, t2 = t / g.h, c = t2 % g.c, n = t2 / g.c;
    const unsigned plane = g.ho * g.wo;
    const float* base = dcols + (static_cast<size_t>(n) * g.c + c) * g.kh * g.kw * plane;
    const unsigned hp = h + g.pad, wp = w + g.pad;
    unsigned i0 = hp % g.stride, j0 = wp % g.stride;                 // the first offsets with p, q whole
    if (hp - i0 > g.stride * (g.ho - 1)) i0 += (hp - i0 - g.stride * (g.ho - 1) + g.stride - 1) / g.stride * g.stride;
    if (wp - j0 > g.stride * (g.wo - 1)) j0 += (wp - j0 - g.stride * (g.wo - 1) + g.stride - 1) / g.stride * g.stride;
    float total = 0.0f;
    for (unsigned i = i0, p = (hp - i0) / g.stride; i < g.kh && i <= hp; i += g.stride, --p)
        for (unsigned j = j0, q = (wp - j0) / g.stride; j < g.kw && j <= wp; j += g.stride, --q)
            total += base[static_cast<size_t>(i * g.kw + j) * plane + p * g.wo + q];
    dx[idx] = total;
}

// ---------------------------------------------------------------------------------------------------------------
// layer normalization over rows of `features` floats: a thread per row for the output and the input's gradient (each
// recomputing its row's mean and 1 / std), and for the statistics the weight's and bias's gradients read; a thread
// per feature for those gradients, adding the rows in order

DEEPDSL_HD void deepdsl_layer_norm_stats_row(const float* x, unsigned features, float eps, float* mean, float* rstd) {
    float sum = 0.0f;
    for (unsigned j = 0; j < features; ++j) sum += x[j];
    const float m = sum / static_cast<float>(features);
    float squares = 0.0f;
    for (unsigned j = 0; j < features; ++j) squares += (x[j] - m) * (x[j] - m);
    *mean = m;
    *rstd = 1.0f / sqrtf(squares / static_cast<float>(features) + eps);
}

// out = (x - mean) * rstd [* w + b] for row r (w and b null: not affine)
DEEPDSL_HD void deepdsl_layer_norm_row(unsigned r, unsigned features, float eps, const float* x, const float* w,
                                       const float* b, float* out) {
    const float* xr = x + static_cast<size_t>(r) * features;
    float* o = out + static_cast<size_t>(r) * features;
    float mean, rstd;
    deepdsl_layer_norm_stats_row(xr, features, eps, &mean, &rstd);
    for (unsigned j = 0; j < features; ++j) {
        const float y = (xr[j] - mean) * rstd;
        o[j] = w ? y * w[j] + b[j] : y;
    }
}

// dx = rstd (gw - mean(gw) - xhat mean(gw xhat)) for row r, gw = g * w (g when w is null); out may be g
DEEPDSL_HD void deepdsl_layer_norm_grad_row(unsigned r, unsigned features, float eps, const float* x, const float* g,
                                            const float* w, float* out) {
    const size_t base = static_cast<size_t>(r) * features;
    const float* xr = x + base;
    const float* gr = g + base;
    float mean, rstd, sum = 0.0f, dot = 0.0f;
    deepdsl_layer_norm_stats_row(xr, features, eps, &mean, &rstd);
    for (unsigned j = 0; j < features; ++j) {
        const float gw = w ? gr[j] * w[j] : gr[j];
        sum += gw;
        dot += gw * ((xr[j] - mean) * rstd);
    }
    const float a = sum / static_cast<float>(features), c = dot / static_cast<float>(features);
    for (unsigned j = 0; j < features; ++j) {
        const float gw = w ? gr[j] * w[j] : gr[j], xhat = (xr[j] - mean) * rstd;
        out[base + j] = rstd * ((gw - a) - xhat * c);
    }
}

// stats[2r], stats[2r + 1] = row r's mean and 1 / std
DEEPDSL_HD void deepdsl_layer_norm_stats_at(unsigned r, unsigned features, float eps, const float* x, float* stats) {
    deepdsl_layer_norm_stats_row(x + static_cast<size_t>(r) * features, features, eps, stats + 2 * r,
                                 stats + 2 * r + 1);
}

// out[j] = sum over rows of g * xhat, out[features + j] = sum of g, for feature j, the rows in order
DEEPDSL_HD void deepdsl_layer_norm_param_column(unsigned j, unsigned rows, unsigned features, const float* x,
                                                const float* g, const float* stats, float* out) {
    float dw = 0.0f, db = 0.0f;
    for (unsigned r = 0; r < rows; ++r) {
        const size_t at = static_cast<size_t>(r) * features + j;
        dw += g[at] * ((x[at] - stats[2 * r]) * stats[2 * r + 1]);
        db += g[at];
    }
    out[j] = dw;
    out[features + j] = db;
}

// ---------------------------------------------------------------------------------------------------------------
// dropout masks: deepdsl_bernoulli_group (deepdsl_random.h), one group of eight bytes per thread

// ===============================================================================================================
// __global__ wrappers (nvcc only). Launch: 1-D grids of DEEPDSL_THREADS threads unless stated otherwise.
#ifdef __CUDACC__

#define DEEPDSL_KERNEL DEEPDSL_GLOBAL void __launch_bounds__(DEEPDSL_THREADS)

DEEPDSL_KERNEL deepdsl_fill_u32(unsigned n, unsigned* out, unsigned bits) {
    DEEPDSL_FOR(i, 0, n) deepdsl_fill_u32_at(i, out, bits);
}
DEEPDSL_KERNEL deepdsl_fill_u8(unsigned n, deepdsl_u8* out, unsigned value) {
    DEEPDSL_FOR(i, 0, n) deepdsl_fill_u8_at(i, out, value);
}
DEEPDSL_KERNEL deepdsl_copy2d_u32(unsigned rows, unsigned cols, const unsigned* src, unsigned src_pitch,
                                  unsigned* dst, unsigned dst_pitch) {
    DEEPDSL_FOR(i, 0, rows * cols) deepdsl_copy2d_at<unsigned>(i, cols, src, src_pitch, dst, dst_pitch);
}
DEEPDSL_KERNEL deepdsl_copy2d_u8(unsigned rows, unsigned cols, const deepdsl_u8* src, unsigned src_pitch,
                                 deepdsl_u8* dst, unsigned dst_pitch) {
    DEEPDSL_FOR(i, 0, rows * cols) deepdsl_copy2d_at<deepdsl_u8>(i, cols, src, src_pitch, dst, dst_pitch);
}
DEEPDSL_KERNEL deepdsl_broadcast_1(EwShape s, float* out, EwArg a) { DEEPDSL_FOR(i, 0, s.n) deepdsl_broadcast_at<1>(i, s, out, a); }
DEEPDSL_KERNEL deepdsl_broadcast_2(EwShape s, float* out, EwArg a) { DEEPDSL_FOR(i, 0, s.n) deepdsl_broadcast_at<2>(i, s, out, a); }
DEEPDSL_KERNEL deepdsl_broadcast_4(EwShape s, float* out, EwArg a) { DEEPDSL_FOR(i, 0, s.n) deepdsl_broadcast_at<4>(i, s, out, a); }
DEEPDSL_KERNEL deepdsl_swap01(unsigned a, unsigned b, unsigned s, const float* src, float* dst) {
    DEEPDSL_FOR(i, 0, a * b * s) deepdsl_swap01_at(i, a, b, s, src, dst);
}
DEEPDSL_KERNEL deepdsl_transpose(unsigned outer, unsigned a, unsigned m, unsigned b, unsigned r, const float* src,
                                 float* dst) {
    DEEPDSL_FOR(i, 0, outer * a * m * b * r) deepdsl_transpose_at(i, a, m, b, r, src, dst);
}
DEEPDSL_KERNEL deepdsl_add_bias(unsigned n, unsigned o, unsigned s, const float* bias, float* out) {
    DEEPDSL_FOR(i, 0, n) deepdsl_add_bias_at(i, o, s, bias, out);
}

// block (32, 8), grid ceil(b / 32)
DEEPDSL_GLOBAL void __launch_bounds__(256) deepdsl_sum_rows(unsigned a, unsigned b, const float* x, float* out) {
    __shared__ float part[8][33];
    const unsigned col = blockIdx.x * 32 + threadIdx.x;
    part[threadIdx.y][threadIdx.x] = col < b ? deepdsl_sum_rows_partial(col, threadIdx.y, 8, a, b, x) : 0.0f;
    __syncthreads();
    if (threadIdx.y == 0 && col < b) {
        float s = part[0][threadIdx.x];
        for (int y = 1; y < 8; ++y) s += part[y][threadIdx.x];
        out[col] = s;
    }
}

// one block of DEEPDSL_THREADS (a power of two) per output; grid b
DEEPDSL_KERNEL deepdsl_sum_middle(unsigned a, unsigned b, unsigned c, const float* x, float* out) {
    __shared__ float part[DEEPDSL_THREADS];
    part[threadIdx.x] = deepdsl_sum_middle_partial(blockIdx.x, threadIdx.x, DEEPDSL_THREADS, a, b, c, x);
    __syncthreads();
    for (unsigned half = DEEPDSL_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}

DEEPDSL_KERNEL deepdsl_sum_generic(unsigned n, SumShape s, unsigned count, const float* x, float* out) {
    DEEPDSL_FOR(o, 0, n) deepdsl_sum_generic_at(o, s, count, x, out);
}

DEEPDSL_KERNEL deepdsl_softmax(unsigned rows, unsigned classes, const float* x, float* out, int log_domain,
                               int causal) {
    DEEPDSL_FOR(i, 0, rows) deepdsl_softmax_row(i, classes, x, out, log_domain, causal);
}
DEEPDSL_KERNEL deepdsl_attention(unsigned n, AttShape a, AttLead lead, const float* q, const float* k,
                                 const float* v, const float* bias, const unsigned char* mask, float* out) {
    DEEPDSL_FOR(i, 0, n) deepdsl_attention_at(i, a, lead, q, k, v, bias, mask, out);
}
DEEPDSL_KERNEL deepdsl_attention_stats(unsigned n, AttShape a, AttLead lead, unsigned first, const float* q,
                                       const float* k, const float* o, const float* g, const float* bias,
                                       float* stats) {
    DEEPDSL_FOR(i, 0, n) deepdsl_attention_stats_at(i, n, a, lead, first, q, k, o, g, bias, stats);
}
DEEPDSL_KERNEL deepdsl_attention_grad(unsigned n, unsigned items, int keys, AttShape a, AttLead lead, unsigned first,
                                      const float* q, const float* k, const float* v, const float* g,
                                      const float* bias, const unsigned char* mask, const float* stats, float* dq,
                                      float* dk, float* dv) {
    DEEPDSL_FOR(i, 0, n) deepdsl_attention_grad_at(i, items, keys, a, lead, first, q, k, v, g, bias, mask, stats, dq,
                                                   dk, dv);
}
DEEPDSL_KERNEL deepdsl_pick(unsigned rows, unsigned classes, const float* x, const int* labels, float* out) {
    DEEPDSL_FOR(i, 0, rows) deepdsl_pick_at(i, classes, x, labels, out);
}
DEEPDSL_KERNEL deepdsl_label_rank(unsigned rows, unsigned classes, const float* x, const int* labels, float* out) {
    DEEPDSL_FOR(i, 0, rows) deepdsl_label_rank_at(i, classes, x, labels, out);
}
// out[i] = table[ids[i]]: item i * d + c copies one feature (NaN for a row number outside [0, rows))
DEEPDSL_KERNEL deepdsl_gather_rows(unsigned n, unsigned d, unsigned rows, const float* table, const int* ids,
                                   float* out) {
    DEEPDSL_FOR(i, 0, n) {
        const int row = ids[i / d];
        out[i] = (row >= 0 && static_cast<unsigned>(row) < rows) ? table[static_cast<size_t>(row) * d + i % d]
                                                                  : nanf("");
    }
}

// out = 0; out[ids[i]] += g[i] in the order of i: item c owns column c of every row and adds the lookups into it one
// after another (the CPU kernels' sums, bit for bit; no atomics)
DEEPDSL_KERNEL deepdsl_scatter_rows(unsigned d, unsigned m, unsigned rows, const float* g, const int* ids,
                                    float* out) {
    DEEPDSL_FOR(c, 0, d) {
        for (unsigned r = 0; r < rows; ++r) out[static_cast<size_t>(r) * d + c] = 0.0f;
        for (unsigned i = 0; i < m; ++i) {
            const int row = ids[i];
            if (row >= 0 && static_cast<unsigned>(row) < rows)
                out[static_cast<size_t>(row) * d + c] += g[static_cast<size_t>(i) * d + c];
        }
    }
}
DEEPDSL_KERNEL deepdsl_unpick(unsigned n, unsigned classes, const float* g, const int* labels, float* out) {
    DEEPDSL_FOR(i, 0, n) deepdsl_unpick_at(i, classes, g, labels, out);
}

// one block of DEEPDSL_THREADS
DEEPDSL_KERNEL deepdsl_precision(unsigned rows, unsigned classes, const float* x, const int* labels, float* out) {
    __shared__ unsigned counts[DEEPDSL_THREADS];
    unsigned count = 0;
    for (unsigned i = threadIdx.x; i < rows; i += DEEPDSL_THREADS) count += deepdsl_precision_row(i, classes, x, labels);
    counts[threadIdx.x] = count;
    __syncthreads();
    for (unsigned half = DEEPDSL_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) counts[threadIdx.x] += counts[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = static_cast<float>(counts[0]) / static_cast<float>(rows);
}

// pooling over output (forward) or input (backward) elements [begin, end)
DEEPDSL_KERNEL deepdsl_max_pool_range(PoolGeom g, const float* x, float* out, unsigned begin, unsigned end) {
    DEEPDSL_FOR(o, begin, end) out[o] = deepdsl_max_pool_value(o, g, x);
}
DEEPDSL_KERNEL deepdsl_max_pool_argmax(PoolGeom g, const float* x, deepdsl_u8* out, unsigned n) {
    DEEPDSL_FOR(o, 0, n) out[o] = deepdsl_max_pool_argmax_value(o, g, x);
}
DEEPDSL_KERNEL deepdsl_avg_pool_range(PoolGeom g, int include_pad, const float* x, float* out, unsigned begin,
                                      unsigned end) {
    DEEPDSL_FOR(o, begin, end) out[o] = deepdsl_avg_pool_value(o, g, include_pad, x);
}
DEEPDSL_KERNEL deepdsl_max_pool_bwd_range(PoolGeom g, const float* grad, const deepdsl_u8* argmax, float* out,
                                          unsigned begin, unsigned end) {
    DEEPDSL_FOR(i, begin, end) out[i] = deepdsl_max_pool_bwd_value(i, g, grad, argmax);
}
DEEPDSL_KERNEL deepdsl_avg_pool_bwd_range(PoolGeom g, int include_pad, const float* grad, float* out,
                                          unsigned begin, unsigned end) {
    DEEPDSL_FOR(i, begin, end) out[i] = deepdsl_avg_pool_bwd_value(i, g, include_pad, grad);
}

// The ordered variants: one block walks [begin, end) in tiles of DEEPDSL_ORDERED_THREADS, increasing (forward) or
// decreasing (backward); every thread reads what its element needs, the block synchronizes, then writes. Used
// where an output overlaps its input from the same start (see the file comment).
#define DEEPDSL_ORDERED_LOOP(ASCENDING, VALUE, STORE)                                                          \
    const unsigned tiles = (end - begin + DEEPDSL_ORDERED_THREADS - 1) / DEEPDSL_ORDERED_THREADS;            \
    for (unsigned tile = 0; tile < tiles; ++tile) {                                                           \
        const unsigned start = (ASCENDING) ? begin + tile * DEEPDSL_ORDERED_THREADS                           \
                                           : (end - begin > (tile + 1) * DEEPDSL_ORDERED_THREADS              \
                                                  ? end - (tile + 1) * DEEPDSL_ORDERED_THREADS : begin);      \
        const unsigned stop = (ASCENDING) ? start + DEEPDSL_ORDERED_THREADS : end - tile * DEEPDSL_ORDERED_THREADS; \
        const unsigned at = start + threadIdx.x;                                                              \
        const bool mine = at < stop && at < end;                                                              \
        float value = 0.0f;                                                                                   \
        if (mine) value = (VALUE);                                                                            \
        __syncthreads();                                                                                      \
        if (mine) STORE = value;                                                                              \
        __syncthreads();                                                                                      \
    }

DEEPDSL_GLOBAL void __launch_bounds__(DEEPDSL_ORDERED_THREADS)
deepdsl_max_pool_ordered(PoolGeom g, const float* x, float* out, unsigned begin, unsigned end) {
    DEEPDSL_ORDERED_LOOP(true, deepdsl_max_pool_value(at, g, x), out[at])
}
DEEPDSL_GLOBAL void __launch_bounds__(DEEPDSL_ORDERED_THREADS)
deepdsl_avg_pool_ordered(PoolGeom g, int include_pad, const float* x, float* out, unsigned begin, unsigned end) {
    DEEPDSL_ORDERED_LOOP(true, deepdsl_avg_pool_value(at, g, include_pad, x), out[at])
}
DEEPDSL_GLOBAL void __launch_bounds__(DEEPDSL_ORDERED_THREADS)
deepdsl_max_pool_bwd_ordered(PoolGeom g, const float* grad, const deepdsl_u8* argmax, float* out, unsigned begin,
                             unsigned end) {
    DEEPDSL_ORDERED_LOOP(false, deepdsl_max_pool_bwd_value(at, g, grad, argmax), out[at])
}
DEEPDSL_GLOBAL void __launch_bounds__(DEEPDSL_ORDERED_THREADS)
deepdsl_avg_pool_bwd_ordered(PoolGeom g, int include_pad, const float* grad, float* out, unsigned begin,
                             unsigned end) {
    DEEPDSL_ORDERED_LOOP(false, deepdsl_avg_pool_bwd_value(at, g, include_pad, grad), out[at])
}

DEEPDSL_KERNEL deepdsl_lrn(unsigned columns, unsigned channels, unsigned spatial, int size, float alpha_over_size,
                           float k, float neg_beta, const float* x, float* out) {
    DEEPDSL_FOR(col, 0, columns) deepdsl_lrn_column(col, channels, spatial, size, alpha_over_size, k, neg_beta, x, out);
}
DEEPDSL_KERNEL deepdsl_lrn_bwd(unsigned columns, unsigned channels, unsigned spatial, int size,
                               float alpha_over_size, float k, float neg_beta, float neg_beta_minus_one,
                               float two_alpha_beta_over_size, const float* g, const float* x, float* out) {
    DEEPDSL_FOR(col, 0, columns)
        deepdsl_lrn_bwd_column(col, channels, spatial, size, alpha_over_size, k, neg_beta, neg_beta_minus_one,
                               two_alpha_beta_over_size, g, x, out);
}

DEEPDSL_KERNEL deepdsl_layer_norm(unsigned rows, unsigned features, float eps, const float* x, const float* w,
                                  const float* b, float* out) {
    DEEPDSL_FOR(r, 0, rows) deepdsl_layer_norm_row(r, features, eps, x, w, b, out);
}
DEEPDSL_KERNEL deepdsl_layer_norm_grad(unsigned rows, unsigned features, float eps, const float* x, const float* g,
                                       const float* w, float* out) {
    DEEPDSL_FOR(r, 0, rows) deepdsl_layer_norm_grad_row(r, features, eps, x, g, w, out);
}
DEEPDSL_KERNEL deepdsl_layer_norm_stats(unsigned rows, unsigned features, float eps, const float* x, float* stats) {
    DEEPDSL_FOR(r, 0, rows) deepdsl_layer_norm_stats_at(r, features, eps, x, stats);
}
DEEPDSL_KERNEL deepdsl_layer_norm_param_grad(unsigned features, unsigned rows, const float* x, const float* g,
                                             const float* stats, float* out) {
    DEEPDSL_FOR(j, 0, features) deepdsl_layer_norm_param_column(j, rows, features, x, g, stats, out);
}

DEEPDSL_KERNEL deepdsl_im2col(unsigned n, ConvGeom g, unsigned sample_stride, unsigned row_stride, const float* x,
                              float* cols) {
    DEEPDSL_FOR(i, 0, n) deepdsl_im2col_at(i, g, sample_stride, row_stride, x, cols);
}
DEEPDSL_KERNEL deepdsl_col2im(unsigned n, ConvGeom g, const float* dcols, float* dx) {
    DEEPDSL_FOR(i, 0, n) deepdsl_col2im_at(i, g, dcols, dx);
}

// out[i] = 1 where x[i] equals value (a padding mask of tokens, or of floats)
DEEPDSL_KERNEL deepdsl_equal_i32(unsigned n, const int* x, float value, unsigned char* out) {
    DEEPDSL_FOR(i, 0, n) out[i] = static_cast<float>(x[i]) == value ? 1 : 0;
}
DEEPDSL_KERNEL deepdsl_equal_f32(unsigned n, const float* x, float value, unsigned char* out) {
    DEEPDSL_FOR(i, 0, n) out[i] = x[i] == value ? 1 : 0;
}

DEEPDSL_KERNEL deepdsl_bernoulli(unsigned groups, unsigned n, deepdsl_u64 seed, deepdsl_u64 stream, float keep,
                                 deepdsl_u8* out) {
    DEEPDSL_FOR(group, 0, groups) deepdsl_bernoulli_group(group, n, seed, stream, keep, out);
}

#endif  // __CUDACC__
