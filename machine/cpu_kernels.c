/* Three of the model's row-wise and element-wise operations, forward and backward, each in
 * one pass over its tensors, for training on a CPU in float32. machine/cpu_kernels.py says
 * why they exist and when they run; tests/test_model.py checks each against PyTorch's own
 * operations. Every tensor is float32 and, except for RMSNorm's input, contiguous. Loops over
 * rows or elements are shared among the threads of the OpenMP runtime that PyTorch uses. */
#include <math.h>
#include <stdint.h>

/* RMSNorm without a gain, over rows of n: y = x r, with r = 1 / sqrt(mean(x^2) + eps) kept
 * per row for the backward pass. x's rows come in groups of `inner` consecutive rows, the
 * groups `stride` floats apart (the queries' and keys' heads of each token, say, which the
 * values' heads follow); y and r are contiguous. */
void rms_norm_forward(const float *x, float *y, float *r, int64_t rows, int64_t inner,
                      int64_t stride, int64_t n, float eps) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + (i / inner) * stride + (i % inner) * n;
        float *yi = y + i * n;
        float squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t j = 0; j < n; j++) squares += xi[j] * xi[j];
        float ri = 1.0f / sqrtf(squares / n + eps);
        r[i] = ri;
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) yi[j] = xi[j] * ri;
    }
}

/* The gradient of RMSNorm's input: dx = r (g - y mean(g y)) for each row. */
void rms_norm_backward(const float *g, const float *y, const float *r, float *dx, int64_t rows,
                       int64_t n) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *gi = g + i * n, *yi = y + i * n;
        float *dxi = dx + i * n;
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int64_t j = 0; j < n; j++) dot += gi[j] * yi[j];
        float mean = dot / n, ri = r[i];
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) dxi[j] = ri * (gi[j] - yi[j] * mean);
    }
}

/* These compute relu(h)^2 and its gradient, 2 relu(h) g. */
void relu_square_forward(const float *h, float *out, int64_t n) {
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float r = h[i] > 0.0f ? h[i] : 0.0f;
        out[i] = r * r;
    }
}

void relu_square_backward(const float *h, const float *g, float *dh, int64_t n) {
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float r = h[i] > 0.0f ? h[i] : 0.0f;
        dh[i] = 2.0f * r * g[i];
    }
}

/* Rotary positions: x holds one row per token, of `heads` heads of 2 * half floats each, the T
 * tokens of each sequence in order, one sequence after another. Each pair (x_i, x_{i + half})
 * of a head turns by its token's angle: y_i = x_i cos - x_{i + half} sin and
 * y_{i + half} = x_i sin + x_{i + half} cos, where cos and sin are the (T, half) tables' row
 * for the token's place t in its sequence. The gradient turns back by the same angle, which
 * is this rotation with sin negated (direction -1). */
void rotate_pairs(const float *x, const float *cos, const float *sin, float *y, int64_t rows,
                  int64_t T, int64_t heads, int64_t half, float direction) {
    #pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const float *c = cos + (row % T) * half, *s = sin + (row % T) * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + (row * heads + h) * 2 * half, *x2 = x1 + half;
            float *y1 = y + (row * heads + h) * 2 * half, *y2 = y1 + half;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float si = direction * s[i];
                y1[i] = x1[i] * c[i] - x2[i] * si;
                y2[i] = x1[i] * si + x2[i] * c[i];
            }
        }
    }
}
