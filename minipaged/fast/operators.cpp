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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

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
    at::Tensor k_ = k.contiguous(), v_ = v.contiguous();
    char *k_pool = p->pools[2 * layer], *v_pool = p->pools[2 * layer + 1];
    const char *k_new = static_cast<const char *>(k_.const_data_ptr());
    const char *v_new = static_cast<const char *>(v_.const_data_ptr());
    const int64_t *slots = p->slots + layer * p->rows, n = p->token_bytes;
    if (p->quantize) {                                   // int8: quantized into their slots
        at::Tensor k32 = k_.to(at::kFloat).contiguous(), v32 = v_.to(at::kFloat).contiguous();
        p->quantize(k32.const_data_ptr<float>(), reinterpret_cast<int8_t *>(k_pool), slots,
                    p->rows, p->kv_heads, p->head_dim);
        p->quantize(v32.const_data_ptr<float>(), reinterpret_cast<int8_t *>(v_pool), slots,
                    p->rows, p->kv_heads, p->head_dim);
    } else {
        for (int64_t r = 0; r < p->rows; r++) {          // the new tokens into their slots
            std::memcpy(k_pool + slots[r] * n, k_new + r * n, n);
            std::memcpy(v_pool + slots[r] * n, v_new + r * n, n);
        }
    }
    at::Tensor q32 = q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty(q.sizes(), q32.options());
    p->kernel(q32.const_data_ptr<float>(), k_pool, v_pool, p->tables + layer * p->rows * p->width,
              p->width, p->lens, p->rows, p->kv_heads, p->block_size, p->scale,
              out.mutable_data_ptr<float>(), at::get_num_threads());
    return out.to(q.scalar_type());
}

TORCH_LIBRARY_IMPL(minipaged, CPU, m) {
    m.impl("panel_linear", panel_linear_cpu);
    m.impl("attend", attend_cpu);
}
