// C++ entry points of the ops, per backend. The dispatcher registrations in
// csrc/<family>.cpp and csrc/cuda/<family>.cpp point at these; the C++ unit tests
// (tests/cpp) call the CPU ones directly.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace parallel_layers {

// Note [no autocast inside the ops]: an op computes in its inputs' dtype by its own rules
// (float32 stays float32; Note [bfloat16 GEMM without oneDNN] widens bfloat16 on purpose). Inside
// a torch.autocast region the ATen GEMMs a kernel calls would be recast by autocast's policy (CPU
// autocast runs mm / addmm in bfloat16): linear_weight_grad of float32 operands returned
// bfloat16 there, against its fake's float32, and a widened product went back to bfloat16's slow
// loops. So every kernel that calls an ATen GEMM holds this guard. The ops' own autocast policy
// is their Autocast kernels (csrc/autocast.cpp), which cast the inputs before the kernel runs.
struct NoAutocastInside {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// The weight gradient of a linear layer, dweight = dz^T @ x2 (dz [M, N]: the gradient of its
// pre-activation; x2 [M, K]: its input), shared by both backends' linear_gelu_backward,
// linear_swiglu_backward and linear_weight_grad. weight_grad_wants_dz_t is the rule of Note
// [weight-gradient operand layout] (csrc/linear_gelu.cpp): whether the GEMM gets dz^T as a
// row-major [N, M] copy.
// weight_grad follows it: from dz_t when the op's pass (dgelu, dswiglu) has written it, else
// from dz, copied to dz^T first when the rule asks for it (dz_t undefined).
bool weight_grad_wants_dz_t(const at::Tensor& dz);
at::Tensor weight_grad(const at::Tensor& dz, const at::Tensor& dz_t, const at::Tensor& x2);

// The fused ops' CPU GEMMs (csrc/gemm.cpp). Note [bfloat16 GEMM without oneDNN]: for a bfloat16
// CPU operand on a CPU where ATen's oneDNN has no bfloat16 support (onednn_supports_bf16), the
// operands are widened to float32 and the product (bias included) rounded once into the bfloat16
// result; everywhere else gemm / gemm_out are at::mm / at::addmm_out. gemm_widens says which.
bool onednn_supports_bf16();
bool gemm_widens(const at::Tensor& a);
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b);
void gemm_out(const at::Tensor& out, const std::optional<at::Tensor>& bias, const at::Tensor& a,
              const at::Tensor& b);
// Note [float32 GEMMs through oneDNN]: whether the float32 forward and input-gradient GEMMs
// with first operand `a` go through oneDNN's matmul (onednn_linear: x2 [M, K] @ weight^T [K, N]
// + bias, non-empty operands; x2 and bias are made contiguous, weight [N, K] is read in its own
// strides) rather than ATen's; input_grad_gemm is dz @ weight by that rule (and Note [bfloat16
// GEMM without oneDNN]). set_cpu_gemm("auto" | "aten" | "onednn") overrides the rule and returns
// the previous setting.
// onednn_linear with a post_op other than "none" is oneDNN's fused epilogue (its GeLU:
// Note [bfloat16 inference through oneDNN]); onednn_linear_binary applies `binary_op` ("mul",
// "add") with `other` [M, N] to x2 @ weight^T + bias in the GEMM's epilogue (Note [SwiGLU
// inference through oneDNN post-ops]); has_onednn_linear(_binary) say whether ATen has them.
bool onednn_fp32_gemm(const at::Tensor& a);
// Note [bfloat16 forward GEMM through oneDNN]: whether a forward GEMM x2 @ weight^T + bias with
// first operand `a` goes through onednn_linear: float32 by the rule above, and bfloat16 where
// ATen's oneDNN supports it.
bool onednn_forward_gemm(const at::Tensor& a);
bool has_onednn_linear();
bool has_onednn_linear_binary();
at::Tensor onednn_linear(const at::Tensor& x2, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::string& post_op = "none", const std::string& algorithm = "");
at::Tensor onednn_linear_binary(const at::Tensor& x2, const at::Tensor& other, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const std::string& binary_op);
at::Tensor input_grad_gemm(const at::Tensor& dz, const at::Tensor& weight);
// "aten" or "onednn": where float32 CPU GEMMs go under the current setting.
std::string set_cpu_gemm(const std::string& name);
std::string fp32_cpu_gemm();

namespace cpu {
// x [..., n], bias [n] -> (gelu(x + bias), x + bias), both shaped like x.
std::tuple<at::Tensor, at::Tensor> bias_gelu(const at::Tensor& x, const at::Tensor& bias,
                                             std::string_view approximate);
// grad_out, preact [..., n] -> (grad_out * gelu'(preact) shaped like preact, its column sum [n]).
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& preact,
                                                      std::string_view approximate);
// x [..., k], weight [n, k], bias [n] -> (gelu(x @ weight^T + bias) [..., n], the pre-activation
// [..., n] if save_preact else an empty [0]).
std::tuple<at::Tensor, at::Tensor> linear_gelu(const at::Tensor& x, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias,
                                               std::string_view approximate, bool save_preact);
// grad_y, preact [..., n], x [..., k], weight [n, k] -> (dx like x, dweight [n, k], dbias [n]);
// output_mask says which are needed; the others come back as empty [0] tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_gelu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                    const at::Tensor& weight,
                                                                    const at::Tensor& preact,
                                                                    std::string_view approximate,
                                                                    std::array<bool, 3> output_mask);
// The fewest rows (x's leading dims flattened) for which float32 inference takes Note [float32
// SwiGLU inference through brgemm] (csrc/linear_swiglu.cpp).
int64_t brgemm_swiglu_min_rows();
// x [..., k], weight [2n, k] (gate rows on up rows), bias [2n] -> (silu(gate) * up [..., n], the
// pre-activation x @ weight^T + bias [..., 2n] if save_preact else an empty [0]).
std::tuple<at::Tensor, at::Tensor> linear_swiglu(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias, bool save_preact);
// grad_y [..., n], x [..., k], weight [2n, k], preact [..., 2n] -> (dx like x, dweight [2n, k],
// dbias [2n]); output_mask says which are needed; the others come back as empty [0] tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                      const at::Tensor& weight,
                                                                      const at::Tensor& preact,
                                                                      std::array<bool, 3> output_mask);
// grad_y [..., n], preact [..., 2n] -> (d_preact [..., 2n] = d_gate | d_up, dbias [2n] if
// need_dbias else an empty [0]): linear_swiglu_backward's epilogue alone, for callers that run
// the GEMMs themselves (the tensor-parallel layer overlaps a collective with them).
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_y, const at::Tensor& preact,
                                                   bool need_dbias);
// grad_out [..., n], x [..., k] with the same leading dims -> grad_out^T @ x [n, k].
at::Tensor linear_weight_grad(const at::Tensor& grad_out, const at::Tensor& x);
// grad_out [..., n], weight [n, k] -> grad_out @ weight [..., k].
at::Tensor linear_input_grad(const at::Tensor& grad_out, const at::Tensor& weight);
// x [..., k], weight [n, k], bias [n] or none -> x @ weight^T + bias [..., n].
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// x [rows, cols] -> x^T as a contiguous [cols, rows].
at::Tensor transpose_2d(const at::Tensor& x);
}  // namespace cpu

namespace cuda {
std::tuple<at::Tensor, at::Tensor> bias_gelu(const at::Tensor& x, const at::Tensor& bias,
                                             std::string_view approximate);
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_out,
                                                      const at::Tensor& preact,
                                                      std::string_view approximate);
std::tuple<at::Tensor, at::Tensor> linear_gelu(const at::Tensor& x, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias,
                                               std::string_view approximate, bool save_preact);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_gelu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                    const at::Tensor& weight,
                                                                    const at::Tensor& preact,
                                                                    std::string_view approximate,
                                                                    std::array<bool, 3> output_mask);
std::tuple<at::Tensor, at::Tensor> linear_swiglu(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias, bool save_preact);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                      const at::Tensor& weight,
                                                                      const at::Tensor& preact,
                                                                      std::array<bool, 3> output_mask);
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_y, const at::Tensor& preact,
                                                   bool need_dbias);
at::Tensor linear_weight_grad(const at::Tensor& grad_out, const at::Tensor& x);
at::Tensor linear_input_grad(const at::Tensor& grad_out, const at::Tensor& weight);
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor transpose_2d(const at::Tensor& x);
// gelu(z), no bias, no pre-activation written (linear_gelu's fallback after its addmm).
at::Tensor gelu_only(const at::Tensor& z, std::string_view approximate);
// How many linear_gelu calls took the cuBLASLt epilogue path in this process (for tests).
int64_t lt_matmul_calls();
// linear_gelu's CUDA forward: "kernel" (default) or "cublaslt" (Note [linear_gelu's CUDA forward
// path], csrc/cuda/linear_gelu.cpp); returns the previous setting.
std::string set_cuda_gelu_path(std::string_view path);
}  // namespace cuda

}  // namespace parallel_layers
