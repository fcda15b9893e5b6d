// Tiled SGEMM/DGEMM for row-major tiles: C = alpha * op(A) * op(B) + beta * C.
//
// The fallback tile kernel of the tiled GEMM when cuBLAS cannot be loaded.
// Shapes: op(A) is m x k, op(B) is k x n, C is m x n; lda/ldb/ldc are row
// strides in elements.  A transposed operand is read transposed in place
// (the stored A is k x m when transa != 0, the stored B is n x k when transb != 0).
// When beta == 0, C is written without being read, so NaNs in C cannot leak.
//
// Each 16 x 16 thread block computes a 64 x 64 tile of C, each thread a 4 x 4
// micro-tile with rows ty + 16 i and columns tx + 16 j (so a warp's stores are
// contiguous).  The k dimension is walked in slabs of 16 staged in shared memory;
// operand loads are coalesced along whichever axis is contiguous in memory.
// Launch: grid = (ceil(n / 64), ceil(m / 64)), block = (16, 16)
// (runtime/cuda/driver.py: gemm_launch_config).

#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 16
#define GEMM_TX 16
#define GEMM_TY 16
#define GEMM_THREADS (GEMM_TX * GEMM_TY)

// Stage a GEMM_BK-deep slab of one operand into shared memory as S[kk][r]: rows [first, first + ROWS) and depth
// [k0, k0 + GEMM_BK) of an operand of rows x k elements, stored rows x k (contiguous in k) or, when `stored_by_k`,
// k x rows (contiguous in rows); zero past its edges. Loads are coalesced along the contiguous axis. op(A) is
// A's rows (stored by k when transposed), op(B) B's columns (stored by k unless transposed).
template <typename T, int ROWS>
__device__ __forceinline__ void gemm_stage(T (*S)[ROWS + 1], const T* __restrict__ M, int ld, int stored_by_k,
                                           int rows, int k, int first, int k0, int tid) {
#pragma unroll
    for (int l = 0; l < (ROWS * GEMM_BK) / GEMM_THREADS; ++l) {
        const int idx = tid + l * GEMM_THREADS;
        int r, kk;
        if (stored_by_k) { kk = idx / ROWS; r = idx % ROWS; }
        else             { r = idx / GEMM_BK; kk = idx % GEMM_BK; }
        const int gr = first + r, gk = k0 + kk;
        T v = T(0);
        if (gr < rows && gk < k) v = stored_by_k ? M[(long long)gk * ld + gr] : M[(long long)gr * ld + gk];
        S[kk][r] = v;
    }
}

template <typename T>
__device__ __forceinline__ void gemm_tile_body(int m, int n, int k, T alpha,
                                               const T* __restrict__ A, int lda, int transa,
                                               const T* __restrict__ B, int ldb, int transb,
                                               T beta, T* __restrict__ C, int ldc) {
    __shared__ T As[GEMM_BK][GEMM_BM + 1];  // As[kk][row]
    __shared__ T Bs[GEMM_BK][GEMM_BN + 1];  // Bs[kk][col]

    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    const int tid = ty * GEMM_TX + tx;
    const int row0 = blockIdx.y * GEMM_BM;
    const int col0 = blockIdx.x * GEMM_BN;

    T acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = T(0);

    for (int k0 = 0; k0 < k; k0 += GEMM_BK) {
        // Stage op(A)[row0 : row0 + 64, k0 : k0 + 16] and op(B)[k0 : k0 + 16, col0 : col0 + 64].
        gemm_stage<T, GEMM_BM>(As, A, lda, transa, m, k, row0, k0, tid);
        gemm_stage<T, GEMM_BN>(Bs, B, ldb, !transb, n, k, col0, k0, tid);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; ++kk) {
            T a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + GEMM_TY * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + GEMM_TX * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = row0 + ty + GEMM_TY * i;
        if (r >= m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = col0 + tx + GEMM_TX * j;
            if (c >= n) continue;
            T* out = C + (long long)r * ldc + c;
            *out = (beta == T(0)) ? alpha * acc[i][j] : alpha * acc[i][j] + beta * *out;
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
deepdsl_sgemm_tile(int m, int n, int k, float alpha, const float* A, int lda, int transa,
                   const float* B, int ldb, int transb, float beta, float* C, int ldc) {
    gemm_tile_body<float>(m, n, k, alpha, A, lda, transa, B, ldb, transb, beta, C, ldc);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
deepdsl_dgemm_tile(int m, int n, int k, double alpha, const double* A, int lda, int transa,
                   const double* B, int ldb, int transb, double beta, double* C, int ldc) {
    gemm_tile_body<double>(m, n, k, alpha, A, lda, transa, B, ldb, transb, beta, C, ldc);
}
