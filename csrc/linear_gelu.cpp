// Fused GEMM + bias + GeLU on CPU: y = gelu(x @ weight^T + bias), keeping the
// pre-activation z = x @ weight^T + bias for backward when asked to.
//
// Shapes: x [M, K] (leading dims flattened), weight [N, K], bias [N], y and z [M, N].
//
// The output is produced in row panels of a few MB. For each panel the GEMM (ATen's BLAS,
// with the bias folded in as addmm's input, all threads) writes the pre-activation straight
// into its place in z (or into y when z is not kept), and the vectorised GeLU epilogue then
// runs over that panel, in parallel, while it is still in cache (L3 here) - instead of a second pass over the whole
// output after the GEMM. Panels, not small per-thread tiles: on this 2-core
// machine a BLAS call per small tile inside at::parallel_for ran 1.2-1.6x slower than one
// multi-threaded GEMM of the same size (measured in benchmarks/bench_linear_gelu.py's
// shapes), which cost more than the cache misses the tiles save.
#include <array>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/cpu/gelu_epilogue.h"
#include "parallel_layers/cpu/linear_panels.h"
#include "parallel_layers/ops.h"

namespace parallel_layers::cpu {
namespace {

// Note [bfloat16 inference through oneDNN]: when no pre-activation is kept (inference) and
// the dtype is bfloat16, oneDNN's fused linear + GeLU post-op (ATen's
// mkldnn::_linear_pointwise) applies GeLU to each GEMM output tile in registers; at
// 2048x1024x4096 it took 9.7 ms against 10.5 for our GEMM + epilogue, with eager's rounding. The
// issue allows a vendor epilogue where it wins, so that case goes there when ATen has the
// op and this CPU supports oneDNN bfloat16; training keeps our path, which also writes z.
std::optional<at::Tensor> onednn_bf16_linear_gelu(const at::Tensor& x2, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias, GeluApprox approx) {
  if (!onednn_supports_bf16() || !has_onednn_linear() || x2.scalar_type() != at::kBFloat16) return std::nullopt;
  return onednn_linear(x2, weight.contiguous(), bias,
                       "gelu", approx == GeluApprox::kTanh ? "tanh" : "none");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_gelu(const at::Tensor& x, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias,
                                               std::string_view approximate, bool save_preact) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const GeluApprox approx = parse_gelu_approx(approximate);
  const auto [M, K, N] = check_linear_gelu_args(x, weight, bias, at::kCPU);

  const at::Tensor x2 = x.reshape({M, K});
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  if (!save_preact && M > 0 && N > 0 && K > 0) {
    if (auto y = onednn_bf16_linear_gelu(x2, weight, bias, approx)) {
      return {y->view(out_shape), at::empty({0}, x.options())};
    }
  }
  if (M > 0 && N > 0 && K > 0 && onednn_forward_gemm(x2)) {
    // Notes [float32 GEMMs through oneDNN], [bfloat16 forward GEMM through oneDNN] (csrc/gemm.cpp):
    // one GEMM, bias included, then the epilogue over all of it - into y, or in place when the
    // pre-activation is not kept (bfloat16 inference went through oneDNN's GeLU above).
    const at::Tensor acc = onednn_linear(x2, weight.contiguous(), bias);
    const at::Tensor y = save_preact ? at::empty({M, N}, x.options()) : acc;
    at::parallel_for(0, M, rows_per_task(N), [&](int64_t begin, int64_t end) {
      gelu_epilogue(row_range(acc, begin, end), std::nullopt, at::Tensor(), row_range(y, begin, end), approx);
    });
    return {y.view(out_shape), save_preact ? acc.view(out_shape) : at::empty({0}, x.options())};
  }
  const at::Tensor wt = weight.t();  // [K, N] view; BLAS reads it transposed, no copy
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor z = save_preact ? at::empty({M, N}, x.options()) : at::empty({0}, x.options());
  at::Tensor acc = save_preact ? z : y;  // where the GEMM writes the pre-activation
  if (M > 0 && N > 0) {
    const int64_t panel = rows_per_panel(M, N);
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
      const int64_t r1 = std::min(M, r0 + panel);
      // The bias goes into the GEMM (addmm accumulates it before the one rounding to the
      // output dtype); adding it in the epilogue instead saved ~4% in float32 but rounded
      // 16-bit outputs twice (up to 7x eager's error in bfloat16).
      // Note [bfloat16 GEMM without oneDNN]: gemm_out widens where ATen's bfloat16 GEMM is slow.
      gemm_out(row_range(acc, r0, r1), bias, row_range(x2, r0, r1), wt);
      at::parallel_for(r0, r1, rows_per_task(N), [&](int64_t begin, int64_t end) {
        gelu_epilogue(row_range(acc, begin, end), std::nullopt, at::Tensor(), row_range(y, begin, end), approx);
      });
    }
  }
  return {y.view(out_shape), save_preact ? z.view(out_shape) : z};
}

}  // namespace parallel_layers::cpu

namespace parallel_layers {

// Note [weight-gradient operand layout]: the one rule for the layout in which the GEMM
// dweight = dz^T @ x gets dz^T, on every path that computes a linear layer's weight gradient
// (linear_gelu_backward, linear_swiglu_backward and linear_weight_grad, CPU and CUDA; the
// tensor-parallel layers call the last). In bfloat16 on a CPU with bfloat16 dot-product
// instructions (cpu_has_native_bf16) it gets a row-major [N, M] copy of dz^T; everywhere else it
// reads the transposed view of dz, as eager autograd does.
// - bfloat16 on CPU: ATen's oneDNN GEMM runs 2-2.5x slower from a transposed first operand on
//   a CPU with AMX (M x K x N = 2048x1024x4096: dz.t() @ x 15.2 ms, a row-major dz^T 6.8 ms;
//   4096x4096x1024: 24.7 vs 14.6 ms; the TP benchmark's dz [1024, 2048], x [1024, 1024], one
//   thread: 5.9 vs 2.7 ms) and 4-5% slower on an AVX-512-BF16 CPU without AMX (2048x1024x4096:
//   86.9 vs 83.3 ms, one thread). linear_gelu_backward's dgelu pass and linear_swiglu_backward's
//   dswiglu pass write dz^T from blocks of rows still in cache; linear_weight_grad, handed a
//   ready dz, copies it with transpose_2d. For the dgelu pass, dz [1024, 2048], one thread: on
//   the AMX CPU ~0.7 ms more than writing dz alone, and 0.33 ms per [1024, 1024] for the copy;
//   on the other, 0.86 and 0.94 ms. (The dswiglu pass: csrc/linear_swiglu.cpp.)
// - float16 on CPU: the GEMM ran 2.1-2.7x slower from a row-major dz^T than from the transposed
//   view on the AVX-512 CPU (256x256x512: 29.5 vs 14.1 ms; 512x512x1024: 306 vs 115 ms, one
//   thread), and gained less than any copy costs on the AMX one (5.3 vs 5.9 ms): it keeps the view.
// - float32 and float64 (MKL) read either layout at the same speed, and so does cuBLAS.
// - bfloat16 on a CPU without native bfloat16 dot products (no AVX512_BF16, no AMX; e.g. an
//   AVX2-only AMD EPYC) is the opposite: the row-major dz^T made the GEMM ~11x slower (dz [512,
//   2752], x [512, 512], both threads: 1161 / 1186 ms against 110 / 101 ms from the view, the copy
//   2-3 ms), and linear_swiglu's forward + backward took 2742 ms against eager's 1556. So the copy
//   is made only where cpu_has_native_bf16() says the instructions it was measured with exist.
// Both layouts accumulate the GEMM in float32 for 16-bit dtypes (the BLAS's own accumulation)
// and round dweight once; dz is rounded to the dtype first, as eager's gelu_backward does.

namespace {

// Whether this CPU has bfloat16 dot-product instructions (AVX512_BF16 or AMX-BF16), the CPUs on
// which the row-major dz^T was measured faster. Elsewhere (other x86, other compilers, other
// architectures) the GEMM reads the view, as eager autograd does.
bool cpu_has_native_bf16() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const bool has = __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
  return has;
#else
  return false;
#endif
}

}  // namespace

bool weight_grad_wants_dz_t(const at::Tensor& dz) {
  return dz.device().is_cpu() && dz.scalar_type() == at::kBFloat16 && cpu_has_native_bf16();
}

at::Tensor weight_grad(const at::Tensor& dz, const at::Tensor& dz_t, const at::Tensor& x2) {
  if (dz_t.defined()) return at::mm(dz_t, x2);
  if (weight_grad_wants_dz_t(dz)) return at::mm(cpu::transpose_2d(dz), x2);
  return gemm(dz.t(), x2);  // Note [bfloat16 GEMM without oneDNN]
}

}  // namespace parallel_layers

namespace parallel_layers::cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_gelu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                    const at::Tensor& weight,
                                                                    const at::Tensor& preact,
                                                                    std::string_view approximate,
                                                                    std::array<bool, 3> output_mask) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const GeluApprox approx = parse_gelu_approx(approximate);
  const auto [M, K, N] = check_linear_gelu_backward_args(grad_y, x, weight, preact, at::kCPU);
  const auto [need_dx, need_dw, need_db] = output_mask;
  const at::Tensor dy = grad_y.contiguous().view({M, N});
  const at::Tensor z = preact.contiguous().view({M, N});
  const at::Tensor x2 = x.reshape({M, K});
  // Unasked gradients: distinct empty tensors (outputs must not alias).
  const auto empty = [&] { return at::empty({0}, x.options()); };

  const bool transposed = need_dw && weight_grad_wants_dz_t(dy);  // Note [weight-gradient operand layout]
  // Note [backward scratch on CPU] (parallel_layers/cpu/linear_panels.h)
  const bool want_dz = need_dx || (need_dw && !transposed);
  std::optional<Scratch> dz_buf, dz_t_buf;
  if (want_dz || (need_db && !transposed)) dz_buf.emplace(0, at::IntArrayRef{M, N}, x.options());
  if (transposed) dz_t_buf.emplace(1, at::IntArrayRef{N, M}, x.options());
  const at::Tensor dz = want_dz ? dz_buf->tensor() : at::Tensor();
  const at::Tensor dz_t = transposed ? dz_t_buf->tensor() : at::Tensor();
  at::Tensor db;
  if (dz.defined() || dz_t.defined()) {
    db = dgelu_parallel(dy, z, dz, dz_t, need_db, approx);
  } else if (need_db) {  // only the bias gradient is wanted: dz is written to scratch and dropped
    db = dgelu_parallel(dy, z, dz_buf->tensor(), at::Tensor(), /*want_dbias=*/true, approx);
  }
  at::Tensor dx = need_dx ? input_grad_gemm(dz, weight).view(x.sizes()) : empty();  // csrc/gemm.cpp
  at::Tensor dw = need_dw ? weight_grad(dz, dz_t, x2) : empty();
  return {dx, dw, need_db ? db : empty()};
}

at::Tensor linear_weight_grad(const at::Tensor& grad_out, const at::Tensor& x) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N] = check_linear_weight_grad_args(grad_out, x, at::kCPU);
  return weight_grad(grad_out.reshape({M, N}), at::Tensor(), x.reshape({M, K}));
}

at::Tensor linear_input_grad(const at::Tensor& grad_out, const at::Tensor& weight) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N] = check_linear_input_grad_args(grad_out, weight, at::kCPU);
  std::vector<int64_t> shape(grad_out.sizes().begin(), grad_out.sizes().end());
  shape.back() = K;
  return input_grad_gemm(grad_out.reshape({M, N}).contiguous(), weight).view(shape);
}

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N] = check_linear_gelu_args(x, weight, bias, at::kCPU, "linear_forward");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  const at::Tensor x2 = x.reshape({M, K});
  // Notes [float32 GEMMs through oneDNN], [bfloat16 forward GEMM through oneDNN] (csrc/gemm.cpp)
  if (M > 0 && N > 0 && K > 0 && onednn_forward_gemm(x2)) {
    return onednn_linear(x2, weight.contiguous(), bias).view(shape);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) gemm_out(y, bias, x2, weight.t());  // Note [bfloat16 GEMM without oneDNN]
  return y.view(shape);
}

}  // namespace parallel_layers::cpu

TORCH_LIBRARY_IMPL(parallel_layers, CPU, m) {
  m.impl("linear_gelu", &parallel_layers::cpu::linear_gelu);
  m.impl("linear_gelu_backward", &parallel_layers::cpu::linear_gelu_backward);
  m.impl("linear_weight_grad", &parallel_layers::cpu::linear_weight_grad);
  m.impl("linear_input_grad", &parallel_layers::cpu::linear_input_grad);
  m.impl("linear_forward", &parallel_layers::cpu::linear_forward);
}
