// The render of an image read from a file into a batch slot (deepdsl_runtime.image_transforms.render): one pass
// from the decoded uint8 (H, W, C) image to float32 (C, OH, OW), resampled by the plan's rows and columns (first
// source index and weights of each output row and column, computed once in Python: PIL's triangle filter, crop,
// flip and the evaluation transform are all in them), then x scale + bias per channel (normalization).
//
// Eight output rows at a time (DEEPDSL_IMAGE_ROWS, a vector of floats): the rows' taps first, vectorized along the
// source rows over the columns the plan reads (pixels converted to floats as they are read), each eight results
// transposed into `scratch`, a vector of the eight rows per channel and column (C x (x1 - x0) x 8 floats); then the
// columns' taps vectorized over those eight rows, eight output columns at a time transposed back into rows of
// `out`, x scale + bias. Each sum is acc = acc + w_t * x_t for t = 0, 1, ... in float32 (no fused multiply-add: the
// program is built with -ffp-contract=off), the order of the numpy path: both give the same bits. One thread: the
// images of a batch are spread over processes.

#define DEEPDSL_IMAGE_ROWS 8

// Eight bytes as floats (gcc converts a vector of bytes to floats one lane at a time).
#if defined(__SSE4_1__) && !defined(__AVX__)
#include <immintrin.h>
#endif
static inline __attribute__((always_inline)) deepdsl_v8f deepdsl_byte_floats(const uint8_t *p) {
#if defined(__AVX2__)
    return (deepdsl_v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif defined(__SSE4_1__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const deepdsl_v4f lo = (deepdsl_v4f)_mm_cvtepi32_ps(_mm_cvtepu8_epi32(b));
    const deepdsl_v4f hi = (deepdsl_v4f)_mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_srli_si128(b, 4)));
    deepdsl_v8f v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((float *)&v + 4, &hi, sizeof hi);
    return v;
#else
    deepdsl_v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, deepdsl_v8i), deepdsl_v8f);
#endif
}

void deepdsl_resample_image(const uint8_t *image, int h, int w, int c,
                            const int *ys, const float *wy, int oh, int ty,
                            const int *xs, const float *wx, int ow, int tx,
                            const float *scale, const float *bias, float *out, float *scratch) {
    (void)h;
    int x0 = xs[0], x1 = xs[0] + tx;                // the columns the plan reads
    for (int o = 1; o < ow; o++) {
        x0 = xs[o] < x0 ? xs[o] : x0;
        x1 = xs[o] + tx > x1 ? xs[o] + tx : x1;
    }
    const long width = x1 - x0, n = width * c, stride = (long)w * c;
    float *rows = scratch;                           // rows[(ch * width + x - x0) * 8 + k]: output row oy + k
    for (int oy = 0; oy < oh; oy += DEEPDSL_IMAGE_ROWS) {
        const int count = oh - oy < DEEPDSL_IMAGE_ROWS ? oh - oy : DEEPDSL_IMAGE_ROWS;
        const uint8_t *src[DEEPDSL_IMAGE_ROWS];
        const float *ky[DEEPDSL_IMAGE_ROWS];
        for (int k = 0; k < DEEPDSL_IMAGE_ROWS; k++) {       // rows past the last repeat it (never stored)
            const int r = oy + (k < count ? k : count - 1);
            src[k] = image + (long)ys[r] * stride + (long)x0 * c;
            ky[k] = wy + (long)r * ty;
        }
        // the rows' taps: element j = x * c + ch of the columns read
        long j = 0, at = 0, part = 0;                // j = at * c + part
        for (; j + 8 <= n; j += 8) {
            deepdsl_v8f v[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                v[k] = (deepdsl_v8f){0};
            for (int t = 0; t < ty; t++) {
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++)
                    v[k] = v[k] + ky[k][t] * deepdsl_byte_floats(src[k] + j + t * stride);
            }
            deepdsl_transpose8(v);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                memcpy(rows + (part * width + at) * 8, &v[i], sizeof v[i]);
                if (++part == c)
                    part = 0, at++;
            }
        }
        for (; j < n; j++) {
            for (int k = 0; k < 8; k++) {
                float a = 0.0f;
                for (int t = 0; t < ty; t++)
                    a = a + ky[k][t] * (float)src[k][j + t * stride];
                rows[(part * width + at) * 8 + k] = a;
            }
            if (++part == c)
                part = 0, at++;
        }
        // the columns' taps, x scale + bias
        for (int ch = 0; ch < c; ch++) {
            const float sc = scale[ch], bi = bias[ch];
            const float *plane = rows + ch * width * 8;
            float *dst = out + ((long)ch * oh + oy) * ow;
            int o = 0;
            for (; o + 8 <= ow; o += 8) {
                deepdsl_v8f v[8];
                const float *p[8], *kx = wx + (long)o * tx;
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    v[i] = (deepdsl_v8f){0};
                    p[i] = plane + (long)(xs[o + i] - x0) * 8;
                }
                for (int t = 0; t < tx; t++) {
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i++) {
                        deepdsl_v8f s;
                        memcpy(&s, p[i] + t * 8, sizeof s);
                        v[i] = v[i] + kx[i * tx + t] * s;
                    }
                }
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    v[i] = v[i] * sc + bi;
                deepdsl_transpose8(v);
                for (int k = 0; k < count; k++)
                    memcpy(dst + (long)k * ow + o, &v[k], sizeof v[k]);
            }
            for (; o < ow; o++) {
                const float *p = plane + (long)(xs[o] - x0) * 8, *kx = wx + (long)o * tx;
                deepdsl_v8f a = {0};
                for (int t = 0; t < tx; t++) {
                    deepdsl_v8f s;
                    memcpy(&s, p + t * 8, sizeof s);
                    a = a + kx[t] * s;
                }
                a = a * sc + bi;
                for (int k = 0; k < count; k++)
                    dst[(long)k * ow + o] = a[k];
            }
        }
    }
}
