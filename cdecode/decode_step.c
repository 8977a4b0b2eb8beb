/* One KV-cache decode step of model.py's GPT, written out in C.
 *
 * With one new token per sequence every Linear is a matrix-vector product, and the step is
 * bound by streaming the weights from memory. Written as one C function, the whole step is
 * one call with one parallel region: no per-operation dispatch, no tensors allocated, and
 * each product fused with its bias, GELU or residual add.
 *
 * cdecode/__init__.py builds this file twice, with WEIGHT as float and as uint16_t
 * (bfloat16 bits), and calls it through ctypes. Weights and the cache are in WEIGHT; activations
 * stay in float. Shapes and layouts are those of model.py: Linear weights (out, in),
 * cache (B, n_head, max_len, head_dim), all contiguous.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifndef WEIGHT
#define WEIGHT float
#endif

/* bfloat16 is the top half of a float32: widening is a shift, rounding keeps the nearest */
static inline float load(const WEIGHT *p, size_t i) {
#ifdef WEIGHT_BF16
    union { uint32_t u; float f; } v = { (uint32_t)p[i] << 16 };
    return v.f;
#else
    return p[i];
#endif
}

static inline void store(WEIGHT *p, size_t i, float x) {
#ifdef WEIGHT_BF16
    union { float f; uint32_t u; } v = { x };
    p[i] = (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);  /* round to nearest even */
#else
    p[i] = x;
#endif
}

/* The parameters of one Block, written once: this list makes the enum that indexes them
 * here and the names (model.py's, under transformer.h.<layer>.) that Python reads from
 * the library to pass them in this order. */
#define BLOCK_PARAMS(X) \
    X(LN1_W, "ln_1.weight") X(LN1_B, "ln_1.bias") \
    X(ATTN_W, "attn.c_attn.weight") X(ATTN_B, "attn.c_attn.bias") \
    X(ATTN_PROJ_W, "attn.c_proj.weight") X(ATTN_PROJ_B, "attn.c_proj.bias") \
    X(LN2_W, "ln_2.weight") X(LN2_B, "ln_2.bias") \
    X(FC_W, "mlp.c_fc.weight") X(FC_B, "mlp.c_fc.bias") \
    X(MLP_PROJ_W, "mlp.c_proj.weight") X(MLP_PROJ_B, "mlp.c_proj.bias")
#define AS_ENUM(id, name) id,
#define AS_NAME(id, name) name,
enum { BLOCK_PARAMS(AS_ENUM) N_BLOCK_PARAMS };
const char *const block_param_names[] = { BLOCK_PARAMS(AS_NAME) };
const int n_block_params = N_BLOCK_PARAMS;

/* out[b] = LayerNorm(x[b]) for each of B rows of n; a NULL bias means none */
static void layer_norm(float *out, const float *x, const WEIGHT *w, const WEIGHT *bias,
                       int B, int n) {
    #pragma omp for
    for (int b = 0; b < B; b++) {
        const float *xb = x + (size_t)b * n;
        float mean = 0.0f, var = 0.0f;
        for (int i = 0; i < n; i++) mean += xb[i];
        mean /= n;
        for (int i = 0; i < n; i++) var += (xb[i] - mean) * (xb[i] - mean);
        float rstd = 1.0f / sqrtf(var / n + 1e-5f);
        for (int i = 0; i < n; i++) {
            float shift = bias ? load(bias, i) : 0.0f;
            out[(size_t)b * n + i] = (xb[i] - mean) * rstd * load(w, i) + shift;
        }
    }
}

/* GPT-2's GELU, 0.5 x (1 + tanh(u)), as the equal x sigmoid(2u): one expf, which is much
 * cheaper than tanhf */
static float gelu_tanh(float x) {
    float u = 0.7978845608f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-2.0f * u));
}

/* Every product comes down to dot products of weight rows with a vector x. This is the
 * reference loop: every build has it, and it finishes the tails of the vector loops. */
static inline float dot_plain(const WEIGHT *restrict w, const float *restrict x, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (int k = 0; k < n; k++) s += load(w, k) * x[k];
    return s;
}

/* With AVX-512 or AVX2 (the build asks for -march=native) the same dot product is written
 * with intrinsics: gcc vectorizes the plain loop too, but then adds up its vector sums one
 * float at a time through memory, which for short rows costs as much as the products. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vec_load_weights(const WEIGHT *p) {
#ifdef WEIGHT_BF16
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
    return _mm512_loadu_ps(p);
#endif
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vec_sum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vec vec_load_weights(const WEIGHT *p) {
#ifdef WEIGHT_BF16
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    return _mm256_loadu_ps(p);
#endif
}
#endif

#ifdef LANES
/* dot(w, x) over n elements, four vector sums in flight so that each fma need not wait for
 * the one before */
static inline float dot(const WEIGHT *restrict w, const float *restrict x, int n) {
    vec a = vec_zero(), b = a, c = a, d = a;
    int j = 0;
    for (; j + 4 * LANES <= n; j += 4 * LANES) {
        a = vec_fma(vec_load_weights(w + j), vec_load(x + j), a);
        b = vec_fma(vec_load_weights(w + j + LANES), vec_load(x + j + LANES), b);
        c = vec_fma(vec_load_weights(w + j + 2 * LANES), vec_load(x + j + 2 * LANES), c);
        d = vec_fma(vec_load_weights(w + j + 3 * LANES), vec_load(x + j + 3 * LANES), d);
    }
    for (; j + LANES <= n; j += LANES) a = vec_fma(vec_load_weights(w + j), vec_load(x + j), a);
    return vec_sum((a + b) + (c + d)) + dot_plain(w + j, x + j, n - j);
}
#else
#define dot dot_plain
#endif

enum { SET, ADD, SET_GELU };  /* what a product does with its output */

/* y[b] (op)= W x[b] + bias for B rows: W is (n_out, n_in). Rows of W are split between the
 * threads, and each row is read once for all B inputs. */
static void matvec(float *restrict y, const float *restrict x, const WEIGHT *restrict W,
                   const WEIGHT *restrict bias, int B, int n_in, int n_out, int op) {
    #pragma omp for schedule(static)
    for (int i = 0; i < n_out; i++) {
        const WEIGHT *row = W + (size_t)i * n_in;
        /* ask for the weights 4 KB ahead of this row: the hardware prefetcher alone does
         * not run far enough ahead of a stream this fast */
        for (int j = 0; j < n_in; j += 64 / sizeof(WEIGHT))
            __builtin_prefetch(row + 4096 / sizeof(WEIGHT) + j);
        for (int b = 0; b < B; b++) {
            float s = dot(row, x + (size_t)b * n_in, n_in) + (bias ? load(bias, i) : 0.0f);
            float *out = y + (size_t)b * n_out + i;
            *out = op == ADD ? *out + s : op == SET_GELU ? gelu_tanh(s) : s;
        }
    }
}

/* Store this token's keys and values at slot `pos`, then attend over slots 0..pos.
 * qkv: (B, 3C) as c_attn makes it; y: (B, C), heads side by side as c_proj expects. */
static void attention(float *restrict y, const float *restrict qkv, WEIGHT *restrict k_cache,
                      WEIGHT *restrict v_cache, float *restrict scores,
                      int B, int n_head, int head_dim, int max_len, int pos) {
    int C = n_head * head_dim;
    float scale = 1.0f / sqrtf((float)head_dim);
    #pragma omp for
    for (int bh = 0; bh < B * n_head; bh++) {
        int b = bh / n_head, h = bh % n_head;
        const float *q = qkv + (size_t)b * 3 * C + h * head_dim;
        WEIGHT *k = k_cache + (size_t)bh * max_len * head_dim;  /* (max_len, head_dim) */
        WEIGHT *v = v_cache + (size_t)bh * max_len * head_dim;
        for (int d = 0; d < head_dim; d++) {
            store(k, (size_t)pos * head_dim + d, q[C + d]);
            store(v, (size_t)pos * head_dim + d, q[2 * C + d]);
        }
        float *att = scores + (size_t)bh * max_len;
        float max = -INFINITY;
        for (int t = 0; t <= pos; t++) {
            att[t] = dot(k + (size_t)t * head_dim, q, head_dim) * scale;
            max = att[t] > max ? att[t] : max;
        }
        float sum = 0.0f;
        for (int t = 0; t <= pos; t++) {
            att[t] = expf(att[t] - max);
            sum += att[t];
        }
        float *yh = y + (size_t)b * C + h * head_dim;
        for (int d = 0; d < head_dim; d++) yh[d] = 0.0f;
        for (int t = 0; t <= pos; t++) {
            float p = att[t] * (1.0f / sum);
            #pragma omp simd
            for (int d = 0; d < head_dim; d++) yh[d] += p * load(v, (size_t)t * head_dim + d);
        }
    }
}

/* Logits (B, vocab_size) for one new token per sequence at window position `pos`.
 * blocks: n_layer * N_BLOCK_PARAMS pointers; k_cache, v_cache: one pointer per layer.
 * work: scratch of B * (9 * n_embd + n_head * max_len) floats. */
void decode_step(float *logits, const int64_t *tokens, int pos,
                 const WEIGHT *wte, const WEIGHT *wpe, const WEIGHT *const *blocks,
                 const WEIGHT *ln_f_w, const WEIGHT *ln_f_b,
                 WEIGHT *const *k_cache, WEIGHT *const *v_cache, float *work,
                 int B, int n_layer, int n_head, int n_embd, int vocab_size, int max_len,
                 int n_threads) {
    int C = n_embd;
    float *x = work;              /* (B, C) the residual stream */
    float *h = x + B * C;         /* (B, C) a LayerNorm's output */
    float *qkv = h + B * C;       /* (B, 3C) */
    float *y = qkv + B * 3 * C;   /* (B, C) attention output; also (B, 4C) MLP hidden */
    float *scores = y + B * 4 * C;  /* (B * n_head, max_len) */
    #pragma omp parallel num_threads(n_threads)
    {
        #pragma omp for
        for (int b = 0; b < B; b++) {
            const WEIGHT *tok_emb = wte + (size_t)tokens[b] * C, *pos_emb = wpe + (size_t)pos * C;
            for (int i = 0; i < C; i++) x[b * C + i] = load(tok_emb, i) + load(pos_emb, i);
        }
        for (int l = 0; l < n_layer; l++) {
            const WEIGHT *const *p = blocks + (size_t)l * N_BLOCK_PARAMS;
            layer_norm(h, x, p[LN1_W], p[LN1_B], B, C);
            matvec(qkv, h, p[ATTN_W], p[ATTN_B], B, C, 3 * C, SET);
            attention(y, qkv, k_cache[l], v_cache[l], scores, B, n_head, C / n_head, max_len, pos);
            matvec(x, y, p[ATTN_PROJ_W], p[ATTN_PROJ_B], B, C, C, ADD);
            layer_norm(h, x, p[LN2_W], p[LN2_B], B, C);
            matvec(y, h, p[FC_W], p[FC_B], B, C, 4 * C, SET_GELU);
            matvec(x, y, p[MLP_PROJ_W], p[MLP_PROJ_B], B, 4 * C, C, ADD);
        }
        layer_norm(h, x, ln_f_w, ln_f_b, B, C);
        matvec(logits, h, wte, NULL, B, C, vocab_size, SET);  /* weight tying: lm_head is wte */
    }
}
