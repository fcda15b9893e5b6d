// Shared by the generic kernels (ops.cu) and the elementwise kernels of each generated network (generated/<net>.cu).
//
// Every kernel is written as a per-element (or per-row, per-column) function marked DEEPDSL_HD plus a thin
// __global__ wrapper. Compiled by nvcc the functions are __host__ __device__; compiled by a plain C++ compiler
// (no __CUDACC__) the wrappers disappear and the functions are ordinary inline functions, so the test suite runs
// the very same per-element code on the CPU, grid by grid, and compares it with the numpy backend.
//
// Index arithmetic is 32-bit unsigned: the runtime refuses tensors of 2^31 elements or more.
#pragma once

#ifdef __CUDACC__
#define DEEPDSL_HD __host__ __device__ __forceinline__
#define DEEPDSL_GLOBAL extern "C" __global__
#else
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#define DEEPDSL_HD inline
#endif

#include "deepdsl_math.h"
#include "deepdsl_random.h"

#define DEEPDSL_THREADS 256
#define DEEPDSL_NEG_INF (-__builtin_huge_valf())

typedef unsigned char deepdsl_u8;

// A grid-stride loop over [begin, end): what every one-thread-per-item wrapper runs.
#ifdef __CUDACC__
#define DEEPDSL_FOR(i, begin, end)                                                                             \
    for (unsigned i = (begin) + blockIdx.x * blockDim.x + threadIdx.x; i < (end); i += gridDim.x * blockDim.x)
#endif

// ---------------------------------------------------------------------------------------------------------------
// Elementwise kernels with numpy broadcasting.
//
// The runtime collapses the output shape and every input's broadcast pattern to at most four dimensions
// (d0, d1, d2, d3), right-aligned (deepdsl_runtime.cuda.layout.ew_layout), and gives each input one element stride
// per dimension: 0 where the input is broadcast. An input is a float32 or uint8 device array, or a host scalar
// (a hyperparameter such as the learning rate) passed by value. ND is how many trailing dimensions are in use
// (1, 2 or 4): the flat case needs no division at all.
//
// Layout contract with the launcher (it packs these as plain scalars, "IIII" and "PfiIIII" in native alignment):
struct EwShape {
    unsigned n;              // d0 * d1 * d2 * d3 output elements
    unsigned d1, d2, d3;
};

enum { EW_F32 = 0, EW_U8 = 1, EW_VALUE = 2 };

struct EwArg {
    const void* ptr;         // device array (EW_F32, EW_U8), unused for EW_VALUE
    float value;             // the scalar (EW_VALUE)
    int kind;
    unsigned stride[4];      // element strides over (d0, d1, d2, d3)
};

template <int ND>
struct EwIndex {
    unsigned c0, c1, c2, c3;

    DEEPDSL_HD EwIndex(const EwShape& s, unsigned i) {
        if (ND == 1) {
            c0 = c1 = c2 = 0;
            c3 = i;
        } else if (ND == 2) {
            c0 = c1 = 0;
            c3 = i % s.d3;
            c2 = i / s.d3;
        } else {
            c3 = i % s.d3;
            unsigned t = i / s.d3;
            c2 = t % s.d2;
            t /= s.d2;
            c1 = t % s.d1;
            c0 = t / s.d1;
        }
    }

    DEEPDSL_HD unsigned offset(const EwArg& a) const {
        return c0 * a.stride[0] + c1 * a.stride[1] + c2 * a.stride[2] + c3 * a.stride[3];
    }

    // uint8 inputs (dropout masks) compute as floats, as the reference semantics do
    DEEPDSL_HD float load(const EwArg& a) const {
        if (a.kind == EW_F32) return static_cast<const float*>(a.ptr)[offset(a)];
        if (a.kind == EW_U8) return static_cast<float>(static_cast<const deepdsl_u8*>(a.ptr)[offset(a)]);
        return a.value;
    }
};

