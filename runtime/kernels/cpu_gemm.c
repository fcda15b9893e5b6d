// Matrix products on the kernels' own threads (included by cpu_ops.c): one pool of threads for the whole step; the
// BLAS's sgemm computes them in parts, or the kernels' own tiles do (deepdsl_small_gemm, below).
//
// The BLAS numpy loaded (OpenBLAS) keeps threads of its own; between two products they sleep, and waking them, as
// waking the kernels' OpenMP threads after them, costs tens of microseconds on a virtual machine, several hundred
// times a step. Here a product is cut into parts, each computed by the BLAS's single-threaded sgemm (its own threads
// set to one) on the OpenMP team the elementwise kernels and the convolutions' passes run on. The last bits of a
// product depend on how it is cut (the BLAS's kernels round the edges of a part as their kernels for that edge do),
// so the cut is the caller's, fixed by the product's shape alone (deepdsl_runtime.contract.product_cuts), and the
// threads only take whole parts: a step computes the same bits on any number of threads.
//
// deepdsl_set_sgemm gives the BLAS's CBLAS sgemm (row-major calls; 64-bit integers where `ilp64`).

typedef void (*deepdsl_sgemm64)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                                const float*, int64_t, float, float*, int64_t);
typedef void (*deepdsl_sgemm32)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                                float*, int);
static void* deepdsl_sgemm_function;
static int deepdsl_sgemm_ilp64;

void deepdsl_set_sgemm(void* sgemm, int ilp64) {
    deepdsl_sgemm_function = sgemm;
    deepdsl_sgemm_ilp64 = ilp64;
}

enum { DEEPDSL_ROW_MAJOR = 101, DEEPDSL_NO_TRANS = 111, DEEPDSL_TRANS = 112 };
#define DEEPDSL_GEMM_PARALLEL_MIN 1e6   /* multiply-adds below which a product runs on one thread */

// c (m x n, rows ldc apart) = a (m x k) b (k x n) (+ c where `add`), each operand read transposed where ta / tb
// (then its rows are columns ld apart)
static void deepdsl_sgemm_into(int ta, int tb, long m, long n, long k, const float* a, long lda, const float* b,
                               long ldb, float* c, long ldc, int add) {
    const int oa = ta ? DEEPDSL_TRANS : DEEPDSL_NO_TRANS, ob = tb ? DEEPDSL_TRANS : DEEPDSL_NO_TRANS;
    const float beta = add ? 1.0f : 0.0f;
    if (deepdsl_sgemm_ilp64)
        ((deepdsl_sgemm64)deepdsl_sgemm_function)(DEEPDSL_ROW_MAJOR, oa, ob, m, n, k, 1.0f, a, lda, b, ldb, beta, c,
                                                  ldc);
    else
        ((deepdsl_sgemm32)deepdsl_sgemm_function)(DEEPDSL_ROW_MAJOR, oa, ob, (int)m, (int)n, (int)k, 1.0f, a,
                                                  (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

static void deepdsl_sgemm(int ta, int tb, long m, long n, long k, const float* a, long lda, const float* b,
                          long ldb, float* c, long ldc) {
    deepdsl_sgemm_into(ta, tb, m, n, k, a, lda, b, ldb, c, ldc, 0);
}

// The part of c = a b (+ c where `add`) of `size` columns (`by_columns`) or rows from column or row `first`.
static void deepdsl_sgemm_part(int ta, int tb, long m, long n, long k, const float* a, long lda, const float* b,
                               long ldb, float* c, long ldc, int by_columns, long first, long size, int add) {
    if (by_columns)
        deepdsl_sgemm_into(ta, tb, m, size, k, a, lda, b + (tb ? first * ldb : first), ldb, c + first, ldc, add);
    else
        deepdsl_sgemm_into(ta, tb, size, n, k, a + (ta ? first : first * lda), lda, b, ldb, c + first * ldc, ldc,
                           add);
}

// c[i] = a[i] b[i] for i < batch (a[i] at a + i * sa, ...: a stride of 0 broadcasts an operand), each product cut
// along the columns of c (`by_columns`), else its rows, into `parts` parts of `width` (the last one shorter, or
// empty): the threads take whole parts, the batch's parts in order. 0 without an sgemm.
int deepdsl_gemm(long batch, int ta, int tb, long m, long n, long k, const float* a, long lda, long sa,
                 const float* b, long ldb, long sb, float* c, long ldc, long sc, int by_columns, long parts,
                 long width) {
    if (!deepdsl_sgemm_function) return 0;
    const long side = by_columns ? n : m;
#pragma omp parallel if (batch * parts > 1 && (double)batch * m * n * k >= DEEPDSL_GEMM_PARALLEL_MIN)
    {
        long begin, end;
        deepdsl_share(batch * parts, 1, &begin, &end);
        for (long item = begin; item < end; ++item) {
            const long i = item / parts, first = item % parts * width;
            const long size = side - first < width ? side - first : width;
            if (size > 0)
                deepdsl_sgemm_part(ta, tb, m, n, k, a + i * sa, lda, b + i * sb, ldb, c + i * sc, ldc, by_columns,
                                   first, size, 0);
        }
    }
    return 1;
}

// c (m x n) = the sum over i < batch of a[i] b[i] (a[i] at a + i * sa, ...), cut along the columns of c
// (`by_columns`), else its rows, into `parts` parts of `width`: for each part, the first product into c, each next
// one added to it by the sgemm in order. A filter gradient of a pointwise convolution straight from its operands,
// sample by sample (a sum over samples whose (channels, positions) planes are not one matrix). The threads take
// whole parts; 0 without an sgemm.
int deepdsl_gemm_sum(long batch, int ta, int tb, long m, long n, long k, const float* a, long lda, long sa,
                     const float* b, long ldb, long sb, float* c, long ldc, int by_columns, long parts, long width) {
    if (!deepdsl_sgemm_function) return 0;
    const long side = by_columns ? n : m;
#pragma omp parallel if (parts > 1 && (double)batch * m * n * k >= DEEPDSL_GEMM_PARALLEL_MIN)
    {
        long begin, end;
        deepdsl_share(parts, 1, &begin, &end);
        for (long part = begin; part < end; ++part) {
            const long first = part * width, size = side - first < width ? side - first : width;
            for (long i = 0; i < batch && size > 0; ++i)
                deepdsl_sgemm_part(ta, tb, m, n, k, a + i * sa, lda, b + i * sb, ldb, c, ldc, by_columns, first, size,
                                   i > 0);
        }
    }
    return 1;
}

// c (m x n, rows ldc apart) += each of `count` planes (m x n, one after the other) in their order: this thread's
// share of the rows, in a team whose threads wrote the planes before a barrier.
static void deepdsl_add_planes(float* c, long ldc, const float* planes, long count, long m, long n) {
    long begin, end;
    deepdsl_share(m, 1, &begin, &end);
    for (long r = begin; r < end; ++r)
        for (long q = 0; q < count; ++q) {
            const float* from = planes + q * m * n + r * n;
            float* row = c + r * ldc;
#pragma omp simd
            for (long j = 0; j < n; ++j) row[j] += from[j];
        }
}

// c (m x n) = a (m x k) b (k x n) as `parts` products over consecutive `depth` of the inner dimension (the last one
// shorter): the first into c, the others into `partial` (m x n each, one after the other), then c += each partial
// product in their order. A product with too small an output to cut by rows or columns and a long inner dimension
// (a weight gradient) on several threads: the threads take whole parts, then whole rows of the sum. 0 without an
// sgemm.
int deepdsl_gemm_depth(int ta, int tb, long m, long n, long k, const float* a, long lda, const float* b, long ldb,
                       float* c, long ldc, long parts, long depth, float* partial) {
    if (!deepdsl_sgemm_function) return 0;
#pragma omp parallel if ((double)m * n * k >= DEEPDSL_GEMM_PARALLEL_MIN)
    {
        long begin, end;
        deepdsl_share(parts, 1, &begin, &end);
        for (long part = begin; part < end; ++part) {
            const long first = part * depth, size = k - first < depth ? k - first : depth;
            float* into = part ? partial + (part - 1) * m * n : c;
            deepdsl_sgemm(ta, tb, m, n, size, a + (ta ? first * lda : first), lda, b + (tb ? first : first * ldb),
                          ldb, into, part ? n : ldc);
        }
#pragma omp barrier
        deepdsl_add_planes(c, ldc, partial, parts - 1, m, n);
    }
    return 1;
}

// deepdsl_gemm with its arguments in one array of 64-bit integers, in the order of its parameters (the operands'
// addresses among them): a call from Python converts one pointer instead of 18 arguments.
// v[18]: a bias (n floats) added to every row of every product after it (none where 0), as an elementwise add
// over the product's result would add it.
int deepdsl_gemm_args(const int64_t* v) {
    if (!deepdsl_gemm(v[0], (int)v[1], (int)v[2], v[3], v[4], v[5], (const float*)(intptr_t)v[6], v[7], v[8],
                      (const float*)(intptr_t)v[9], v[10], v[11], (float*)(intptr_t)v[12], v[13], v[14], (int)v[15],
                      v[16], v[17]))
        return 0;
    const float* bias = (const float*)(intptr_t)v[18];
    if (bias) {
        const long batch = v[0], m = v[3], n = v[4], ldc = v[13], sc = v[14];
        float* c = (float*)(intptr_t)v[12];
#pragma omp parallel for schedule(static) if ((double)batch * m * n >= DEEPDSL_EW_PARALLEL_MIN)
        for (long row = 0; row < batch * m; ++row) {
            float* r = c + row / m * sc + row % m * ldc;
#pragma omp simd
            for (long j = 0; j < n; ++j) r[j] += bias[j];
        }
    }
    return 1;
}

// Products in tiles of the kernels' own, where contract.small_product takes them (a Transformer's projections,
// 1024 x 64 by 64 x 64, and their weight gradients; most products of the networks' layers): the BLAS's sgemm packs
// both operands on every call, and a product cut into the parts fixed by its shape calls it once a part. On one
// thread of an AVX-512 processor the tiles computed the ViT's products 1.2-1.5x faster than the sgemm so cut; with
// AVX2 they tie OpenBLAS's Haswell kernels (benchmarks/small_kernels.py). A tile of ROWS rows and VECTORS vectors of
// columns keeps its sums in registers over the inner dimension: each step is one broadcast of a's element per row
// and one fused multiply-add per vector (the Goto-van de Geijn micro-kernel, without packing a: its rows, or its
// columns where it is read transposed, are read in place). b is read in place by rows, or packed by rows (a strip
// of its columns, a part of the inner dimension at a time, on the thread's stack) where it is read transposed or
// the strip ends inside a vector.
//
// Every output is the sum of its products in one order: partial sums of fused multiply-adds from zero over at most
// DEEPDSL_SG_DEPTH consecutive terms of the inner dimension, added to the output in their order. Threads take whole
// tiles and each lane sums alone, so the bits depend neither on the thread count, nor on the tiles' shapes, nor on
// the vectors' width: AVX-512 and AVX2 give the same bits. Processors without AVX2 and fused multiply-adds have no
// such kernel (deepdsl_small_gemm returns 0; the BLAS computes the product).
#define DEEPDSL_SG_DEPTH 256            /* terms of a partial sum at most */
// Where b is read in place and the output is wide (DEEPDSL_SG_WIDE floats or more: past the L2 cache), a group of
// tiles writes its rows of c a strip at a time: with many rows at once (16 tiles, 96 rows) the processor fetched the
// lines written too late (a weight gradient of 4096 x 9216 from 16 samples: 49.5 ms at one thread with AVX-512, 20
// ms with 3 tiles); and b's strips are taken in panels that stay in the L2 cache over the groups (from 64 samples,
// with 3 tiles: 92 ms with one panel, 60 with panels). (On narrower outputs, a residual network's pointwise
// convolutions, groups of 3 tiles made its step 2 % slower with AVX2.)
#define DEEPDSL_SG_WIDE (1L << 20)      /* floats of a wide output */
#define DEEPDSL_SG_GROUP_TILES 3        /* tiles of a group where b is read in place and the output is wide */
#define DEEPDSL_SG_PANEL (1L << 17)     /* floats of b in a panel of strips at most (512 KB) */
#define DEEPDSL_SG_ROWS 6               /* rows of a tile */
#if defined(__AVX512F__)
#define DEEPDSL_SG_LANES 16
#define DEEPDSL_SG_VECTORS 4            /* 6 x 4 sums in 24 of 32 registers */
typedef __m512 deepdsl_sg_v;
typedef __mmask16 deepdsl_sg_m;
#define DEEPDSL_SG_ZERO() _mm512_setzero_ps()
#define DEEPDSL_SG_SET1(x) _mm512_set1_ps(x)
#define DEEPDSL_SG_FMA(x, y, z) _mm512_fmadd_ps(x, y, z)
#define DEEPDSL_SG_ADD(x, y) _mm512_add_ps(x, y)
#define DEEPDSL_SG_LOADU(p) _mm512_loadu_ps(p)
#define DEEPDSL_SG_STOREU(p, v) _mm512_storeu_ps(p, v)
#define DEEPDSL_SG_LOAD(p, mask) _mm512_maskz_loadu_ps(mask, p)
#define DEEPDSL_SG_STORE(p, mask, v) _mm512_mask_storeu_ps(p, mask, v)
static inline deepdsl_sg_m deepdsl_sg_mask(long lanes) {
    return lanes >= 16 ? (deepdsl_sg_m)0xFFFF : (deepdsl_sg_m)((1u << lanes) - 1u);
}
#define DEEPDSL_SG_TILES(X) X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(2, 1) X(2, 2) X(2, 3) X(2, 4) X(3, 1) X(3, 2) \
    X(3, 3) X(3, 4) X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(5, 1) X(5, 2) X(5, 3) X(5, 4) X(6, 1) X(6, 2) X(6, 3) X(6, 4)
#define DEEPDSL_SG_PACK_A 0             /* a read transposed in place (see below) */
#define DEEPDSL_SG_PACK_A_STRIPS 0
#define DEEPDSL_SG_PACK_A_DEPTH 0
#define DEEPDSL_SG_PACK_A_LD 0
#elif defined(__AVX2__) && defined(__FMA__)
#define DEEPDSL_SG_LANES 8
#define DEEPDSL_SG_VECTORS 2            /* 6 x 2 sums in 12 of 16 registers */
typedef __m256 deepdsl_sg_v;
typedef __m256i deepdsl_sg_m;
#define DEEPDSL_SG_ZERO() _mm256_setzero_ps()
#define DEEPDSL_SG_SET1(x) _mm256_set1_ps(x)
#define DEEPDSL_SG_FMA(x, y, z) _mm256_fmadd_ps(x, y, z)
#define DEEPDSL_SG_ADD(x, y) _mm256_add_ps(x, y)
#define DEEPDSL_SG_LOADU(p) _mm256_loadu_ps(p)
#define DEEPDSL_SG_STOREU(p, v) _mm256_storeu_ps(p, v)
#define DEEPDSL_SG_LOAD(p, mask) _mm256_maskload_ps(p, mask)
#define DEEPDSL_SG_STORE(p, mask, v) _mm256_maskstore_ps(p, mask, v)
static inline deepdsl_sg_m deepdsl_sg_mask(long lanes) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(lanes < 8 ? lanes : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define DEEPDSL_SG_TILES(X) X(1, 1) X(1, 2) X(2, 1) X(2, 2) X(3, 1) X(3, 2) X(4, 1) X(4, 2) X(5, 1) X(5, 2) \
    X(6, 1) X(6, 2)
// Where a is read transposed (its columns one after the other: a weight's transpose, an input gradient's product), a
// tile reads each term's 6 floats from a line of their own, a group of tiles 256 lines a chunk of the inner dimension
// for every strip: a group's rows of a are packed for each chunk and read from the copy by all of its strips
// (deepdsl_sg_pack_a; the same sums). With AVX2, 8 lanes a vector, a product has twice the strips to share the copy:
// on a Zen 3 (benchmarks/kernels_vs_checkout.py, one thread), ResNet-50's pointwise input gradients 1.1-1.2x as fast
// (1024 x 256 read transposed by 256 x 392, 256 x 1024 by 1024 x 392), a ViT's 64 x 1024 by 1024 x 128 1.3x. Where
// few strips share it, the chunk is shallow or a's columns lie close, the copy costs what it saves.
#define DEEPDSL_SG_PACK_A 1
#define DEEPDSL_SG_PACK_A_STRIPS 3      /* strips at least that read the copy */
#define DEEPDSL_SG_PACK_A_DEPTH 128     /* terms of the chunk at least */
#define DEEPDSL_SG_PACK_A_LD 64         /* floats from a column of a to the next at least */
#endif

#ifdef DEEPDSL_SG_LANES
#define DEEPDSL_SG_WIDTH (DEEPDSL_SG_VECTORS * DEEPDSL_SG_LANES)    /* columns of a tile, of a strip */

// c (R rows ldc apart, V vectors of columns, the last one's lanes `last` where `partial`) = (`add`: c +) the sum over
// p < depth of a[r * ra + p * ca] * b[p * ldb + column] (then + bias[column] where `bias`: the output finished, as an
// elementwise add after the product adds it), b's rows holding V whole vectors (unmasked loads: AVX's masked loads
// and stores are slow on AMD's processors; only a partial vector is stored under its mask)
static inline __attribute__((always_inline)) void deepdsl_sg_tile(
        int R, int V, long depth, const float* a, long ra, long ca, const float* b, long ldb, int partial,
        deepdsl_sg_m last, float* c, long ldc, int add, const float* bias) {
    deepdsl_sg_v acc[DEEPDSL_SG_ROWS][DEEPDSL_SG_VECTORS];
    #pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = DEEPDSL_SG_ZERO();
    for (long p = 0; p < depth; ++p) {
        const float* bp = b + p * ldb;
        deepdsl_sg_v bv[DEEPDSL_SG_VECTORS];
        #pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
            bv[v] = DEEPDSL_SG_LOADU(bp + v * DEEPDSL_SG_LANES);
            DEEPDSL_IN_REGISTER(bv[v]);
        }
        const float* ap = a + p * ca;
        #pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const deepdsl_sg_v x = DEEPDSL_SG_SET1(ap[r * ra]);
            #pragma GCC unroll 4
            for (int v = 0; v < V; ++v) acc[r][v] = DEEPDSL_SG_FMA(x, bv[v], acc[r][v]);
        }
    }
    deepdsl_sg_v bv[DEEPDSL_SG_VECTORS];
    if (bias) {
        #pragma GCC unroll 4
        for (int v = 0; v < V; ++v)
            bv[v] = partial && v == V - 1 ? DEEPDSL_SG_LOAD(bias + v * DEEPDSL_SG_LANES, last)
                                          : DEEPDSL_SG_LOADU(bias + v * DEEPDSL_SG_LANES);
    }
    #pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
            float* cp = c + r * ldc + v * DEEPDSL_SG_LANES;
            const int masked = partial && v == V - 1;
            deepdsl_sg_v x = acc[r][v];
            if (add) x = DEEPDSL_SG_ADD(masked ? DEEPDSL_SG_LOAD(cp, last) : DEEPDSL_SG_LOADU(cp), x);
            if (bias) x = DEEPDSL_SG_ADD(x, bv[v]);
            if (masked)
                DEEPDSL_SG_STORE(cp, last, x);
            else
                DEEPDSL_SG_STOREU(cp, x);
        }
}

// to (rows `width` floats apart) = `rows` rows of `columns` floats, `ld` apart from `from`, zeros after each up to
// `padded` floats: b's rows packed whole vectors wide, so that no load of a tile reaches past them
static inline void deepdsl_sg_rows(const float* from, long ld, long rows, long columns, long width, long padded,
                                   float* to) {
    for (long p = 0; p < rows; ++p) {
        memcpy(to + p * width, from + p * ld, columns * sizeof(float));
        memset(to + p * width + columns, 0, (padded - columns) * sizeof(float));
    }
}

#define DEEPDSL_SG_CASE(R, V) \
    case R * 8 + V: deepdsl_sg_tile(R, V, depth, a, ra, ca, b, ldb, partial, last, c, ldc, add, bias); break;
static void deepdsl_sg_tile_any(int R, int V, long depth, const float* a, long ra, long ca, const float* b, long ldb,
                                int partial, deepdsl_sg_m last, float* c, long ldc, int add, const float* bias) {
    switch (R * 8 + V) { DEEPDSL_SG_TILES(DEEPDSL_SG_CASE) }
}
#endif

#ifdef DEEPDSL_SG_LANES
// The work of a group of `tiles` tiles of strip s of a product of n columns: its tiles times the strip's vectors (a
// last strip of a few columns costs a fraction of a whole one); none past the last strip.
static inline long deepdsl_sg_cost(long n, long s, long tiles) {
    const long columns = n - s * DEEPDSL_SG_WIDTH;
    if (columns <= 0)
        return 0;
    const long vectors = columns >= DEEPDSL_SG_WIDTH ? DEEPDSL_SG_VECTORS
                                                     : (columns + DEEPDSL_SG_LANES - 1) / DEEPDSL_SG_LANES;
    return tiles * vectors;
}

// Item `item` of deepdsl_small_gemm_bias's (product, strip, group) where b is packed (`tb`), else (product, panel,
// group, strip in the panel): its strip *s (past the last one in the last panel: none) and group of tiles *g.
static inline void deepdsl_sg_item(long item, int tb, long strips, long groups, long panels, long panel, long* s,
                                   long* g) {
    if (tb) {
        *s = item / groups % strips;
        *g = item % groups;
        return;
    }
    const long r = item % (panels * groups * panel);
    *s = r / (groups * panel) * panel + r % panel;
    *g = r / panel % groups;
}

// [*begin, *end): this thread's items of deepdsl_small_gemm_bias (`items` in all; (product, strip, group) where b is
// packed, else (product, panel, group, strip in the panel)), those whose work before them (`deepdsl_sg_cost`) lies in
// its equal share of the whole: the threads' work differs by an item's at most, where equal counts of items left
// one thread a last group of fewer tiles and the last strips of few columns, the other whole ones (a pointwise
// convolution on 7x7 planes, 256 x 1024 by 1024 x 392: 1.72x as fast on two threads as on one, against 1.91x for
// 1024 x 256 by 256 x 392). In order, a thread's items contiguous; which thread computes a tile never changes its
// sums.
static void deepdsl_sg_share(long items, int tb, long n, long strips, long tiles, long group, long groups,
                             long panels, long panel, long* begin, long* end) {
#ifdef _OPENMP
    const long threads = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const long threads = 1, me = 0;
#endif
    long total = 0;
    for (int pass = 0; pass < 2; ++pass) {
        long before = 0;
        *begin = *end = items;
        for (long item = 0; item < items; ++item) {
            long s, g;
            deepdsl_sg_item(item, tb, strips, groups, panels, panel, &s, &g);
            if (pass == 1) {
                if (*begin == items && before * threads >= me * total)
                    *begin = item;
                if (before * threads >= (me + 1) * total) {
                    *end = item;
                    break;
                }
            }
            const long first = g * group, count = tiles - first < group ? tiles - first : group;
            before += deepdsl_sg_cost(n, s, count);
        }
        total = before;
    }
}

// The tiles t_begin <= t < t_end of strip s of c = a b over the chunk of the inner dimension from p0 (at most
// DEEPDSL_SG_DEPTH terms): into c, or added to it where `add`; b's strip packed into `packed` where it is read
// transposed or ends inside a vector. `bias` (n floats, or NULL): added to each output as it is stored, on the
// product's last chunk only. `a_packed` (or NULL: a read in place): these tiles' rows of a over the chunk as
// deepdsl_sg_pack_a lays them out.
static void deepdsl_sg_chunk(int tb, long m, long n, long k, const float* a, long ra, long ca, const float* b,
                             long ldb, long s, long t_begin, long t_end, long p0, float* c, long ldc, int add,
                             float* packed, const float* bias, const float* a_packed) {
    const long j0 = s * DEEPDSL_SG_WIDTH, columns = n - j0 < DEEPDSL_SG_WIDTH ? n - j0 : DEEPDSL_SG_WIDTH;
    const int V = (int)((columns + DEEPDSL_SG_LANES - 1) / DEEPDSL_SG_LANES);
    const int partial = columns % DEEPDSL_SG_LANES != 0, pack = tb || partial;
    const deepdsl_sg_m last = deepdsl_sg_mask(columns - (V - 1) * DEEPDSL_SG_LANES);
    const long depth = k - p0 < DEEPDSL_SG_DEPTH ? k - p0 : DEEPDSL_SG_DEPTH;
    const float* bp = b + p0 * ldb + j0;
    long ldp = ldb;
    if (pack) {                 // the strip's columns by rows, whole vectors (zeros past the last column)
        const long padded = V * DEEPDSL_SG_LANES;
        if (tb)                 // (b's columns are rows of the stored matrix; zeros to the strip's width)
            deepdsl_transpose_into(b + j0 * ldb + p0, columns, depth, ldb, packed, DEEPDSL_SG_WIDTH);
        else
            deepdsl_sg_rows(b + p0 * ldb + j0, ldb, depth, columns, DEEPDSL_SG_WIDTH, padded, packed);
        bp = packed;
        ldp = DEEPDSL_SG_WIDTH;
    }
    c += j0;
    const float* tail = bias && p0 + depth >= k ? bias + j0 : NULL;
    for (long t = t_begin; t < t_end; ++t) {
        const long r0 = t * DEEPDSL_SG_ROWS;
        const int R = (int)(m - r0 < DEEPDSL_SG_ROWS ? m - r0 : DEEPDSL_SG_ROWS);
        const float* at = a_packed ? a_packed + (t - t_begin) * DEEPDSL_SG_ROWS * depth : a + r0 * ra + p0 * ca;
        deepdsl_sg_tile_any(R, V, depth, at, a_packed ? 1 : ra, a_packed ? DEEPDSL_SG_ROWS : ca, bp, ldp, partial,
                            last, c + r0 * ldc, ldc, add, tail);
    }
}

// to = the rows of tiles t_begin <= t < t_end of an a read transposed (its columns lda apart), terms p0 to p0 +
// depth - 1: tile after tile, each term's DEEPDSL_SG_ROWS floats one after the other (the last tile's rows past m
// are left as they are: no tile reads them). The tiles then read ROWS floats a term, one after the other, where in
// place they read them from a line of their own for every term.
static void deepdsl_sg_pack_a(long m, const float* a, long lda, long t_begin, long t_end, long p0, long depth,
                              float* to) {
    for (long t = t_begin; t < t_end; ++t) {
        const long r0 = t * DEEPDSL_SG_ROWS, rows = m - r0 < DEEPDSL_SG_ROWS ? m - r0 : DEEPDSL_SG_ROWS;
        const float* from = a + r0 + p0 * lda;
        float* into = to + (t - t_begin) * DEEPDSL_SG_ROWS * depth;
        if (rows == DEEPDSL_SG_ROWS)          // (a copy of a constant size: two moves)
            for (long p = 0; p < depth; ++p)
                memcpy(into + p * DEEPDSL_SG_ROWS, from + p * lda, DEEPDSL_SG_ROWS * sizeof(float));
        else
            for (long p = 0; p < depth; ++p)
                for (long r = 0; r < rows; ++r) into[p * DEEPDSL_SG_ROWS + r] = from[p * lda + r];
    }
}
#endif

// Whether this build has the tiles (AVX2 and fused multiply-adds, or AVX-512).
int deepdsl_small_gemm_kernels(void) {
#ifdef DEEPDSL_SG_LANES
    return 1;
#else
    return 0;
#endif
}

// c[i] = a[i] b[i] (+ bias, n floats added to every row as each output is finished, where not NULL) for i < batch
// (a[i] at a + i * sa, ...: a stride of 0 broadcasts an operand; ta / tb: an operand read transposed, its rows
// columns ld apart), on the kernels' threads, which take whole groups of tiles; `add`: c[i] += a[i] b[i] (each
// chunk's partial sums added to c, the first one's too). 0 where this processor has no such kernel.
static int deepdsl_small_gemm_bias(long batch, int ta, int tb, long m, long n, long k, const float* a, long lda,
                                   long sa, const float* b, long ldb, long sb, float* c, long ldc, long sc,
                                   const float* bias, int add) {
#ifndef DEEPDSL_SG_LANES
    (void)batch; (void)ta; (void)tb; (void)m; (void)n; (void)k; (void)a; (void)lda; (void)sa; (void)b; (void)ldb;
    (void)sb; (void)c; (void)ldc; (void)sc; (void)bias; (void)add;
    return 0;
#else
    const long ra = ta ? 1 : lda, ca = ta ? lda : 1;
    const int pack_a = DEEPDSL_SG_PACK_A && ta && !tb;      // a's rows packed for runs of strips (AVX2 builds)
    const long tiles = (m + DEEPDSL_SG_ROWS - 1) / DEEPDSL_SG_ROWS;
    const long strips = (n + DEEPDSL_SG_WIDTH - 1) / DEEPDSL_SG_WIDTH;
#pragma omp parallel if ((double)batch * m * n * k >= DEEPDSL_GEMM_PARALLEL_MIN)
    {
#ifdef _OPENMP
        const long threads = omp_get_num_threads();
#else
        const long threads = 1;
#endif
        // groups of consecutive tiles of a strip: about eight per thread, of at most 16 tiles (which the strip of b
        // packed for them serves), or where b is read in place into a wide output, of at most DEEPDSL_SG_GROUP_TILES
        const int wide = !tb && (double)m * n >= DEEPDSL_SG_WIDE;
        long group = (batch * strips * tiles + threads * 8 - 1) / (threads * 8);
        const long most = wide ? DEEPDSL_SG_GROUP_TILES : 16;
        group = group < 1 ? 1 : group > most ? most : group;
        const long groups = (tiles + group - 1) / group;
        group = (tiles + groups - 1) / groups;          // groups of equal size, but for the last one
        // where b is read in place into a wide output, its strips in panels of at most DEEPDSL_SG_PANEL floats of b,
        // of equal sizes but for the last one (the items a share counts past the last strip are few)
        long panel = wide && k > 0 ? DEEPDSL_SG_PANEL / (k * DEEPDSL_SG_WIDTH) : strips;
        panel = panel > strips ? strips : panel < 1 ? 1 : panel;
        const long panels = (strips + panel - 1) / panel;
        panel = panels > 0 ? (strips + panels - 1) / panels : 1;
        float packed[DEEPDSL_SG_DEPTH * DEEPDSL_SG_WIDTH];          // 64 KB (16 KB with AVX2) of the stack
        float a_packed[DEEPDSL_SG_PACK_A ? 16 * DEEPDSL_SG_ROWS * DEEPDSL_SG_DEPTH : 1];   // 96 KB, a group's a
        long begin, end;
        deepdsl_sg_share(tb ? batch * strips * groups : batch * panels * groups * panel, tb, n, strips, tiles, group,
                         groups, panels, panel, &begin, &end);      // (b packed: one panel of all strips)
        // items (product, strip, group) where b is packed: a thread packs each strip of its share once; else
        // (product, panel, group, strip): a group of a's rows is read from the cache for every strip of a panel, and
        // the panel's b for every group (items past the last strip, in the last panel, are none)
        while (begin < end) {
            long i, s, t_begin, t_end;
            if (tb) {                   // the groups of one strip of one product in this thread's share
                i = begin / (strips * groups);
                s = begin / groups % strips;
                const long run_end = (i * strips + s + 1) * groups < end ? (i * strips + s + 1) * groups : end;
                t_begin = begin % groups * group;
                t_end = ((run_end - 1) % groups + 1) * group;
                begin = run_end;
            } else {
                i = begin / (panels * groups * panel);
                long g;
                deepdsl_sg_item(begin, 0, strips, groups, panels, panel, &s, &g);
                t_begin = g * group;
                t_end = t_begin + group;
                ++begin;
                if (s >= strips)
                    continue;
            }
            t_end = t_end < tiles ? t_end : tiles;
            long s_end = s + 1;     // where a is read transposed: this group's run of strips, a packed for them
            while (pack_a && begin < end) {
                long next, g2;
                deepdsl_sg_item(begin, 0, strips, groups, panels, panel, &next, &g2);
                if (begin / (panels * groups * panel) != i || g2 != t_begin / group || next != s_end ||
                        next >= strips)
                    break;
                ++s_end;
                ++begin;
            }
            for (long p0 = 0; p0 < k; p0 += DEEPDSL_SG_DEPTH) {
                const long depth = k - p0 < DEEPDSL_SG_DEPTH ? k - p0 : DEEPDSL_SG_DEPTH;
                const float* a_run = NULL;
                if (pack_a && s_end - s >= DEEPDSL_SG_PACK_A_STRIPS && depth >= DEEPDSL_SG_PACK_A_DEPTH &&
                        lda >= DEEPDSL_SG_PACK_A_LD) {
                    deepdsl_sg_pack_a(m, a + i * sa, lda, t_begin, t_end, p0, depth, a_packed);
                    a_run = a_packed;
                }
                for (long strip = s; strip < s_end; ++strip)
                    deepdsl_sg_chunk(tb, m, n, k, a + i * sa, ra, ca, b + i * sb, ldb, strip, t_begin, t_end, p0,
                                     c + i * sc, ldc, add || p0 > 0, packed, bias, a_run);
            }
        }
    }
    return 1;
#endif
}

int deepdsl_small_gemm(long batch, int ta, int tb, long m, long n, long k, const float* a, long lda, long sa,
                       const float* b, long ldb, long sb, float* c, long ldc, long sc) {
    return deepdsl_small_gemm_bias(batch, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, c, ldc, sc, NULL, 0);
}

// c (m x n) = the sum over i < batch of a[i] b[i] (a[i] at a + i * sa, b[i] at b + i * sb), in the kernels' tiles:
// each product in turn added to c (the first written into it), its chunks' partial sums in their order; the sum of
// a pointwise convolution's filter gradient over the samples (`deepdsl_gemm_sum` by the sgemm, product after
// product). The same bits on any number of threads. 0 where this processor has no tiles.
int deepdsl_small_gemm_sum(long batch, int ta, int tb, long m, long n, long k, const float* a, long lda, long sa,
                           const float* b, long ldb, long sb, float* c, long ldc) {
    for (long i = 0; i < batch; ++i)
        if (!deepdsl_small_gemm_bias(1, ta, tb, m, n, k, a + i * sa, lda, 0, b + i * sb, ldb, 0, c, ldc, 0, NULL,
                                     i > 0))
            return 0;
    return 1;
}

// c (m x n) = a b as deepdsl_small_gemm computes it, the same bits, with the partial sums of each DEEPDSL_SG_DEPTH
// terms of the inner dimension (chunks) on several threads at once: a product whose output has too few tiles to
// share (a weight gradient, 64 x 1024 by 1024 x 64: eleven tiles) and whose operands each thread would read whole.
// The first chunk's sums go to c, the others' to their own plane of `planes` (m x n each, one after the other);
// then c += each plane in the chunks' order: the additions deepdsl_small_gemm makes, in its order. The threads take
// whole chunks of a strip first (reading those rows of the operands only), then whole rows of the sum. On one
// thread, deepdsl_small_gemm (the planes would only add their traffic).
int deepdsl_small_gemm_depth(int ta, int tb, long m, long n, long k, const float* a, long lda, const float* b,
                             long ldb, float* c, long ldc, float* planes) {
#ifndef DEEPDSL_SG_LANES
    (void)ta; (void)tb; (void)m; (void)n; (void)k; (void)a; (void)lda; (void)b; (void)ldb; (void)c; (void)ldc;
    (void)planes;
    return 0;
#else
    const long ra = ta ? 1 : lda, ca = ta ? lda : 1;
    const long tiles = (m + DEEPDSL_SG_ROWS - 1) / DEEPDSL_SG_ROWS;
    const long strips = (n + DEEPDSL_SG_WIDTH - 1) / DEEPDSL_SG_WIDTH;
    const long chunks = (k + DEEPDSL_SG_DEPTH - 1) / DEEPDSL_SG_DEPTH;
    if (deepdsl_threads() < 2)
        return deepdsl_small_gemm(1, ta, tb, m, n, k, a, lda, 0, b, ldb, 0, c, ldc, 0);
#pragma omp parallel
    {
        float packed[DEEPDSL_SG_DEPTH * DEEPDSL_SG_WIDTH];
        long begin, end;
        deepdsl_share(chunks * strips, 1, &begin, &end);
        for (long item = begin; item < end; ++item) {
            const long chunk = item / strips, s = item % strips;
            float* into = chunk ? planes + (chunk - 1) * m * n : c;
            deepdsl_sg_chunk(tb, m, n, k, a, ra, ca, b, ldb, s, 0, tiles,
                             chunk * DEEPDSL_SG_DEPTH, into, chunk ? n : ldc, 0, packed, NULL, NULL);
        }
#pragma omp barrier
        deepdsl_add_planes(c, ldc, planes, chunks - 1, m, n);
    }
    return 1;
#endif
}

#ifdef DEEPDSL_SG_LANES
// c (m x n, rows ldc apart) = a (m x k, element (r, p) at a[r * ra + p * ca]) times b (k x n, rows ldb apart) in
// the tiles on the calling thread: strip by strip, each strip's chunks of the inner dimension in order.
static void deepdsl_sg_product(long m, long n, long k, const float* a, long ra, long ca, const float* b, long ldb,
                               float* c, long ldc, float* packed) {
    const long tiles = (m + DEEPDSL_SG_ROWS - 1) / DEEPDSL_SG_ROWS;
    for (long strip = 0; strip < (n + DEEPDSL_SG_WIDTH - 1) / DEEPDSL_SG_WIDTH; ++strip)
        for (long p0 = 0; p0 < k; p0 += DEEPDSL_SG_DEPTH)
            deepdsl_sg_chunk(0, m, n, k, a, ra, ca, b, ldb, strip, 0, tiles, p0, c, ldc, p0 > 0, packed, NULL,
                             NULL);
}

// The threads of a pass over `n` samples, each with a part of a scratch of `room` parts: the kernels', at most
// `room` and `n`.
static int deepdsl_sample_threads(long room, long n) {
    long threads = deepdsl_threads();
    threads = threads < room ? threads : room;
    return (int)(threads < n ? threads : n);
}
#endif

// out (n, o, ho, wo) = x (n, c, h, wd) convolved with w (o, c, kh, kw) (+ bias[o]), sample by sample on the kernels'
// threads: each sample's im2col matrix (c*kh*kw, ho*wo) written into the thread's own part of `cols` (room for
// `room` of them: the threads used at most), multiplied by the filters (o, c*kh*kw) in the tiles straight into the
// sample's output, then + bias. The tiles sum each output in the same order whatever their grouping: the bits of
// the tiles' product of each sample's im2col matrix, or of a chunk of samples' (runtime/cpu/conv.py) where they
// compute that, and the same bias added after them; without the batch's matrix in memory nor the regrouping of a
// product over samples. 0 where this processor has no tiles.
int deepdsl_conv_tiles(const float* x, const float* w, const float* bias, int n, int c, int h, int wd, int o, int kh,
                       int kw, int ho, int wo, int stride, int pad, float* cols, long room, float* out) {
#ifndef DEEPDSL_SG_LANES
    (void)x; (void)w; (void)bias; (void)n; (void)c; (void)h; (void)wd; (void)o; (void)kh; (void)kw; (void)ho;
    (void)wo; (void)stride; (void)pad; (void)cols; (void)room; (void)out;
    return 0;
#else
    const long ckk = (long)c * kh * kw, hw = (long)ho * wo;
    const int threads = deepdsl_sample_threads(room, n);
#pragma omp parallel num_threads(threads) if (threads > 1 && (double)n * o * hw * ckk >= DEEPDSL_GEMM_PARALLEL_MIN)
    {
        float packed[DEEPDSL_SG_DEPTH * DEEPDSL_SG_WIDTH];
        float* mine = deepdsl_thread_part(cols, ckk * hw);
        long begin, end;
        deepdsl_share(n, 1, &begin, &end);
        for (long s = begin; s < end; ++s) {
            float* to = out + s * o * hw;
            deepdsl_im2col_on(x + s * c * h * wd, 1, c, h, wd, kh, kw, ho, wo, stride, pad, mine, 0);
            deepdsl_sg_product(o, hw, ckk, w, ckk, 1, mine, hw, to, hw, packed);
            if (bias)
                for (long r = 0; r < o; ++r) deepdsl_copy_row(to + r * hw, to + r * hw, hw, bias[r]);
        }
    }
    return 1;
#endif
}

// dx (n, c, h, wd) = the input gradient of a convolution of x (n, c, h, wd) with w (o, c, kh, kw) whose output
// gradient is g (n, o, ho, wo), sample by sample on the kernels' threads: each sample's column gradients
// (c*kh*kw, ho*wo) = the filters read transposed times the sample's output gradient, in the tiles, into the thread's
// own part of `cols` (room for `room` of them: the threads used at most), then col2im into the sample's input
// gradient (each position the sum of its windows' values in the order of the taps, deepdsl_col2im). The bits of the
// tiles' product and col2im of any number of samples at once. 0 where this processor has no tiles.
int deepdsl_conv_data_tiles(const float* g, const float* w, int n, int c, int h, int wd, int o, int kh, int kw,
                            int ho, int wo, int stride, int pad, float* cols, long room, float* dx) {
#ifndef DEEPDSL_SG_LANES
    (void)g; (void)w; (void)n; (void)c; (void)h; (void)wd; (void)o; (void)kh; (void)kw; (void)ho; (void)wo;
    (void)stride; (void)pad; (void)cols; (void)room; (void)dx;
    return 0;
#else
    const long ckk = (long)c * kh * kw, hw = (long)ho * wo;
    const int threads = deepdsl_sample_threads(room, n);
#pragma omp parallel num_threads(threads) if (threads > 1 && (double)n * o * hw * ckk >= DEEPDSL_GEMM_PARALLEL_MIN)
    {
        float packed[DEEPDSL_SG_DEPTH * DEEPDSL_SG_WIDTH];
        float* mine = deepdsl_thread_part(cols, ckk * hw);
        long begin, end;
        deepdsl_share(n, 1, &begin, &end);
        for (long s = begin; s < end; ++s) {
            deepdsl_sg_product(ckk, hw, o, w, 1, ckk, g + s * o * hw, hw, mine, hw, packed);
            deepdsl_col2im_on(mine, 0, hw, 1, c, h, wd, kh, kw, ho, wo, stride, pad, dx + s * c * h * wd, 0);
        }
    }
    return 1;
#endif
}

// deepdsl_small_gemm with its arguments in one array of 64-bit integers, as deepdsl_gemm_args; v[15]: the bias
// (0: none).
int deepdsl_small_gemm_args(const int64_t* v) {
    return deepdsl_small_gemm_bias(v[0], (int)v[1], (int)v[2], v[3], v[4], v[5], (const float*)(intptr_t)v[6], v[7],
                                   v[8], (const float*)(intptr_t)v[9], v[10], v[11], (float*)(intptr_t)v[12], v[13],
                                   v[14], (const float*)(intptr_t)v[15], 0);
}

// Products of few rows by a long matrix read transposed, c (m x n) = a (m x k) b^T with b's n rows of k floats read
// in place, where contract.dot_product takes them: a fully connected layer's forward on a small batch, whose
// weights (4096 x 9216 floats, 151 MB) are read once, from memory. The sgemm packs them, and the tiles transpose
// them into strips (at about half the speed at which one core reads memory here); these dot products read each row
// of b as it lies, 16 floats at a time, a stream per row of b. A thread takes DEEPDSL_DOT_COLUMNS rows of b at a
// time and goes over each piece of DEEPDSL_DOT_PIECE terms of them with a's rows, DEEPDSL_DOT_ROWS at a time, their
// sums in registers over the piece (the piece of a's rows and of b's stay in the L1 cache meanwhile), then on the
// stack until the chunk's next piece.
//
// Every output is the sum of its products in one order: in chunks of DEEPDSL_DOT_CHUNK consecutive terms, each the
// sum of 16 lanes, lane l the fused multiply-adds from zero of terms k = l (mod 16) in order (256 of them at most),
// the lanes added as a tree (l and l + 8, then l and l + 4, l and l + 2, 0 and 1), the chunks' sums added to the
// output in order, then + bias. Threads take whole rows of b, and AVX2's vectors of 8 lanes keep each 16 lanes' sums
// in two, so the bits depend neither on the thread count nor on the vectors' width.
#ifdef DEEPDSL_SG_LANES
#define DEEPDSL_DOT_CHUNK 4096          /* terms of a chunk: 256 a lane */
#define DEEPDSL_DOT_PIECE 256           /* terms of a piece: a's rows' pieces, 16 KB for 16 rows */
#define DEEPDSL_DOT_MOST 16             /* rows of a at most (contract.DOT_PRODUCT_ROWS) */
#if defined(__AVX512F__)
#define DEEPDSL_DOT_ROWS 2              /* 2 x 8 sums */
#define DEEPDSL_DOT_COLUMNS 8
#else
#define DEEPDSL_DOT_ROWS 1              /* 1 x 6 sums of two vectors: 12 of 16 registers, with a's 2 and b's 2 */
#define DEEPDSL_DOT_COLUMNS 6
#endif

// sums[r][j][16] (+)= the lanes' sums of a's rows r < R (lda apart) by b's rows j < J (ldb apart) over the piece's
// `terms` floats (a multiple of 16 but for the product's last piece; the lanes past it read as zeros), from zero
// where `first`.
static inline __attribute__((always_inline)) void deepdsl_dot_block(
        int R, int J, long terms, const float* a, long lda, const float* b, long ldb, int first, float* sums) {
    const long whole = terms / 16 * 16;
#if defined(__AVX512F__)
    __m512 acc[DEEPDSL_DOT_ROWS][DEEPDSL_DOT_COLUMNS];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 8
        for (int j = 0; j < J; ++j)
            acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r * DEEPDSL_DOT_COLUMNS + j) * 16);
    for (long p = 0; p <= whole; p += 16) {
        const __mmask16 lanes = p < whole ? (__mmask16)0xffff : (__mmask16)((1u << (terms - whole)) - 1);
        if (!lanes) break;
        __m512 av[DEEPDSL_DOT_ROWS], bv[DEEPDSL_DOT_COLUMNS];
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) av[r] = _mm512_maskz_loadu_ps(lanes, a + r * lda + p);
        #pragma GCC unroll 8
        for (int j = 0; j < J; ++j) bv[j] = _mm512_maskz_loadu_ps(lanes, b + j * ldb + p);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            #pragma GCC unroll 8
            for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(av[r], bv[j], acc[r][j]);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 8
        for (int j = 0; j < J; ++j) _mm512_storeu_ps(sums + (r * DEEPDSL_DOT_COLUMNS + j) * 16, acc[r][j]);
#else
    __m256 lo[DEEPDSL_DOT_ROWS][DEEPDSL_DOT_COLUMNS], hi[DEEPDSL_DOT_ROWS][DEEPDSL_DOT_COLUMNS];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 8
        for (int j = 0; j < J; ++j) {
            const float* s = sums + (r * DEEPDSL_DOT_COLUMNS + j) * 16;
            lo[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(s);
            hi[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(s + 8);
        }
    for (long p = 0; p < whole; p += 16) {
        __m256 a0[DEEPDSL_DOT_ROWS], a1[DEEPDSL_DOT_ROWS];
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            a0[r] = _mm256_loadu_ps(a + r * lda + p);
            a1[r] = _mm256_loadu_ps(a + r * lda + p + 8);
        }
        #pragma GCC unroll 8
        for (int j = 0; j < J; ++j) {
            const __m256 b0 = _mm256_loadu_ps(b + j * ldb + p), b1 = _mm256_loadu_ps(b + j * ldb + p + 8);
            #pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                lo[r][j] = _mm256_fmadd_ps(a0[r], b0, lo[r][j]);
                hi[r][j] = _mm256_fmadd_ps(a1[r], b1, hi[r][j]);
            }
        }
    }
    if (terms > whole) {        // (the product's last terms: the lanes past them read as zeros)
        const deepdsl_v8i mlo = deepdsl_inside(0, (int)(terms - whole)), mhi = deepdsl_inside(8, (int)(terms - whole));
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m256 a0 = (__m256)deepdsl_load(a + r * lda + whole, mlo);
            const __m256 a1 = (__m256)deepdsl_load(a + r * lda + whole + 8, mhi);
            #pragma GCC unroll 8
            for (int j = 0; j < J; ++j) {
                lo[r][j] = _mm256_fmadd_ps(a0, (__m256)deepdsl_load(b + j * ldb + whole, mlo), lo[r][j]);
                hi[r][j] = _mm256_fmadd_ps(a1, (__m256)deepdsl_load(b + j * ldb + whole + 8, mhi), hi[r][j]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 8
        for (int j = 0; j < J; ++j) {
            float* s = sums + (r * DEEPDSL_DOT_COLUMNS + j) * 16;
            _mm256_storeu_ps(s, lo[r][j]);
            _mm256_storeu_ps(s + 8, hi[r][j]);
        }
#endif
}

#define DEEPDSL_DOT_CASE(R, J) \
    case R * 16 + J: deepdsl_dot_block(R, J, terms, a, lda, b, ldb, first, sums); break;
static void deepdsl_dot_block_any(int R, int J, long terms, const float* a, long lda, const float* b, long ldb,
                                  int first, float* sums) {
    switch (R * 16 + J) {
#if defined(__AVX512F__)
    DEEPDSL_DOT_CASE(1, 1) DEEPDSL_DOT_CASE(1, 2) DEEPDSL_DOT_CASE(1, 3) DEEPDSL_DOT_CASE(1, 4)
    DEEPDSL_DOT_CASE(1, 5) DEEPDSL_DOT_CASE(1, 6) DEEPDSL_DOT_CASE(1, 7) DEEPDSL_DOT_CASE(1, 8)
    DEEPDSL_DOT_CASE(2, 1) DEEPDSL_DOT_CASE(2, 2) DEEPDSL_DOT_CASE(2, 3) DEEPDSL_DOT_CASE(2, 4)
    DEEPDSL_DOT_CASE(2, 5) DEEPDSL_DOT_CASE(2, 6) DEEPDSL_DOT_CASE(2, 7) DEEPDSL_DOT_CASE(2, 8)
#else
    DEEPDSL_DOT_CASE(1, 1) DEEPDSL_DOT_CASE(1, 2) DEEPDSL_DOT_CASE(1, 3) DEEPDSL_DOT_CASE(1, 4)
    DEEPDSL_DOT_CASE(1, 5) DEEPDSL_DOT_CASE(1, 6)
#endif
    }
}

// The 16 lanes' sum as a tree: lanes l and l + 8, then l and l + 4, l and l + 2, 0 and 1.
static inline float deepdsl_dot_lanes(const float* s) {
    float t[8];
    for (int l = 0; l < 8; ++l) t[l] = s[l] + s[l + 8];
    for (int l = 0; l < 4; ++l) t[l] = t[l] + t[l + 4];
    for (int l = 0; l < 2; ++l) t[l] = t[l] + t[l + 2];
    return t[0] + t[1];
}

// c[i] = a[i] b[i]^T (+ bias, n floats added to every row at the end, where not NULL) for i < batch (a[i] at a + i *
// sa, ...), m <= DEEPDSL_DOT_MOST; the threads take whole blocks of DEEPDSL_DOT_COLUMNS rows of b. 0 where this
// processor has no such kernel or m is larger.
static int deepdsl_dot_gemm(long batch, long m, long n, long k, const float* a, long lda, long sa, const float* b,
                            long ldb, long sb, float* c, long ldc, long sc, const float* bias) {
    if (m > DEEPDSL_DOT_MOST) return 0;
    const long blocks = (n + DEEPDSL_DOT_COLUMNS - 1) / DEEPDSL_DOT_COLUMNS;
#pragma omp parallel if ((double)batch * m * n * k >= DEEPDSL_GEMM_PARALLEL_MIN)
    {
        float sums[DEEPDSL_DOT_MOST / DEEPDSL_DOT_ROWS * DEEPDSL_DOT_ROWS * DEEPDSL_DOT_COLUMNS * 16];
        long begin, end;
        deepdsl_share(batch * blocks, 1, &begin, &end);
        for (long item = begin; item < end; ++item) {
            const long i = item / blocks, j0 = item % blocks * DEEPDSL_DOT_COLUMNS;
            const int J = (int)(n - j0 < DEEPDSL_DOT_COLUMNS ? n - j0 : DEEPDSL_DOT_COLUMNS);
            const float* ai = a + i * sa;
            const float* bj = b + i * sb + j0 * ldb;
            float* cj = c + i * sc + j0;
            for (long k0 = 0; k0 < k; k0 += DEEPDSL_DOT_CHUNK) {
                const long chunk_end = k - k0 < DEEPDSL_DOT_CHUNK ? k : k0 + DEEPDSL_DOT_CHUNK;
                for (long p0 = k0; p0 < chunk_end; p0 += DEEPDSL_DOT_PIECE) {
                    const long terms = chunk_end - p0 < DEEPDSL_DOT_PIECE ? chunk_end - p0 : DEEPDSL_DOT_PIECE;
                    for (long r0 = 0; r0 < m; r0 += DEEPDSL_DOT_ROWS) {
                        const int R = (int)(m - r0 < DEEPDSL_DOT_ROWS ? m - r0 : DEEPDSL_DOT_ROWS);
                        deepdsl_dot_block_any(R, J, terms, ai + r0 * lda + p0, lda, bj + p0, ldb, p0 == k0,
                                              sums + r0 * DEEPDSL_DOT_COLUMNS * 16);
                    }
                }
                for (long r = 0; r < m; ++r)
                    for (int j = 0; j < J; ++j) {
                        const float total = deepdsl_dot_lanes(sums + (r * DEEPDSL_DOT_COLUMNS + j) * 16);
                        float* out = cj + r * ldc + j;
                        *out = k0 == 0 ? total : *out + total;
                    }
            }
            if (bias)
                for (long r = 0; r < m; ++r)
                    for (int j = 0; j < J; ++j) cj[r * ldc + j] += bias[j0 + j];
        }
    }
    return 1;
}
#endif

// deepdsl_dot_gemm with its arguments in one array of 64-bit integers, as deepdsl_small_gemm_args (v[1] and v[2],
// a and b read transposed, must be 0 and 1); v[15]: the bias (0: none). 0 where the kernel does not take it.
int deepdsl_dot_gemm_args(const int64_t* v) {
#ifdef DEEPDSL_SG_LANES
    if (v[1] != 0 || v[2] != 1) return 0;
    return deepdsl_dot_gemm(v[0], v[3], v[4], v[5], (const float*)(intptr_t)v[6], v[7], v[8],
                            (const float*)(intptr_t)v[9], v[10], v[11], (float*)(intptr_t)v[12], v[13], v[14],
                            (const float*)(intptr_t)v[15]);
#else
    (void)v;
    return 0;
#endif
}
