// Matrix products on the kernels' own threads (included by cpu_ops.c): one pool of threads for the whole step.
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

// c (m x n, rows ldc apart) = a (m x k) b (k x n), each operand read transposed where ta / tb (then its rows are
// columns ld apart)
static void deepdsl_sgemm(int ta, int tb, long m, long n, long k, const float* a, long lda, const float* b,
                          long ldb, float* c, long ldc) {
    const int oa = ta ? DEEPDSL_TRANS : DEEPDSL_NO_TRANS, ob = tb ? DEEPDSL_TRANS : DEEPDSL_NO_TRANS;
    if (deepdsl_sgemm_ilp64)
        ((deepdsl_sgemm64)deepdsl_sgemm_function)(DEEPDSL_ROW_MAJOR, oa, ob, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c,
                                                  ldc);
    else
        ((deepdsl_sgemm32)deepdsl_sgemm_function)(DEEPDSL_ROW_MAJOR, oa, ob, (int)m, (int)n, (int)k, 1.0f, a,
                                                  (int)lda, b, (int)ldb, 0.0f, c, (int)ldc);
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
            if (size <= 0) continue;
            const float* ai = a + i * sa;
            const float* bi = b + i * sb;
            float* ci = c + i * sc;
            if (by_columns)
                deepdsl_sgemm(ta, tb, m, size, k, ai, lda, bi + (tb ? first * ldb : first), ldb, ci + first, ldc);
            else
                deepdsl_sgemm(ta, tb, size, n, k, ai + (ta ? first : first * lda), lda, bi, ldb, ci + first * ldc,
                              ldc);
        }
    }
    return 1;
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
        deepdsl_share(m, 1, &begin, &end);
        for (long r = begin; r < end; ++r)
            for (long part = 1; part < parts; ++part) {
                const float* from = partial + (part - 1) * m * n + r * n;
                float* row = c + r * ldc;
#pragma omp simd
                for (long j = 0; j < n; ++j) row[j] += from[j];
            }
    }
    return 1;
}
