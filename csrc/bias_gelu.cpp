// Fused bias-add + GeLU on CPU: forward (activation and pre-activation in one pass) and
// backward (dgelu and the bias gradient in one pass over the data).
//
// Shapes: x, y, z, dy, dz are [rows, n] (leading dims flattened); bias, dbias are [n].
// Each task runs the vectorised GeLU epilogue (parallel_layers/cpu/gelu_epilogue.h) on a
// chunk of rows; in backward, dgelu_parallel sums the bias gradient per chunk (chunks from
// parallel_layers/row_chunks.h, shared with the CUDA kernels), so the summation order does
// not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/cpu/gelu_epilogue.h"
#include "parallel_layers/cpu/linear_panels.h"
#include "parallel_layers/ops.h"

namespace parallel_layers::cpu {
namespace {

// Rows per task: ~64K elements, enough work to amortise scheduling, small enough for L2.
int64_t min_rows_per_task(int64_t n) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> bias_gelu(const at::Tensor& x, const at::Tensor& bias,
                                             std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const int64_t n = check_bias_gelu_args(x, bias, at::kCPU);

  const at::Tensor x2 = x.contiguous().view({leading_rows(x), n});
  const at::Tensor b = bias.contiguous();
  at::Tensor y = at::empty_like(x2);
  at::Tensor z = at::empty_like(x2);
  at::parallel_for(0, x2.size(0), min_rows_per_task(n), [&](int64_t begin, int64_t end) {
    gelu_epilogue(row_range(x2, begin, end), b, row_range(z, begin, end), row_range(y, begin, end), approx);
  });
  return {y.view(x.sizes()), z.view(x.sizes())};
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& preact,
                                                      std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const int64_t n = check_bias_gelu_backward_args(grad_out, preact, at::kCPU);
  const int64_t rows = leading_rows(preact);

  const at::Tensor dy = grad_out.contiguous().view({rows, n});
  const at::Tensor z = preact.contiguous().view({rows, n});
  at::Tensor dz = at::empty_like(z);
  at::Tensor dbias = dgelu_parallel(dy, z, dz, at::Tensor(), /*want_dbias=*/true, approx);
  return {dz.view(preact.sizes()), dbias};
}

}  // namespace parallel_layers::cpu

TORCH_LIBRARY_IMPL(parallel_layers, CPU, m) {
  m.impl("bias_gelu", &parallel_layers::cpu::bias_gelu);
  m.impl("bias_gelu_backward", &parallel_layers::cpu::bias_gelu_backward);
}
