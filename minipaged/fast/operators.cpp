// Two of the speed layer's operators with their CPU kernels in C++, registered by operators.py
// (built with panels.c, against torch's libraries). A compiled step calls each through torch's
// dispatcher, 121 products and 30 attentions a step; registered in Python, each call went back
// into the interpreter. Where this file cannot be built, the Python functions serve them.
//
//   minipaged::panel_linear  matvec.py's `panel_linear`: panels.c's product (float32, bfloat16
//                            or float16 panels), torch's beyond MOST_ROWS rows in float32 and
//                            MOST_BF16_ROWS in bfloat16 (PANEL and both bounds come from
//                            matvec.py, -D: `most_rows`)
//   minipaged::attend        paged.py's `DecodeAttention.attend` while a decode step's plan is
//                            installed (`minipaged_install_plan`, by compiled.py for the step):
//                            each row's new k and v copied into its slot (int8 blocks: quantized
//                            into it by int8_slots.c), then stage 3b's C kernel. With no plan, or a call the plan does not fit, the
//                            operator's Python function (compiled.py's `attend`), through
//                            `minipaged::attend_python`.
// and, for native_step.py, a whole decode step of up to 64 rows on the installed plan as one call
// (`minipaged_decode_step`, at the end of this file).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

extern "C" void panel_linear(const float *x, const float *panels, float *y, int M, int N, int K,
                             int threads);
extern "C" void panel_linear_bf16(const float *x, const uint16_t *panels, float *y, int M, int N,
                                  int K, int threads);
extern "C" void panel_linear_f16(const float *x, const uint16_t *panels, float *y, int M, int N,
                                 int K, int threads);

// Half-precision rows are widened into a buffer of this thread's and the sums narrowed back
// by plain loops: as torch ops (x.to(float), y.to(bf16)), two calls a product cost a bf16 decode
// step of SmolLM2 about a millisecond of its ten.
template <typename T, typename Kernel>
static at::Tensor half_product(const at::Tensor &x, const at::Tensor &panels, Kernel kernel) {
    at::Tensor rows = x.contiguous();
    const int64_t M = rows.size(0), K = rows.size(1), N = panels.size(0) * PANEL;
    thread_local std::vector<float> in, out;
    in.resize(M * K);
    out.resize(M * N);
    const T *xs = rows.const_data_ptr<T>();
    for (int64_t i = 0; i < M * K; i++) in[i] = static_cast<float>(xs[i]);
    if (M)
        kernel(in.data(), static_cast<const uint16_t *>(panels.const_data_ptr()), out.data(), M,
               N, K, at::get_num_threads());
    at::Tensor y = at::empty({M, N}, rows.options());
    T *ys = y.mutable_data_ptr<T>();
    for (int64_t i = 0; i < M * N; i++) ys[i] = static_cast<T>(out[i]);    // rounded to nearest
    return y;
}

static at::Tensor panel_linear_cpu(const at::Tensor &x, const at::Tensor &panels,
                                   const at::Tensor &weight_t) {
    if (panels.scalar_type() == at::kBFloat16 && x.size(0) > MOST_BF16_ROWS)
        return at::mm(x, weight_t);
    if (panels.scalar_type() == at::kBFloat16)
        return half_product<at::BFloat16>(x, panels, panel_linear_bf16);
    if (panels.scalar_type() == at::kHalf)
        return half_product<at::Half>(x, panels, panel_linear_f16);
    if (x.size(0) > MOST_ROWS)
        return at::mm(x, weight_t);
    at::Tensor rows = x.contiguous();
    const int64_t M = rows.size(0), K = rows.size(1), N = panels.size(0) * PANEL;
    at::Tensor y = at::empty({M, N}, rows.options());
    if (M)
        panel_linear(rows.const_data_ptr<float>(), panels.const_data_ptr<float>(),
                     y.mutable_data_ptr<float>(), M, N, K, at::get_num_threads());
    return y;
}

// A decode step's plan: paged.py's `DecodePlan` (a ctypes structure) lays it out the same way.
// Every pointer stays valid while the plan is installed (the Python objects hold the tensors).
typedef void (*decode_kernel)(const float *q, const void *k_cache, const void *v_cache,
                              const int64_t *block_table, int64_t table_width,
                              const int64_t *seqlens, int B, int Hk, int block_size, float scale,
                              float *out, int threads);
typedef void (*quantize_kernel)(const float *x, int8_t *pool, const int64_t *slots, int B,
                                int Hk, int D);
struct DecodePlan {
    decode_kernel kernel;     // cpu_attention.c's paged_attention_decode for this dtype
    int64_t layers, rows, heads, kv_heads, head_dim, block_size, width, token_bytes;
    int64_t bf16;             // the new k/v's dtype: bfloat16 (1) or float32 (0)
    float scale;
    const int64_t *lens;      // (rows,) keys each row attends over, the new one included
    const int64_t *slots;     // (layers, rows) where each row's new k and v go
    const int64_t *tables;    // (layers, rows, width) block tables
    char *const *pools;       // (layers, 2) each layer's k pool and v pool
    quantize_kernel quantize; // int8 pools (stage 4b): int8_slots.c's write_int8_slots, else null
};

static const DecodePlan *installed = nullptr;

// Install `plan` (or none: NULL) for the calls that follow; returns the one it replaces.
extern "C" const void *minipaged_install_plan(const void *plan) {
    const DecodePlan *before = installed;
    installed = static_cast<const DecodePlan *>(plan);
    return before;
}

// Layer `layer` of the installed plan's step: each row's new k and v into its slot (bytes of
// the pool's dtype; on int8 pools, k32 and v32, quantized into the slot), then the kernel over
// q32 (rows, heads, head_dim) into out.
static void attend_plan(const DecodePlan *p, int64_t layer, const char *k_new, const char *v_new,
                        const float *k32, const float *v32, const float *q32, float *out) {
    char *k_pool = p->pools[2 * layer], *v_pool = p->pools[2 * layer + 1];
    const int64_t *slots = p->slots + layer * p->rows, n = p->token_bytes;
    if (p->quantize) {                                   // int8: quantized into their slots
        p->quantize(k32, reinterpret_cast<int8_t *>(k_pool), slots, p->rows, p->kv_heads,
                    p->head_dim);
        p->quantize(v32, reinterpret_cast<int8_t *>(v_pool), slots, p->rows, p->kv_heads,
                    p->head_dim);
    } else {
        for (int64_t r = 0; r < p->rows; r++) {          // the new tokens into their slots
            std::memcpy(k_pool + slots[r] * n, k_new + r * n, n);
            std::memcpy(v_pool + slots[r] * n, v_new + r * n, n);
        }
    }
    p->kernel(q32, k_pool, v_pool, p->tables + layer * p->rows * p->width, p->width, p->lens,
              p->rows, p->kv_heads, p->block_size, p->scale, out, at::get_num_threads());
}

static at::Tensor attend_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                             int64_t layer) {
    const DecodePlan *p = installed;
    const int64_t kv = p ? p->rows * p->kv_heads * p->head_dim : 0;
    const auto dtype = p && p->bf16 ? at::kBFloat16 : at::kFloat;
    if (!p || layer < 0 || layer >= p->layers || q.numel() != p->rows * p->heads * p->head_dim ||
        k.numel() != kv || v.numel() != kv || k.scalar_type() != dtype ||
        v.scalar_type() != dtype) {
        static auto python = c10::Dispatcher::singleton()
            .findSchemaOrThrow("minipaged::attend_python", "")
            .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                              int64_t)>();
        return python.call(q, k, v, layer);
    }
    at::Tensor k_ = k.contiguous(), v_ = v.contiguous(), k32, v32;
    if (p->quantize) {
        k32 = k_.to(at::kFloat).contiguous();
        v32 = v_.to(at::kFloat).contiguous();
    }
    at::Tensor q32 = q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty(q.sizes(), q32.options());
    attend_plan(p, layer, static_cast<const char *>(k_.const_data_ptr()),
                static_cast<const char *>(v_.const_data_ptr()),
                p->quantize ? k32.const_data_ptr<float>() : nullptr,
                p->quantize ? v32.const_data_ptr<float>() : nullptr,
                q32.const_data_ptr<float>(), out.mutable_data_ptr<float>());
    return out.to(q.scalar_type());
}

TORCH_LIBRARY_IMPL(minipaged, CPU, m) {
    m.impl("panel_linear", panel_linear_cpu);
    m.impl("attend", attend_cpu);
}

// ---- A decode step in one call (native_step.py) ----------------------------------------------
// A FusedLlama's decode step (B rows, one new token each) on the installed plan, as one C++ call
// instead of a compiled graph: the same products (panels.c), the same attention (the plan's
// kernel), and between them the small operations a layer does, as plain loops over float32
// buffers. Where the model is bfloat16, each result is rounded to bfloat16 where the model's
// tensor would be (`keep`), so the numbers are the model's up to the order of the sums.
struct StepLayer {
    const void *wqkv, *wo, *w13, *w2;        // panels (panel_weight's layout)
    const void *attention_norm, *ffn_norm;   // (dim,) in the model's dtype
};
struct StepModel {
    int64_t layers, dim, hidden, heads, kv_heads, head_dim, vocab;
    int64_t bf16;                            // the model's dtype: bfloat16 (1) or float32 (0)
    float eps, norm_eps;
    const void *embedding;                   // (vocab, dim)
    const float *freqs;                      // (head_dim / 2,) the rotary frequencies
    const StepLayer *layer;                  // (layers,)
    const void *norm;                        // (dim,)
    const void *output;                      // panels of the output projection
};

static float at_(const void *p, int64_t i, bool bf16) {     // element i, widened
    return bf16 ? static_cast<float>(static_cast<const c10::BFloat16 *>(p)[i])
                : static_cast<const float *>(p)[i];
}

// The float of given bits, and a float's bits
static float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static uint32_t to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// Rounded as the model stores it: to bfloat16's nearest, ties to even, as c10::BFloat16 rounds
// (a NaN stays a NaN), in integer arithmetic the compiler vectorizes
static void keep(float *x, int64_t n, bool bf16) {
    if (!bf16)
        return;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = to_bits(x[i]);
        const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
        x[i] = from_bits((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u
                                                        : rounded);
    }
}

static void product(const void *panels, const float *x, float *y, int64_t M, int64_t N,
                    int64_t K, bool bf16) {
    if (bf16)
        panel_linear_bf16(x, static_cast<const uint16_t *>(panels), y, M, N, K,
                          at::get_num_threads());
    else
        panel_linear(x, static_cast<const float *>(panels), y, M, N, K, at::get_num_threads());
    keep(y, M * N, bf16);
}

// x . x, summed in 16 running sums (each one a lane of the vector the compiler makes of them)
static float sum_of_squares(const float *x, int64_t n) {
    float lanes[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += x[i + j] * x[i + j];
    for (; i < n; i++) lanes[0] += x[i] * x[i];
    float sum = 0;
    for (float lane : lanes) sum += lane;
    return sum;
}

// RMSNorm as the model's: x / sqrt(mean(x^2) + eps) in float32, rounded, then times the weight
static void rms_norm(const float *x, const void *weight, float *y, int64_t M, int64_t dim,
                     float eps, bool bf16) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * dim;
        float *ym = y + m * dim;
        const float r = 1.0f / std::sqrt(sum_of_squares(xm, dim) / dim + eps);
        for (int64_t i = 0; i < dim; i++) ym[i] = xm[i] * r;
        keep(ym, dim, bf16);
        for (int64_t i = 0; i < dim; i++) ym[i] *= at_(weight, i, bf16);
        keep(ym, dim, bf16);
    }
}

// Meta's interleaved rotary pairs (even, odd) of `heads` heads of x, by the angles whose
// cosines and sines are cos[i], sin[i] (D / 2 of each: the row's position times each frequency)
static void rotate(float *x, int64_t heads, int64_t D, const float *cos, const float *sin) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < D / 2; i++) {
            float *e = x + h * D + 2 * i, even = e[0], odd = e[1];
            e[0] = even * cos[i] - odd * sin[i];
            e[1] = odd * cos[i] + even * sin[i];
        }
}

// e^t for t in [-87, 0], within 2 ulp: t = n ln 2 + r with |r| <= ln 2 / 2 (n rounded by adding
// and taking away 1.5 * 2^23), e^r by its Taylor series to r^7 (the rest < 1e-8), times 2^n
// built from its exponent bits. No branch and no call, so the compiler vectorizes its loop.
static float exp_nonpositive(float t) {
    const float n = (t * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = (t - n * 0.693145751953125f) - n * 1.42860677e-06f;   // ln 2 in two parts
    float p = 1.0f / 5040;
    for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
        p = p * r + c;
    return p * from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// SiLU, g / (1 + e^-g), from e = e^-|g| so no exponential overflows: for g >= 0, g / (1 + e);
// for g < 0, g e / (1 + e). Chosen by masks made of the sign and the size, not by branches (a
// branch on a float keeps the compiler from vectorizing the loop). Past |g| = 87, e^-|g| is
// below float32's normal numbers: there e^-87 stands in for it, and g < -87 gives -0, as
// torch's silu gives in float32.
static float silu(float g) {
    const uint32_t u = to_bits(g), magnitude = u & 0x7fffffffu, far = 0x42ae0000u;   // 87.0f
    const float e = exp_nonpositive(from_bits(std::min(magnitude, far) | 0x80000000u));
    const uint32_t negative = static_cast<uint32_t>(static_cast<int32_t>(u) >> 31);
    const uint32_t beyond = 0u - static_cast<uint32_t>(magnitude > far);   // all ones past 87
    return g * from_bits((to_bits(e) & negative & ~beyond) | (to_bits(1.0f) & ~negative)) /
           (1.0f + e);
}

// SwiGLU: out (rows, hidden) = silu(gate) * up, of gate_up (rows, 2 * hidden), gate then up
extern "C" void minipaged_swiglu(const float *gate_up, float *out, int64_t rows, int64_t hidden) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * hidden, *up = gate + hidden;
        for (int64_t i = 0; i < hidden; i++) out[r * hidden + i] = silu(gate[i]) * up[i];
    }
}

// logits (rows, vocab) float32 of tokens (rows,) at positions (rows,); 0, else -1 where the
// installed plan does not serve the step or a token lies outside the vocabulary (nothing was
// written then: the caller's other path says what is wrong)
extern "C" int minipaged_decode_step(const StepModel *m, const int64_t *tokens,
                                     const int64_t *positions, int64_t rows, float *logits) {
    const DecodePlan *p = installed;
    const bool bf16 = m->bf16;
    const int64_t Hq = m->heads, Hk = m->kv_heads, D = m->head_dim, dim = m->dim, M = rows;
    if (!p || p->rows != M || p->layers != m->layers || p->heads != Hq || p->kv_heads != Hk ||
        p->head_dim != D || p->bf16 != m->bf16)
        return -1;
    for (int64_t r = 0; r < M; r++)
        if (tokens[r] < 0 || tokens[r] >= m->vocab)
            return -1;
    const int64_t width = (Hq + 2 * Hk) * D;
    std::vector<float> h(M * dim), a(M * dim), qkv(M * width), q(M * Hq * D), k(M * Hk * D),
        v(M * Hk * D), att(M * Hq * D), o(M * dim), gu(M * 2 * m->hidden), s(M * m->hidden);
    std::vector<c10::BFloat16> k16(bf16 ? M * Hk * D : 0), v16(bf16 ? M * Hk * D : 0);
    std::vector<float> cosines(M * D / 2), sines(M * D / 2);    // each row's rotary angles
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < D / 2; i++) {
            const float angle = static_cast<float>(positions[r]) * m->freqs[i];
            cosines[r * D / 2 + i] = std::cos(angle), sines[r * D / 2 + i] = std::sin(angle);
        }
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < dim; i++) h[r * dim + i] = at_(m->embedding, tokens[r] * dim + i, bf16);
    for (int64_t l = 0; l < m->layers; l++) {
        const StepLayer &w = m->layer[l];
        rms_norm(h.data(), w.attention_norm, a.data(), M, dim, m->eps, bf16);
        product(w.wqkv, a.data(), qkv.data(), M, width, dim, bf16);
        for (int64_t r = 0; r < M; r++) {                       // q, k rotated; v as it is
            const float *row = qkv.data() + r * width;
            float *qr = q.data() + r * Hq * D, *kr = k.data() + r * Hk * D;
            std::memcpy(qr, row, Hq * D * sizeof(float));
            std::memcpy(kr, row + Hq * D, Hk * D * sizeof(float));
            std::memcpy(v.data() + r * Hk * D, row + (Hq + Hk) * D, Hk * D * sizeof(float));
            const float *c = cosines.data() + r * D / 2, *sn = sines.data() + r * D / 2;
            rotate(qr, Hq, D, c, sn);
            rotate(kr, Hk, D, c, sn);
        }
        keep(q.data(), q.size(), bf16);
        keep(k.data(), k.size(), bf16);
        const char *k_new = reinterpret_cast<const char *>(k.data());
        const char *v_new = reinterpret_cast<const char *>(v.data());
        if (bf16) {                                             // the pool's bytes
            for (size_t i = 0; i < k.size(); i++) k16[i] = c10::BFloat16(k[i]), v16[i] = c10::BFloat16(v[i]);
            k_new = reinterpret_cast<const char *>(k16.data());
            v_new = reinterpret_cast<const char *>(v16.data());
        }
        attend_plan(p, l, k_new, v_new, k.data(), v.data(), q.data(), att.data());
        keep(att.data(), att.size(), bf16);
        product(w.wo, att.data(), o.data(), M, dim, Hq * D, bf16);
        for (int64_t i = 0; i < M * dim; i++) h[i] += o[i];
        keep(h.data(), h.size(), bf16);
        rms_norm(h.data(), w.ffn_norm, a.data(), M, dim, m->eps, bf16);
        product(w.w13, a.data(), gu.data(), M, 2 * m->hidden, dim, bf16);
        minipaged_swiglu(gu.data(), s.data(), M, m->hidden);
        keep(s.data(), s.size(), bf16);
        product(w.w2, s.data(), o.data(), M, dim, m->hidden, bf16);
        for (int64_t i = 0; i < M * dim; i++) h[i] += o[i];
        keep(h.data(), h.size(), bf16);
    }
    rms_norm(h.data(), m->norm, a.data(), M, dim, m->norm_eps, bf16);
    product(m->output, a.data(), logits, M, m->vocab, dim, bf16);
    return 0;
}

// The step's products alone, as `minipaged_decode_step` calls them, on rows of zeros: for the
// benchmarks, which time them beside the whole step (benchmarks/smollm2.py)
extern "C" void minipaged_step_products(const StepModel *m, int64_t rows) {
    const int64_t Hq = m->heads, Hk = m->kv_heads, D = m->head_dim, dim = m->dim, M = rows;
    const int64_t widest = std::max({(Hq + 2 * Hk) * D, 2 * m->hidden, m->vocab, dim});
    std::vector<float> x(M * std::max(dim, m->hidden)), y(M * widest);
    for (int64_t l = 0; l < m->layers; l++) {
        const StepLayer &w = m->layer[l];
        product(w.wqkv, x.data(), y.data(), M, (Hq + 2 * Hk) * D, dim, m->bf16);
        product(w.wo, x.data(), y.data(), M, dim, Hq * D, m->bf16);
        product(w.w13, x.data(), y.data(), M, 2 * m->hidden, dim, m->bf16);
        product(w.w2, x.data(), y.data(), M, dim, m->hidden, m->bf16);
    }
    product(m->output, x.data(), y.data(), M, m->vocab, dim, m->bf16);
}
