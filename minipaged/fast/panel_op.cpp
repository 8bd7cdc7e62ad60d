// `minipaged::panel_linear`'s CPU kernel registered in C++ (matvec.py's `panel_operator` builds
// it with panels.c and loads it): the same work as matvec.py's `panel_linear`, which serves the
// operator where this cannot be built. A compiled step calls the operator through torch's
// dispatcher, hundreds of times a step; registered in Python, each call went back into the
// interpreter. PANEL and MOST_ROWS come from matvec.py (-D).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

extern "C" void panel_linear(const float *x, const float *panels, float *y, int M, int N, int K,
                             int threads);

static at::Tensor panel_linear_cpu(const at::Tensor &x, const at::Tensor &panels,
                                   const at::Tensor &weight_t) {
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

TORCH_LIBRARY_IMPL(minipaged, CPU, m) { m.impl("panel_linear", panel_linear_cpu); }
