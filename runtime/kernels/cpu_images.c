// The render of an image read from a file into a batch slot (deepdsl_runtime.image_transforms.render): one pass
// from the decoded uint8 (H, W, C) image to float32 (C, OH, OW), resampled by the plan's rows and columns (first
// source index and weights of each output row and column, computed once in Python: PIL's triangle filter, crop,
// flip and the evaluation transform are all in them), then x scale + bias per channel (normalization).
//
// The columns' taps first, over the rows the plan needs, into `scratch` ((r1 - r0) x OW x C floats; each source
// row converted to floats once, in the last W x C floats of `scratch`), then the rows' taps into one output row
// (OW x C floats after the first part), which is scaled and scattered to the channels. Each sum is acc = acc + w_t * x_t for t = 0, 1, ... in float32 (no fused multiply-add: the program
// is built with -ffp-contract=off), the order of the numpy path: both give the same bits. One thread: the images
// of a batch are spread over processes.
void deepdsl_resample_image(const uint8_t *image, int h, int w, int c,
                            const int *ys, const float *wy, int oh, int ty,
                            const int *xs, const float *wx, int ow, int tx,
                            const float *scale, const float *bias, float *out, float *scratch) {
    (void)h;
    int r0 = ys[0], r1 = ys[0] + ty;
    for (int o = 1; o < oh; o++) {
        r0 = ys[o] < r0 ? ys[o] : r0;
        r1 = ys[o] + ty > r1 ? ys[o] + ty : r1;
    }
    int x0 = xs[0], x1 = xs[0] + tx;                // the columns the plan reads
    for (int o = 1; o < ow; o++) {
        x0 = xs[o] < x0 ? xs[o] : x0;
        x1 = xs[o] + tx > x1 ? xs[o] + tx : x1;
    }
    const long row = (long)ow * c;
    float *cols = scratch;
    float *line = scratch + (long)(r1 - r0) * row;
    float *pixels = line + row;                      // one source row as floats, from column x0
    for (int r = r0; r < r1; r++) {
        const uint8_t *src = image + ((long)r * w + x0) * c;
        for (long j = 0; j < (long)(x1 - x0) * c; j++)
            pixels[j] = (float)src[j];
        float *dst = cols + (long)(r - r0) * row;
        if (c == 3) {
            for (int o = 0; o < ow; o++) {
                const float *p = pixels + (long)(xs[o] - x0) * 3;
                const float *k = wx + (long)o * tx;
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f;
                for (int t = 0; t < tx; t++) {
                    a0 = a0 + k[t] * p[3 * t];
                    a1 = a1 + k[t] * p[3 * t + 1];
                    a2 = a2 + k[t] * p[3 * t + 2];
                }
                dst[3 * o] = a0;
                dst[3 * o + 1] = a1;
                dst[3 * o + 2] = a2;
            }
        } else {
            for (int o = 0; o < ow; o++) {
                const float *p = pixels + (long)(xs[o] - x0) * c;
                const float *k = wx + (long)o * tx;
                for (int ch = 0; ch < c; ch++) {
                    float a = 0.0f;
                    for (int t = 0; t < tx; t++)
                        a = a + k[t] * p[(long)t * c + ch];
                    dst[(long)o * c + ch] = a;
                }
            }
        }
    }
    for (int oy = 0; oy < oh; oy++) {
        const float *k = wy + (long)oy * ty;
        const float *base = cols + (long)(ys[oy] - r0) * row;
        for (long j = 0; j < row; j++)
            line[j] = 0.0f;
        for (int t = 0; t < ty; t++) {
            const float kt = k[t];
            const float *s = base + (long)t * row;
            for (long j = 0; j < row; j++)
                line[j] = line[j] + kt * s[j];
        }
        for (int ch = 0; ch < c; ch++) {
            float *dst = out + ((long)ch * oh + oy) * ow;
            const float sc = scale[ch], bi = bias[ch];
            for (int ox = 0; ox < ow; ox++)
                dst[ox] = line[(long)ox * c + ch] * sc + bi;
        }
    }
}
