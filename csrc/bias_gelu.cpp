// Fused bias-add + GeLU on CPU: forward (activation and pre-activation in one pass) and
// backward (dgelu and the bias gradient in one pass over the data).
//
// Shapes: x, y, z, dy, dz are [rows, n] (leading dims flattened); bias, dbias are [n].
// The GeLU formulas live in parallel_layers/gelu.h and are shared with csrc/cuda/bias_gelu.cu.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/gelu.h"
#include "parallel_layers/ops.h"
#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cpu {
namespace {

// Rows handed to one task: enough work per task to amortise scheduling.
int64_t rows_per_task(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

template <GeluApprox kApprox, typename scalar_t>
void forward_rows(const scalar_t* x, const scalar_t* bias, scalar_t* y, scalar_t* z, int64_t rows,
                  int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t off = r * n;
      for (int64_t c = 0; c < n; ++c) {
        const opmath_t pre = static_cast<opmath_t>(x[off + c]) + static_cast<opmath_t>(bias[c]);
        z[off + c] = static_cast<scalar_t>(pre);
        y[off + c] = static_cast<scalar_t>(gelu_forward<kApprox>(pre));
      }
    }
  });
}

// dz = dy * gelu'(z) written row by row; each chunk of rows adds its column sums into
// partials[chunk, :], so the data is read once and the summation order is fixed.
template <GeluApprox kApprox, typename scalar_t>
void backward_rows(const scalar_t* dy, const scalar_t* z, scalar_t* dz,
                   at::opmath_type<scalar_t>* partials, const RowChunks& chunks, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, chunks.num_chunks(), 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      opmath_t* acc = partials + chunk * n;
      std::fill(acc, acc + n, opmath_t(0));
      for (int64_t r = chunks.begin(chunk); r < chunks.end(chunk); ++r) {
        const int64_t off = r * n;
        for (int64_t c = 0; c < n; ++c) {
          const opmath_t g = static_cast<opmath_t>(dy[off + c]) *
                             gelu_derivative<kApprox>(static_cast<opmath_t>(z[off + c]));
          dz[off + c] = static_cast<scalar_t>(g);
          acc[c] += g;
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> bias_gelu(const at::Tensor& x, const at::Tensor& bias,
                                             std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const int64_t n = check_bias_gelu_args(x, bias, at::kCPU);

  const at::Tensor x_c = x.contiguous();
  const at::Tensor b_c = bias.contiguous();
  at::Tensor y = at::empty_like(x_c);
  at::Tensor z = at::empty_like(x_c);
  const int64_t rows = n == 0 ? 0 : x_c.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_cpu", [&] {
    dispatch_gelu_approx(approx, [&](auto a) {
      forward_rows<decltype(a)::value>(x_c.const_data_ptr<scalar_t>(), b_c.const_data_ptr<scalar_t>(),
                                       y.mutable_data_ptr<scalar_t>(), z.mutable_data_ptr<scalar_t>(),
                                       rows, n);
    });
  });
  return {y, z};
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& preact,
                                                      std::string_view approximate) {
  const GeluApprox approx = parse_gelu_approx(approximate);
  const int64_t n = check_bias_gelu_backward_args(grad_out, preact, at::kCPU);

  const at::Tensor dy = grad_out.contiguous();
  const at::Tensor z = preact.contiguous();
  at::Tensor dz = at::empty_like(z);
  const int64_t rows = n == 0 ? 0 : z.numel() / n;
  const RowChunks chunks =
      make_row_chunks(rows, /*max_chunks=*/4 * at::get_num_threads(), rows_per_task(n));
  const auto opmath = at::toOpMathType(z.scalar_type());
  at::Tensor partials = at::empty({chunks.num_chunks(), n}, z.options().dtype(opmath));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "bias_gelu_backward_cpu", [&] {
    dispatch_gelu_approx(approx, [&](auto a) {
      backward_rows<decltype(a)::value>(dy.const_data_ptr<scalar_t>(), z.const_data_ptr<scalar_t>(),
                                        dz.mutable_data_ptr<scalar_t>(),
                                        partials.mutable_data_ptr<at::opmath_type<scalar_t>>(),
                                        chunks, n);
    });
  });
  at::Tensor dbias = partials.sum(0).to(z.scalar_type());
  return {dz, dbias};
}

}  // namespace parallel_layers::cpu

TORCH_LIBRARY_IMPL(parallel_layers, CPU, m) {
  m.impl("bias_gelu", &parallel_layers::cpu::bias_gelu);
  m.impl("bias_gelu_backward", &parallel_layers::cpu::bias_gelu_backward);
}
