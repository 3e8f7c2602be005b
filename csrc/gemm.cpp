// The CPU GEMMs of the fused linear ops (linear_gelu, linear_swiglu and their backwards): which
// library computes each, per dtype and CPU. Every rule here is a Note measured on the CPU it
// names; callers (csrc/linear_gelu.cpp, csrc/linear_swiglu.cpp) ask these functions and never
// pick a library themselves. The weight gradient's operand layout is a rule of its own (Note
// [weight-gradient operand layout], csrc/linear_gelu.cpp).
#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "parallel_layers/ops.h"

namespace parallel_layers {

// Whether ATen's oneDNN supports bfloat16 on this CPU (mkldnn::_is_mkldnn_bf16_supported; it
// needs AVX-512 or AMX on x86). Where it does not, ATen's bfloat16 GEMM runs its own loops.
bool onednn_supports_bf16() {
  static const bool supported = [] {
    const auto check = c10::Dispatcher::singleton().findOp({"mkldnn::_is_mkldnn_bf16_supported", ""});
    if (!check) return false;
    torch::jit::Stack stack;
    check->callBoxed(stack);
    return stack.size() == 1 && stack[0].toBool();
  }();
  return supported;
}

// Note [bfloat16 GEMM without oneDNN]: where oneDNN has no bfloat16 support (an AVX2-only CPU,
// e.g. an AMD EPYC before Zen 4), ATen's bfloat16 GEMM falls back to its own loops. On such a
// CPU (2 cores, both threads, median of 3) the three GEMMs of linear_swiglu at 512x512x1376 took
// in bfloat16: forward x @ W^T 96 ms, dx = dz @ W 1529 ms, dweight = dz^T @ x 71 ms; widened to
// float32 (MKL), converted and rounded back included: 22, 19 and 21 ms. Eager autograd runs the
// same slow loops, so where the fused ops own the GEMM they widen. Each product is accumulated
// in float32 either way and rounded once to bfloat16 - the value is what the bfloat16 GEMM means,
// though not necessarily its bits (the summation order is MKL's). CPUs with oneDNN bfloat16
// (AVX-512, AMX) and every other dtype and device keep ATen's GEMM.
bool gemm_widens(const at::Tensor& a) {
  return a.device().is_cpu() && a.scalar_type() == at::kBFloat16 && !onednn_supports_bf16();
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) {
  if (!gemm_widens(a)) return at::mm(a, b);
  return at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
}

void gemm_out(const at::Tensor& out, const std::optional<at::Tensor>& bias, const at::Tensor& a,
              const at::Tensor& b) {
  at::Tensor result = out;  // the *_out functions take a mutable handle; this one shares out's storage
  if (gemm_widens(a)) {
    const at::Tensor a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
    result.copy_(bias ? at::addmm(bias->to(at::kFloat), a32, b32) : at::mm(a32, b32));
  } else if (bias) {
    at::addmm_out(result, *bias, a, b);
  } else {
    at::mm_out(result, a, b);
  }
}

// Note [float32 GEMMs through oneDNN]: ATen computes a float32 linear layer with MKL's sgemm,
// which on AMD CPUs does not run AVX-512 code; oneDNN's matmul (ATen's
// mkldnn::_linear_pointwise, the op Inductor's CPU backend lowers frozen linear layers to) does.
// On this project's 2-core AMD EPYC (Zen 4, AVX-512; median of 8-20 interleaved calls, both
// threads), with linear_swiglu's packed weights: the forward x @ W^T + b took 7.27 / 28.7 ms
// through oneDNN against 8.37 / 37.7 through MKL at M x K x 2N = 512x512x2752 / 512x1024x5632,
// and dx = dz @ W 7.24 / 30.4 against 8.02 / 34.7. The weight gradient dz^T @ x, whose first
// operand is a transposed view, was no faster (12.4 / 37.1 against 8.1 / 37.7 ms) and stays
// with ATen. So on AMD x86 CPUs with AVX-512 the fused ops' float32 forward and input-gradient
// GEMMs go through oneDNN; on every other CPU (Intel's, where MKL runs AVX-512 code, and
// AVX2-only ones, where this was not measured) and for every other dtype, ATen's GEMM. Both
// accumulate in float32 and add the bias before the one rounding; their bits differ (another
// summation order). PARALLEL_LAYERS_CPU_GEMM=aten|onednn (read once) or
// parallel_layers._C._set_cpu_gemm overrides the rule ("auto"), so tests run both paths on any
// CPU. Below ~128 x 128 x 256 oneDNN's per-call cost makes it ~10 us slower than MKL (64 x 64 x
// 192: 0.060 vs 0.048 ms); from there up it is 1.1-2.1x faster (16 x 4096 x 8192: 9.9 vs 21 ms),
// so the rule has no size threshold.
namespace {

enum class CpuGemm : int { kAuto = 0, kAten = 1, kOneDnn = 2 };

CpuGemm parse_cpu_gemm(const std::string& name) {
  if (name == "auto") return CpuGemm::kAuto;
  if (name == "aten") return CpuGemm::kAten;
  if (name == "onednn") return CpuGemm::kOneDnn;
  TORCH_CHECK(false, "CPU GEMM backend must be 'auto', 'aten' or 'onednn' (PARALLEL_LAYERS_CPU_GEMM), got '",
              name, "'");
}

std::atomic<int>& cpu_gemm_setting() {
  static std::atomic<int> setting{[] {
    const char* env = std::getenv("PARALLEL_LAYERS_CPU_GEMM");
    return static_cast<int>(env && *env ? parse_cpu_gemm(env) : CpuGemm::kAuto);
  }()};
  return setting;
}

bool amd_with_avx512() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  static const bool yes = __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f");
  return yes;
#else
  return false;
#endif
}

}  // namespace

std::string set_cpu_gemm(const std::string& name) {
  static constexpr const char* kNames[] = {"auto", "aten", "onednn"};
  return kNames[cpu_gemm_setting().exchange(static_cast<int>(parse_cpu_gemm(name)))];
}

std::string fp32_cpu_gemm() { return onednn_fp32_gemm(at::empty({0}, at::kFloat)) ? "onednn" : "aten"; }

bool onednn_fp32_gemm(const at::Tensor& a) {
  if (!a.device().is_cpu() || a.scalar_type() != at::kFloat || !has_onednn_linear()) return false;
  switch (static_cast<CpuGemm>(cpu_gemm_setting().load())) {
    case CpuGemm::kAten: return false;
    case CpuGemm::kOneDnn: return true;
    case CpuGemm::kAuto: break;
  }
  return amd_with_avx512();
}

// Note [bfloat16 forward GEMM through oneDNN]: on a CPU whose oneDNN supports bfloat16, ATen's
// bfloat16 addmm (F.linear with a bias) first copies the bias into the output, then runs
// oneDNN's matmul accumulating into it: a pass over the output before the GEMM. oneDNN's linear
// (mkldnn::_linear_pointwise, onednn_linear) adds the bias in the GEMM's epilogue instead. Both
// round once, from the float32 accumulator plus the bias; the bits matched F.linear at the
// three benchmark shapes and match in the tests. On this project's 2-core Zen 4 EPYC (bfloat16,
// both threads, interleaved medians; 512x512x1376 / 512x1024x2816 / 1024x2048x5632, the packed
// SwiGLU weight): the GEMM with its bias took 3.48 / 15.10 / 112.5 ms against F.linear's 3.56 /
// 15.71 / 114.7; linear_swiglu's forward keeping its pre-activation 3.87 / 15.47 / 114.2 against
// 4.54 / 16.36 / 116.2 through addmm, and its forward + backward 1.05 / 1.01 / 1.01x faster. So
// the forward GEMMs (linear_forward; linear_gelu's and linear_swiglu's forwards that keep the
// pre-activation) take oneDNN's linear for bfloat16 there, as for float32 under Note [float32
// GEMMs through oneDNN]. onednn_forward_gemm says which.
bool onednn_forward_gemm(const at::Tensor& a) {
  if (onednn_fp32_gemm(a)) return true;
  return a.device().is_cpu() && a.scalar_type() == at::kBFloat16 && onednn_supports_bf16() && has_onednn_linear();
}

bool has_onednn_linear() {
  static const bool has = c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""}).has_value();
  return has;
}

bool has_onednn_linear_binary() {
  static const bool has = c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", "binary"}).has_value();
  return has;
}

at::Tensor onednn_linear(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::string& post_op, const std::string& algorithm) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // a kernel of ours: no graph for the inner op
  const c10::IValue b = bias ? c10::IValue(bias->contiguous()) : c10::IValue();
  torch::jit::Stack stack{x2.contiguous(), weight, b, c10::IValue(post_op),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(algorithm)};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

at::Tensor onednn_linear_binary(const at::Tensor& x2, const at::Tensor& other, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const std::string& binary_op) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const c10::IValue b = bias ? c10::IValue(bias->contiguous()) : c10::IValue();
  torch::jit::Stack stack{x2.contiguous(), other.contiguous(), weight, b, c10::IValue(binary_op)};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

at::Tensor input_grad_gemm(const at::Tensor& dz, const at::Tensor& weight) {
  // dz @ weight is a linear layer of dz with weight^T ([in, out] as [out, in]): oneDNN reads the
  // transposed view of a row-major weight (no copy; measured at the dx speed in the Note).
  if (onednn_fp32_gemm(dz) && dz.numel() > 0 && weight.numel() > 0) {
    return onednn_linear(dz, weight.contiguous().t(), std::nullopt);
  }
  return gemm(dz, weight);
}

}  // namespace parallel_layers
