/* One KV-cache decode step of model.py's GPT, written out in C.
 *
 * With one new token per sequence every Linear is a matrix-vector product, and the step is
 * bound by streaming the weights from memory. Written as one C function, the whole step is
 * one call with one parallel region: no per-operation dispatch, no tensors allocated, and
 * each product fused with its bias and residual add.
 *
 * cdecode/__init__.py builds this file once per weight type and calls it through ctypes:
 * - float32 (the default): everything in float;
 * - WEIGHT_BF16: every parameter and the cache in bfloat16 (kept as its uint16_t bits);
 * - WEIGHT_INT8: quantize.py's int8 models. The matrices (weight_t) are int8 with a float
 *   scale per output row; vectors, the position table and the cache (param_t) are float.
 * Activations are always float. Shapes and layouts are those of model.py: Linear weights
 * (out, in), cache (B, n_head, max_len, head_dim), all contiguous.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* weight_type names the type this build reads, as torch names it, so that Python can refuse
 * a build whose flags chose another type than the model's weights have */
#if defined(WEIGHT_BF16)
typedef uint16_t weight_t;
typedef uint16_t param_t;
const char *const weight_type = "bfloat16";
#elif defined(WEIGHT_INT8)
typedef int8_t weight_t;
typedef float param_t;
const char *const weight_type = "int8";
#else
typedef float weight_t;
typedef float param_t;
const char *const weight_type = "float32";
#endif

/* bfloat16 is the top half of a float32, so widening is a shift; store() rounds to nearest */
static inline float bf16_to_float(uint16_t b) {
    union { uint32_t u; float f; } v = { (uint32_t)b << 16 };
    return v.f;
}

static inline float load_weight(const weight_t *p, size_t i) {
#ifdef WEIGHT_BF16
    return bf16_to_float(p[i]);
#else
    return (float)p[i];
#endif
}

static inline float load(const param_t *p, size_t i) {
#ifdef WEIGHT_BF16
    return bf16_to_float(p[i]);
#else
    return p[i];
#endif
}

static inline void store(param_t *p, size_t i, float x) {
#ifdef WEIGHT_BF16
    union { float f; uint32_t u; } v = { x };
    p[i] = (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);  /* round to nearest even */
#else
    p[i] = x;
#endif
}

/* The parameters of one Block, listed once. The list makes both the enum that indexes them
 * here and the names (model.py's and quantize.py's, under transformer.h.<layer>.) that
 * Python reads from the library to pass them in this order. A model without biases passes
 * NULL for them; a float model passes NULL for the int8 row scales. */
#define BLOCK_PARAMS(X) \
    X(LN1_W, "ln_1.weight") X(LN1_B, "ln_1.bias") \
    X(ATTN_W, "attn.c_attn.weight") X(ATTN_B, "attn.c_attn.bias") \
    X(ATTN_S, "attn.c_attn.scales") \
    X(ATTN_PROJ_W, "attn.c_proj.weight") X(ATTN_PROJ_B, "attn.c_proj.bias") \
    X(ATTN_PROJ_S, "attn.c_proj.scales") \
    X(LN2_W, "ln_2.weight") X(LN2_B, "ln_2.bias") \
    X(FC_W, "mlp.c_fc.weight") X(FC_B, "mlp.c_fc.bias") X(FC_S, "mlp.c_fc.scales") \
    X(MLP_PROJ_W, "mlp.c_proj.weight") X(MLP_PROJ_B, "mlp.c_proj.bias") \
    X(MLP_PROJ_S, "mlp.c_proj.scales")
#define AS_ENUM(id, name) id,
#define AS_NAME(id, name) name,
enum { BLOCK_PARAMS(AS_ENUM) N_BLOCK_PARAMS };
const char *const block_param_names[] = { BLOCK_PARAMS(AS_NAME) };
const int n_block_params = N_BLOCK_PARAMS;

/* model.py's rms_norm: x / sqrt(mean(x^2) + eps), no gain, in place on n floats */
static inline void rms_norm(float *x, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* out[b] = LayerNorm(x[b]) for each of B rows of n, or RMSNorm when rms is set (model.py's
 * make_norm); a NULL bias means none */
static void layer_norm(float *out, const float *x, const param_t *w, const param_t *bias,
                       int B, int n, int rms, float eps) {
    #pragma omp for
    for (int b = 0; b < B; b++) {
        const float *xb = x + (size_t)b * n;
        if (rms) {
            for (int i = 0; i < n; i++) out[(size_t)b * n + i] = xb[i];
            rms_norm(out + (size_t)b * n, n, eps);
            continue;
        }
        float mean = 0.0f, var = 0.0f;
        for (int i = 0; i < n; i++) mean += xb[i];
        mean /= n;
        for (int i = 0; i < n; i++) var += (xb[i] - mean) * (xb[i] - mean);
        float rstd = 1.0f / sqrtf(var / n + eps);
        for (int i = 0; i < n; i++) {
            float shift = bias ? load(bias, i) : 0.0f;
            out[(size_t)b * n + i] = (xb[i] - mean) * rstd * load(w, i) + shift;
        }
    }
}

/* e^x, inline and vectorizable. libm's expf is a call per element, and the GELU makes
 * 4 * n_embd of them per token, which at small shapes is a large share of a step whose
 * products are bound by arithmetic (int8; docs/performance.md). e^x = 2^n e^r with
 * n = round(x / ln 2), so |r| <= ln(2) / 2, where the Taylor series to r^6 stays within 3e-7
 * of expf (relative) over the range. Below -87 it gives about 1e-38 rather than 0. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    /* adding and taking away 1.5 * 2^23 rounds a float to the nearest integer */
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln 2 in two parts */
    float p = 1.0f + r * (1.0f + r * (1.0f / 2 + r * (1.0f / 6 + r * (1.0f / 24
              + r * (1.0f / 120 + r * (1.0f / 720))))));
    union { uint32_t u; float f; } two_n = { (uint32_t)((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

/* GPT-2's GELU, 0.5 x (1 + tanh(u)), computed as the equal x sigmoid(2u) in place on n
 * floats, in a pass of its own so that it runs on whole vectors */
static void gelu_tanh(float *x, size_t n) {
    #pragma omp for simd schedule(static)
    for (size_t i = 0; i < n; i++) {
        float u = 0.7978845608f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
        x[i] = x[i] / (1.0f + exp_approx(-2.0f * u));
    }
}

/* model.py's relu2: relu(x)^2, in place on n floats */
static void relu_square(float *x, size_t n) {
    #pragma omp for simd schedule(static)
    for (size_t i = 0; i < n; i++) x[i] = x[i] > 0.0f ? x[i] * x[i] : 0.0f;
}

/* model.py's apply_rope on one head of n floats at a position whose rows of rope_tables
 * are cos and sin (n / 2 each); pair (x_i, x_{i + n/2}) turns by that position's angle i */
static inline void rope(float *x, const param_t *cos, const param_t *sin, int n) {
    int half = n / 2;
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half], c = load(cos, i), s = load(sin, i);
        x[i] = x1 * c - x2 * s;
        x[i + half] = x1 * s + x2 * c;
    }
}

/* Every product comes down to dot products of rows (of weights, of cached keys) with a
 * vector x. These are the reference loops, which CPUs without AVX2 or AVX-512 run. */
static inline float dot_plain(const weight_t *restrict w, const float *restrict x, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (int k = 0; k < n; k++) s += load_weight(w, k) * x[k];
    return s;
}

static inline float dot_plain_params(const param_t *restrict w, const float *restrict x, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (int k = 0; k < n; k++) s += load(w, k) * x[k];
    return s;
}

/* With AVX-512 or AVX2 (the build asks for -march=native) the same dot product is written
 * with intrinsics, because gcc vectorizes the plain loop too but then adds up its vector sums
 * one float at a time through memory, which for short rows costs as much as the products. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vec_load_params(const param_t *p) {
#ifdef WEIGHT_BF16
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
    return _mm512_loadu_ps(p);
#endif
}
static inline vec vec_load_weights(const weight_t *p) {
#ifdef WEIGHT_INT8
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return vec_load_params(p);
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
static inline vec vec_load_params(const param_t *p) {
#ifdef WEIGHT_BF16
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    return _mm256_loadu_ps(p);
#endif
}
static inline vec vec_load_weights(const weight_t *p) {
#ifdef WEIGHT_INT8
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return vec_load_params(p);
#endif
}
#endif

#ifdef LANES
/* dot(w, x) of a cached key over n elements, four vector sums in flight so that each fma
 * need not wait for the one before */
static inline float dot_params(const param_t *restrict w, const float *restrict x, int n) {
    vec a = vec_zero(), b = a, c = a, d = a;
    int j = 0;
    for (; j + 4 * LANES <= n; j += 4 * LANES) {
        a = vec_fma(vec_load_params(w + j), vec_load(x + j), a);
        b = vec_fma(vec_load_params(w + j + LANES), vec_load(x + j + LANES), b);
        c = vec_fma(vec_load_params(w + j + 2 * LANES), vec_load(x + j + 2 * LANES), c);
        d = vec_fma(vec_load_params(w + j + 3 * LANES), vec_load(x + j + 3 * LANES), d);
    }
    for (; j + LANES <= n; j += LANES) a = vec_fma(vec_load_params(w + j), vec_load(x + j), a);
    float s = vec_sum((a + b) + (c + d));
    /* the tail of fewer than LANES elements is a plain loop, because an `omp simd` one would
     * add up its lanes through memory even when it runs no iteration */
    for (; j < n; j++) s += load(w, j) * x[j];
    return s;
}
#else
#define dot_params dot_plain_params
#endif

enum { SET, ADD };  /* what a product does with its output */

/* Inputs per pass of the products' kernel. With AVX-512's 32 vector registers, four rows
 * by four inputs keep their 16 sums in registers; AVX2's 16 registers hold eight. */
#if LANES == 16
#define MAX_NB 4
#else
#define MAX_NB 2
#endif

/* The products' kernel: four weight rows w[0..3] against NB <= MAX_NB inputs
 * x + c * stride, writing the 4 * NB dot products into out[r][c]. Each weight vector loaded
 * serves NB inputs and each input vector four rows, so in a batch the loads per fma fall from
 * 2 to 0.5, and the sums in flight keep both fma units busy. Every dot product is summed in the
 * same order whatever NB is (one vector sum each, then its lanes, then the tail), so a
 * sequence's logits are the same bits alone and in any batch, and a server's answer does not
 * depend on who else is served. NB is a constant where this is called, so each case
 * compiles to its own unrolled loop with the sums held in registers. */
static inline __attribute__((always_inline)) void dot_4xN(
        const weight_t *const w[4], const float *restrict x, size_t stride, int n, int NB,
        float out[4][MAX_NB]) {
#ifdef LANES
    int j = 0;
    vec acc[4][MAX_NB];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = vec_zero();
    for (; j + LANES <= n; j += LANES) {
        vec v[MAX_NB];
        for (int c = 0; c < NB; c++) v[c] = vec_load(x + c * stride + j);
        for (int r = 0; r < 4; r++) {
            vec row = vec_load_weights(w[r] + j);
            for (int c = 0; c < NB; c++) acc[r][c] = vec_fma(row, v[c], acc[r][c]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NB; c++) out[r][c] = vec_sum(acc[r][c]);
    /* the tail of fewer than LANES elements calls fmaf explicitly, because left to itself
     * the compiler fuses or does not fuse a * b + c differently in each unrolled case */
    for (; j < n; j++)
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < NB; c++)
                out[r][c] = fmaf(load_weight(w[r], j), x[c * stride + j], out[r][c]);
#else
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NB; c++) out[r][c] = dot_plain(w[r], x + c * stride, n);
#endif
}

/* y[b] (op)= (W x[b]) * scales + bias for B rows: W is (n_out, n_in), scales (n_out,) or NULL
 * for a float W. Groups of four rows of W are split between the threads, and each group is
 * read once for all B inputs, MAX_NB at a time. */
static void matvec(float *restrict y, const float *restrict x, const weight_t *restrict W,
                   const float *restrict scales, const param_t *restrict bias,
                   int B, int n_in, int n_out, int op) {
    #pragma omp for schedule(static)
    for (int i = 0; i < n_out; i += 4) {
        int rows = n_out - i < 4 ? n_out - i : 4;  /* past n_out, repeat the last row; sums unused */
        const weight_t *w[4];
        for (int r = 0; r < 4; r++) w[r] = W + (size_t)(i + (r < rows ? r : rows - 1)) * n_in;
        /* ask for the weights 4 KB ahead of these rows, because the hardware prefetcher
         * alone does not run far enough ahead of a stream this fast */
        for (int j = 0; j < rows * n_in; j += 64 / sizeof(weight_t))
            __builtin_prefetch(w[0] + 4096 / sizeof(weight_t) + j);
        for (int b = 0; b < B; b += MAX_NB) {
            float s[4][MAX_NB];
            int nb = B - b < MAX_NB ? B - b : MAX_NB;
            const float *xb = x + (size_t)b * n_in;
            /* a constant NB in each call, so that each compiles to its own unrolled loop */
            if (nb == MAX_NB) dot_4xN(w, xb, n_in, n_in, MAX_NB, s);
#if MAX_NB == 4
            else if (nb == 3) dot_4xN(w, xb, n_in, n_in, 3, s);
#endif
            else if (nb == 2) dot_4xN(w, xb, n_in, n_in, 2, s);
            else dot_4xN(w, xb, n_in, n_in, 1, s);
            for (int r = 0; r < rows; r++) {
                float scale = scales ? scales[i + r] : 1.0f;
                float shift = bias ? load(bias, i + r) : 0.0f;
                for (int c = 0; c < nb; c++) {
                    float *out = y + (size_t)(b + c) * n_out + i + r;
                    float v = s[r][c] * scale + shift;
                    *out = op == ADD ? *out + v : v;
                }
            }
        }
    }
}

/* What model.py's CausalSelfAttention does to one head of a query or key at window
 * position p: qk_norm, then RoPE when the tables are given (not NULL) */
static inline void place_head(float *x, int qk_norm, float eps, const param_t *rope_cos,
                              const param_t *rope_sin, int p, int head_dim) {
    if (qk_norm) rms_norm(x, head_dim, eps);
    if (rope_cos) {
        size_t at = (size_t)p * (head_dim / 2);
        rope(x, rope_cos + at, rope_sin + at, head_dim);
    }
}

/* Store the keys and values of T new tokens per sequence at slots pos[b]..pos[b]+T-1 of
 * its cache row rows[b], then let each attend over the slots up to its own. A decode step
 * has T = 1, a prefill T > 1. Each sequence has its own position, as in a server's batch.
 * qkv: (B*T, C + 2 KV) as c_attn makes it, KV = n_kv_head * head_dim (GQA: query head h
 * reads key/value head h / (n_head / n_kv_head), as SDPA's enable_gqa does); its queries
 * and keys are normalized and rotated in place. y: (B*T, C), heads side by side. */
static void attention(float *restrict y, float *restrict qkv, param_t *restrict k_cache,
                      param_t *restrict v_cache, float *restrict scores, int qk_norm,
                      float eps, const param_t *rope_cos, const param_t *rope_sin,
                      int B, int T, int n_head, int n_kv_head, int head_dim, int max_len,
                      const int64_t *pos, const int64_t *rows) {
    int C = n_head * head_dim, KV = n_kv_head * head_dim, group = n_head / n_kv_head;
    size_t row = (size_t)C + 2 * KV;
    float scale = 1.0f / sqrtf((float)head_dim);
    if (qk_norm || rope_cos) {
        #pragma omp for
        for (int i = 0; i < B * n_head * T; i++) {
            int t = i % T, b = i / T / n_head, h = i / T % n_head;
            place_head(qkv + (b * T + t) * row + h * head_dim, qk_norm, eps, rope_cos,
                       rope_sin, pos[b] + t, head_dim);
        }
    }
    #pragma omp for
    for (int i = 0; i < B * n_kv_head * T; i++) {
        int bh = i / T, t = i % T, b = bh / n_kv_head, h = bh % n_kv_head;
        float *k = qkv + (b * T + t) * row + C + h * head_dim;
        const float *v = k + KV;
        place_head(k, qk_norm, eps, rope_cos, rope_sin, pos[b] + t, head_dim);
        size_t slot = (((size_t)rows[b] * n_kv_head + h) * max_len + pos[b] + t) * head_dim;
        for (int d = 0; d < head_dim; d++) {
            store(k_cache, slot + d, k[d]);
            store(v_cache, slot + d, v[d]);
        }
    }  /* the loop ends in a barrier, so every key is stored before any query reads it */
    #pragma omp for
    for (int i = 0; i < B * n_head * T; i++) {
        int t = i % T, b = i / T / n_head, h = i / T % n_head, last = pos[b] + t;
        const float *q = qkv + (b * T + t) * row + h * head_dim;
        size_t kv_head = (size_t)rows[b] * n_kv_head + h / group;
        const param_t *k = k_cache + kv_head * max_len * head_dim;  /* (max_len, head_dim) */
        const param_t *v = v_cache + kv_head * max_len * head_dim;
        float *att = scores + (size_t)i * max_len;
        float max = -INFINITY;
        for (int s = 0; s <= last; s++) {
            att[s] = dot_params(k + (size_t)s * head_dim, q, head_dim) * scale;
            max = att[s] > max ? att[s] : max;
        }
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int s = 0; s <= last; s++) {
            att[s] = exp_approx(att[s] - max);
            sum += att[s];
        }
        float *yh = y + (size_t)(b * T + t) * C + h * head_dim;
        for (int d = 0; d < head_dim; d++) yh[d] = 0.0f;
        for (int s = 0; s <= last; s++) {
            float p = att[s] * (1.0f / sum);
            #pragma omp simd
            for (int d = 0; d < head_dim; d++) yh[d] += p * load(v, (size_t)s * head_dim + d);
        }
    }
}

/* The switches of model.py's GPTConfig that the step follows (GPT-2's layout: all zero,
 * n_kv_head = n_head, hidden = 4 n_embd, norm_eps = 1e-5) */
typedef struct {
    int n_kv_head, rms_norm, qk_norm, relu2, embed_norm, hidden;
    float norm_eps, logit_softcap;  /* 0 turns logit_softcap off */
} layout_t;

/* Logits (B, vocab_size) of the last of T new tokens per sequence, where sequence b's
 * tokens sit at window positions pos[b]..pos[b]+T-1 of cache row rows[b]. T = 1 is a decode
 * step, and T > 1 a prefill, which reads each weight once for all B*T tokens.
 * tokens: (B, T); pos, rows: (B,), rows distinct; blocks: n_layer * N_BLOCK_PARAMS
 * pointers; k_cache, v_cache: one pointer per layer. wte_scales: the int8 token table's row
 * scales, NULL for a float one. wpe: the learned position table, or NULL. wtb: the bigram
 * table, or NULL; ids: the cache's (cache rows, max_len) token ids, which the step writes
 * and from which it reads the predecessor of each call's first token. rope_cos, rope_sin:
 * model.py's rope tables, or NULL.
 * lm_head (and its scales): an untied output layer, or NULL for wte's.
 * work: scratch of B * T * (5 * n_embd + max(n_embd, hidden) + n_head * max_len) floats. */
void decode_step(float *logits, const int64_t *tokens, const int64_t *pos,
                 const int64_t *rows, int T,
                 const weight_t *wte, const float *wte_scales, const param_t *wpe,
                 const param_t *wtb, int64_t *ids,
                 const param_t *rope_cos, const param_t *rope_sin,
                 const void *const *blocks, const param_t *ln_f_w, const param_t *ln_f_b,
                 const weight_t *lm_head, const float *lm_head_scales,
                 param_t *const *k_cache, param_t *const *v_cache, float *work,
                 int B, int n_layer, int n_head, int n_embd, int vocab_size, int max_len,
                 const layout_t *layout, int n_threads) {
    int C = n_embd, R = B * T;    /* R rows: token t of sequence b is row b * T + t */
    int KV = layout->n_kv_head * (C / n_head), rms = layout->rms_norm, H = layout->hidden;
    float eps = layout->norm_eps, cap = layout->logit_softcap;
    float *x = work;              /* (R, C) the residual stream */
    float *h = x + R * C;         /* (R, C) a LayerNorm's output */
    float *qkv = h + R * C;       /* (R, C + 2 KV) <= (R, 3C); at the end, the last rows of x */
    float *y = qkv + R * 3 * C;   /* (R, C) attention output; also (R, H) MLP hidden */
    float *scores = y + (size_t)R * (H > C ? H : C);  /* (R * n_head, max_len) */
    #pragma omp parallel num_threads(n_threads)
    {
        #pragma omp for
        for (int r = 0; r < R; r++) {
            const weight_t *tok_emb = wte + (size_t)tokens[r] * C;
            float scale = wte_scales ? wte_scales[tokens[r]] : 1.0f;
            int64_t at = pos[r / T] + r % T, *row_ids = ids + (size_t)rows[r / T] * max_len;
            /* The first token's predecessor comes from an earlier call, through the cache's
             * ids, and the others' from this call. Position 0 has none, so it reads the
             * table's last row. */
            int64_t before = r % T ? tokens[r - 1] : at ? row_ids[at - 1] : vocab_size;
            row_ids[at] = tokens[r];
            for (int i = 0; i < C; i++) {
                float p = wpe ? load(wpe, (size_t)at * C + i) : 0.0f;
                float bigram = wtb ? load(wtb, (size_t)before * C + i) : 0.0f;
                /* added in model.py's order, so that the sums round alike */
                x[(size_t)r * C + i] = (load_weight(tok_emb, i) * scale + bigram) + p;
            }
            if (layout->embed_norm) rms_norm(x + (size_t)r * C, C, eps);
        }
        for (int l = 0; l < n_layer; l++) {
            const void *const *p = blocks + (size_t)l * N_BLOCK_PARAMS;
            layer_norm(h, x, p[LN1_W], p[LN1_B], R, C, rms, eps);
            matvec(qkv, h, p[ATTN_W], p[ATTN_S], p[ATTN_B], R, C, C + 2 * KV, SET);
            attention(y, qkv, k_cache[l], v_cache[l], scores, layout->qk_norm, eps, rope_cos,
                      rope_sin, B, T, n_head, layout->n_kv_head, C / n_head, max_len, pos,
                      rows);
            matvec(x, y, p[ATTN_PROJ_W], p[ATTN_PROJ_S], p[ATTN_PROJ_B], R, C, C, ADD);
            layer_norm(h, x, p[LN2_W], p[LN2_B], R, C, rms, eps);
            matvec(y, h, p[FC_W], p[FC_S], p[FC_B], R, C, H, SET);
            if (layout->relu2) relu_square(y, (size_t)R * H);
            else gelu_tanh(y, (size_t)R * H);
            matvec(x, y, p[MLP_PROJ_W], p[MLP_PROJ_S], p[MLP_PROJ_B], R, H, C, ADD);
        }
        float *last = qkv;  /* (B, C): only each sequence's last token needs logits */
        #pragma omp for
        for (int b = 0; b < B; b++)
            for (int i = 0; i < C; i++)
                last[(size_t)b * C + i] = x[((size_t)b * T + T - 1) * C + i];
        layer_norm(h, last, ln_f_w, ln_f_b, B, C, rms, eps);
        /* with weight tying (lm_head NULL) the output layer is wte */
        matvec(logits, h, lm_head ? lm_head : wte, lm_head ? lm_head_scales : wte_scales, NULL,
               B, C, vocab_size, SET);
        if (cap > 0.0f) {  /* model.py's logit_softcap: cap tanh(logits / cap) */
            #pragma omp for
            for (int i = 0; i < B * vocab_size; i++) logits[i] = cap * tanhf(logits[i] / cap);
        }
    }
}
