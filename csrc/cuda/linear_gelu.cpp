// Fused GEMM + bias + GeLU on CUDA.
//
// Shapes: x [M, K] (leading dims flattened), weight [N, K], bias [N], y and z [M, N].
//
// Note [linear_gelu's CUDA forward path]: by default ATen's addmm (cuBLASLt with its bias
// epilogue, bias inside the GEMM) and then our GeLU kernel over its output
// (csrc/cuda/bias_gelu_kernels.cu, 16-byte vector accesses), so y = gelu(round(z)) in the order
// eager and the CPU op round it. The alternative, one cuBLASLt matmul with the
// GELU(_AUX)(_BIAS) epilogue, which adds the bias, writes the pre-activation ("aux", only when it
// is kept) and applies GeLU inside the GEMM, is opt-in (_C._set_cuda_gelu_path("cublaslt") or
// PARALLEL_LAYERS_CUDA_GELU=cublaslt), because on an H200 (cuBLAS 13, torch 2.11) it measured
// slower than the GEMM followed by a separate GeLU pass at every benchmarked shape: forward 0.66-0.78x
// of eager's speed in bfloat16 and 0.87-0.96x in float32 (benchmarks/bench_linear_gelu.py, 2048-4096 rows,
// K and N 1024-4096), and in float32 its GeLU was 7x further from a float64 reference than eager's
// (5.1e-6 vs 7.4e-7). (The default path was not faster than eager there either, 0.78-0.96x: our
// GeLU kernel took 15.2 us where PyTorch's took 9.8, and these calls were host-bound;
// benchmarks/results/2026-11-26-h200.md.) The epilogue is taken only for float16 / bfloat16, where it applies its tanh GeLU to
// the float32 accumulator plus bias rather than to the pre-activation rounded to 16 bits (y can
// then differ from gelu(round(z)) in the last bit; tests hold it to twice eager's error).
// cuBLASLt's GeLU is the tanh approximation and its aux buffer needs a leading dimension that is
// a multiple of 8, so the epilogue also needs approximate == "tanh", N % 8 == 0, K % 8 == 0,
// K > 0, 16-byte aligned pointers and an algorithm from cuBLASLt's heuristic; anything else
// (exact-erf GeLU, float32/float64, odd shapes - including the out_features == 1 case reported
// to fault inside cuBLASLt elsewhere) takes the default path. Every cuBLASLt status is checked;
// a heuristic that finds nothing, or a matmul that reports the configuration unsupported, falls
// back; any other failure throws.
//
// Note [cuBLASLt under torch.backends.cuda.matmul]: the epilogue path follows the settings that
// ATen's own cuBLASLt calls follow, so that the op rounds as F.linear would under them:
// - float16 / bfloat16 with allow_{fp16,bf16}_reduced_precision_reduction = False (or its
//   split-K flag off): the REDUCTION_SCHEME_MASK preference leaves out split-K reductions in the
//   output type (or all split-K). cuBLASLt's default allows every scheme, which is PyTorch's
//   default setting too.
// - float16 with allow_fp16_accumulation (full float16 accumulation, which it does not
//   express): the default path, whose addmm honours it.
// (float32, which would need the TF32 setting, does not take the epilogue.)
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/library.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/ops.h"

namespace parallel_layers::cuda {
namespace {

#define PL_CUBLASLT_CHECK(expr)                                                                   \
  do {                                                                                            \
    const cublasStatus_t pl_status = (expr);                                                      \
    TORCH_CHECK(pl_status == CUBLAS_STATUS_SUCCESS, "parallel_layers::linear_gelu: ", #expr,      \
                " failed: ", cublasLtGetStatusString(pl_status), " (", static_cast<int>(pl_status), ")"); \
  } while (0)

// Owners of cuBLASLt descriptors, destroyed on every exit path; not copyable (a copy would
// destroy the descriptor twice).
struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  MatmulDesc(cublasComputeType_t compute, cudaDataType_t scale) {
    PL_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc, compute, scale));
  }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
  ~MatmulDesc() { if (desc) cublasLtMatmulDescDestroy(desc); }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    PL_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
  }
};

struct Layout {
  cublasLtMatrixLayout_t desc = nullptr;
  Layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    PL_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc, type, rows, cols, ld));
  }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
  ~Layout() { if (desc) cublasLtMatrixLayoutDestroy(desc); }
};

struct Preference {
  cublasLtMatmulPreference_t desc = nullptr;
  Preference() { PL_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&desc)); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  ~Preference() { if (desc) cublasLtMatmulPreferenceDestroy(desc); }
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    PL_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(desc, attr, &value, sizeof(value)));
  }
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The largest power of two up to 256 that divides the address. cuBLASLt's heuristic assumes
// 256-byte aligned operands unless told otherwise (the MIN_ALIGNMENT preferences default to
// 256), and may then pick a kernel that fails or faults on a 16-byte aligned view such as
// x[r0:r1] of a larger buffer; PyTorch hit this (pytorch/pytorch#92201) and passes the
// real alignment, as we do.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

std::atomic<int64_t> g_lt_matmul_calls{0};

// Note [linear_gelu's CUDA forward path]: true = the cuBLASLt epilogue where it applies.
bool parse_gelu_path(std::string_view path, std::string_view source) {
  TORCH_CHECK(path == "kernel" || path == "cublaslt", "parallel_layers: ", source, " must be 'kernel' (ATen's GEMM, "
              "then our GeLU kernel) or 'cublaslt' (cuBLASLt's GELU epilogue where it applies); got '", path, "'");
  return path == "cublaslt";
}

std::atomic<bool>& lt_epilogue_on() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("PARALLEL_LAYERS_CUDA_GELU");
    return env != nullptr && parse_gelu_path(env, "PARALLEL_LAYERS_CUDA_GELU");
  }()};
  return on;
}

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK(false, "parallel_layers::linear_gelu: no cuBLASLt type for ", t);
  }
}

// Which inputs the cuBLASLt epilogue can take (see the file comment), under which
// torch.backends.cuda.matmul settings (Note [cuBLASLt under torch.backends.cuda.matmul]).
bool lt_supported(const at::Tensor& x2, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  GeluApprox approx, int64_t K, int64_t N) {
  const auto t = x2.scalar_type();
  const at::Context& ctx = at::globalContext();
  const bool settings_expressed = !(t == at::kHalf && ctx.allowFP16AccumulationCuBLAS());
  return lt_epilogue_on().load(std::memory_order_relaxed) && approx == GeluApprox::kTanh &&
         (t == at::kHalf || t == at::kBFloat16) &&
         settings_expressed && K > 0 && N % 8 == 0 && K % 8 == 0 && aligned16(x2.const_data_ptr()) &&
         aligned16(w.const_data_ptr()) && (!bias || aligned16(bias->const_data_ptr()));
}

// The split-K reduction schemes cuBLASLt may pick for a 16-bit output, from ATen's
// allow_{fp16,bf16}_reduced_precision_reduction setting (Note [cuBLASLt under
// torch.backends.cuda.matmul]); float32 outputs reduce in float32 whatever the scheme.
uint32_t reduction_scheme_mask(at::ScalarType t) {
  if (t != at::kHalf && t != at::kBFloat16) return CUBLASLT_REDUCTION_SCHEME_MASK;
  const at::Context& ctx = at::globalContext();
  switch (t == at::kHalf ? ctx.allowFP16ReductionCuBLAS() : ctx.allowBF16ReductionCuBLAS()) {
    case at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK:
      return CUBLASLT_REDUCTION_SCHEME_MASK;
    case at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK:
      return CUBLASLT_REDUCTION_SCHEME_MASK & ~static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE);
    case at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK:
      return CUBLASLT_REDUCTION_SCHEME_NONE;
  }
  TORCH_CHECK(false, "parallel_layers::linear_gelu: unknown cuBLAS reduction option");
}

// y = gelu(x2 @ w^T + bias) (and z = the pre-activation if defined) with one cuBLASLt call.
// Returns false, having written nothing, if cuBLASLt offers no algorithm for this problem.
bool lt_linear_gelu(const at::Tensor& x2, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                    const at::Tensor& y, const at::Tensor& z, int64_t M, int64_t K, int64_t N) {
  const cudaDataType_t type = cuda_type(x2.scalar_type());
  MatmulDesc op(CUBLAS_COMPUTE_32F, CUDA_R_32F);  // 16-bit inputs only: float32 accumulation
  // Column-major view: D[N, M] = op(A)[N, K] * B[K, M], with A = weight read transposed.
  op.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  op.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  cublasLtEpilogue_t epilogue;
  if (z.defined()) {
    epilogue = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    op.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, z.data_ptr());
    op.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(N));
  } else {
    epilogue = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  }
  op.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (bias) op.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->const_data_ptr());

  Layout a(type, K, N, K), b(type, K, M, K), d(type, N, M, N);
  const uint64_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  Preference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
  pref.set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction_scheme_mask(x2.scalar_type()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(w.const_data_ptr()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(x2.const_data_ptr()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(y.const_data_ptr()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(y.const_data_ptr()));
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t heuristic_status = cublasLtMatmulAlgoGetHeuristic(
      handle, op.desc, a.desc, b.desc, d.desc, d.desc, pref.desc, 1, &heuristic, &found);
  // No algorithm for this problem: the caller falls back. Any other failure is a mistake in
  // our descriptors and throws.
  if (heuristic_status == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  PL_CUBLASLT_CHECK(heuristic_status);
  if (found == 0 || heuristic.state != CUBLAS_STATUS_SUCCESS) return false;

  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(handle, op.desc, &alpha, w.const_data_ptr(), a.desc, x2.const_data_ptr(), b.desc, &beta,
                     y.data_ptr(), d.desc, y.data_ptr(), d.desc, &heuristic.algo, at::cuda::getCUDABlasLtWorkspace(),
                     workspace_bytes, at::cuda::getCurrentCUDAStream());
  // A configuration the chosen kernel rejects after all: nothing was launched, fall back.
  // (INVALID_VALUE would be a mistake of ours in the descriptors: that one throws.)
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  PL_CUBLASLT_CHECK(status);
  g_lt_matmul_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_gelu(const at::Tensor& x, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias,
                                               std::string_view approximate, bool save_preact) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const GeluApprox approx = parse_gelu_approx(approximate);
  const auto [M, K, N] = check_linear_gelu_args(x, weight, bias, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  if (M == 0 || N == 0) {
    return {at::empty(out_shape, x.options()), at::empty(save_preact ? out_shape : std::vector<int64_t>{0}, x.options())};
  }
  const at::Tensor x2 = x.reshape({M, K}).contiguous();
  const at::Tensor w = weight.contiguous();
  const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;

  if (lt_supported(x2, w, b, approx, K, N)) {
    at::Tensor y = at::empty({M, N}, x.options());
    at::Tensor z = save_preact ? at::empty({M, N}, x.options()) : at::Tensor();
    if (lt_linear_gelu(x2, w, b, y, z, M, K, N)) {
      return {y.view(out_shape), save_preact ? z.view(out_shape) : at::empty({0}, x.options())};
    }
  }
  // The default path: ATen's GEMM with the bias folded in - addmm rounds acc + bias once to the
  // output dtype, as eager and the CPU op do (adding it afterwards rounded 16-bit
  // pre-activations twice) - then GeLU over it.
  const at::Tensor z = b ? at::addmm(*b, x2, w.t()) : at::mm(x2, w.t());
  const at::Tensor y = gelu_only(z, approximate);
  return {y.view(out_shape), save_preact ? z.view(out_shape) : at::empty({0}, x.options())};
}

int64_t lt_matmul_calls() { return g_lt_matmul_calls.load(std::memory_order_relaxed); }

std::string set_cuda_gelu_path(std::string_view path) {
  const bool on = parse_gelu_path(path, "the CUDA GeLU path");
  return lt_epilogue_on().exchange(on) ? "cublaslt" : "kernel";
}

// Backward: our fused dgelu + bias-gradient kernel (csrc/cuda/bias_gelu_kernels.cu), then the two
// GEMMs that are needed, the weight gradient's through the shared weight_grad (on CUDA it reads
// dz transposed in place: Note [weight-gradient operand layout], csrc/linear_gelu.cpp).
// cuBLASLt's DGELU_BGRAD epilogue fuses dgelu into the GEMM that produces grad_y - the
// next layer's input-gradient GEMM - so it does not apply inside this op, which is handed a
// ready grad_y.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_gelu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                    const at::Tensor& weight,
                                                                    const at::Tensor& preact,
                                                                    std::string_view approximate,
                                                                    std::array<bool, 3> output_mask) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  parse_gelu_approx(approximate);
  const auto [M, K, N] = check_linear_gelu_backward_args(grad_y, x, weight, preact, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [need_dx, need_dw, need_db] = output_mask;
  // Unasked gradients: distinct empty tensors (outputs must not alias).
  const auto empty = [&] { return at::empty({0}, x.options()); };
  if (!need_dx && !need_dw && !need_db) return {empty(), empty(), empty()};
  auto [dz, db] = bias_gelu_backward(grad_y.reshape({M, N}), preact.reshape({M, N}), approximate);
  at::Tensor dx = need_dx ? at::mm(dz, weight).view(x.sizes()) : empty();
  at::Tensor dw = need_dw ? weight_grad(dz, at::Tensor(), x.reshape({M, K})) : empty();
  return {dx, dw, need_db ? db : empty()};
}

at::Tensor linear_weight_grad(const at::Tensor& grad_out, const at::Tensor& x) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N] = check_linear_weight_grad_args(grad_out, x, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  return weight_grad(grad_out.reshape({M, N}), at::Tensor(), x.reshape({M, K}));
}

at::Tensor linear_input_grad(const at::Tensor& grad_out, const at::Tensor& weight) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N] = check_linear_input_grad_args(grad_out, weight, at::kCUDA);
  const c10::cuda::CUDAGuard guard(weight.device());
  std::vector<int64_t> shape(grad_out.sizes().begin(), grad_out.sizes().end());
  shape.back() = K;
  return at::mm(grad_out.reshape({M, N}), weight).view(shape);
}

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  check_linear_gelu_args(x, weight, bias, at::kCUDA, "linear_forward");
  const c10::cuda::CUDAGuard guard(x.device());
  return at::linear(x, weight, bias);  // cuBLASLt with its bias epilogue, as F.linear
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) {
  m.impl("linear_gelu", &parallel_layers::cuda::linear_gelu);
  m.impl("linear_gelu_backward", &parallel_layers::cuda::linear_gelu_backward);
  m.impl("linear_weight_grad", &parallel_layers::cuda::linear_weight_grad);
  m.impl("linear_input_grad", &parallel_layers::cuda::linear_input_grad);
  m.impl("linear_forward", &parallel_layers::cuda::linear_forward);
}
