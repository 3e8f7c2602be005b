// The CUDA kernels' launchers: the only interface between the ops (csrc/cuda/<family>.cpp,
// compiled by the host compiler against torch's headers) and the kernels
// (csrc/cuda/<family>_kernels.cu, compiled by nvcc against this header and the shared math
// headers only).
//
// Note [kernels apart from torch's headers]: nvcc parses a translation unit once for the host
// and once per GPU arch, so a .cu that includes ATen/ATen.h spends ~25 s (of ~28 s) of every
// build on torch's headers, three times over for 8.0;9.0+PTX - minutes per file on a 2-core CI
// machine. The kernels need none of it: they take raw pointers, sizes and a stream, with
// c10::Half / c10::BFloat16 (light, device-ready headers) as the 16-bit element types. The
// ops keep everything torch: argument checks, allocation, the device guard, the dtype switch,
// the current stream. Each launcher is a template explicitly instantiated in its .cu for the
// dtypes the ops dispatch to; it checks its launch (C10_CUDA_KERNEL_LAUNCH_CHECK, which throws
// c10::Error) before returning. Launch configurations are the kernels' business and live with
// them; `sms` is the device's multiprocessor count, which the ops read from ATen's cache.
#pragma once

#include <cstdint>

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime_api.h>

#include "parallel_layers/gelu.h"
#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cuda {

// Element-wise math type: float for 16-bit and float32 elements, double for float64.
template <typename T>
using opmath_t = at::opmath_type<T>;

// M(T) for each element type the ops dispatch to (AT_DISPATCH_FLOATING_TYPES_AND2(Half,
// BFloat16)): the .cu files instantiate their launchers with it.
#define PL_FOR_EACH_FLOAT_TYPE(M) M(float) M(double) M(c10::Half) M(c10::BFloat16)

// bias_gelu (csrc/cuda/bias_gelu_kernels.cu). x, y, z: numel elements in rows of n; bias [n]
// or null (GeLU only; z may be null too). Backward: dz = dy * gelu'(z), and each chunk of rows'
// column sums of the rounded dz into partials[chunk, n].
template <typename T>
void launch_bias_gelu_forward(const T* x, const T* bias, T* y, T* z, int64_t numel, int64_t n, GeluApprox approx,
                              int sms, cudaStream_t stream);
template <typename T>
void launch_bias_gelu_backward(const T* dy, const T* z, T* dz, opmath_t<T>* partials, RowChunks chunks, int64_t n,
                               GeluApprox approx, cudaStream_t stream);

// SwiGLU (csrc/cuda/linear_swiglu_kernels.cu) over the packed pre-activation z [rows, 2n]
// (parallel_layers/swiglu.h): y [rows, n] = silu(gate) * up; backward dz [rows, 2n] =
// d_gate | d_up and each chunk's column sums into partials[chunk, 2n] (null: no sums).
template <typename T>
void launch_swiglu_forward(const T* z, T* y, int64_t rows, int64_t n, int sms, cudaStream_t stream);
template <typename T>
void launch_swiglu_backward(const T* dy, const T* z, T* dz, opmath_t<T>* partials, RowChunks chunks, int64_t n,
                            cudaStream_t stream);

// RMSNorm (csrc/cuda/rms_norm_kernels.cu), math of parallel_layers/rms_norm.h. S: x's type; W:
// the weight's and output's (S, or float for a 16-bit x); M = opmath_t<S>. Rows of n; res and
// sum null for plain rms_norm, else sum = x + res is written and normalized; dsum may be null.
template <typename S, typename W>
void launch_rms_norm_forward(const S* x, const S* res, S* sum, const W* w, W* y, opmath_t<S>* rstd, int64_t rows,
                             int64_t n, opmath_t<S> eps, cudaStream_t stream);
// Rows up to this wide go through the backward kernel that keeps a thread's columns in registers
// (Note [rms_norm backward in registers]); the op picks its row chunks by it.
inline constexpr int64_t kRmsNormRegisterWidth = 2048;
template <typename S, typename W>
void launch_rms_norm_backward(const W* dy, const S* x, const W* w, const opmath_t<S>* rstd, const S* dsum, S* dx,
                              opmath_t<S>* partials, RowChunks chunks, int64_t n, cudaStream_t stream);

// Shard copies (csrc/cuda/shard_copy_kernels.cu), layout of parallel_layers/shard_layout.h.
//
// Note [shard tables by value]: a launch's per-tensor table - data pointers, numels, shard sizes,
// slot offsets - travels in the kernel's parameters, as multi_tensor_apply's does: up to kMax
// tensors, one contiguous range of the slot. A call with more tensors launches once per group
// of kMax. (The first version uploaded the table per call - a pinned host tensor and an async
// copy - which made the smallest of the four copies, reduce-scatter copy-out, 0.84x the speed
// of torch's _foreach op on an H200.) 64 tensors are 2 KB of the 4 KB a kernel's parameters may
// take on every supported driver; a decoder layer has about ten.
struct ShardGroup {
  static constexpr int kMax = 64;
  int64_t ptr[kMax];     // data pointers
  int64_t numel[kMax];   // n_i (for shards given as shards: s_i)
  int64_t shard[kMax];   // s_i
  int64_t offset[kMax];  // o_i - base: slot offsets within the group
  int64_t count;         // tensors in the group, <= kMax
  int64_t base;          // slot offset of the group's first tensor
  int64_t size;          // slot positions the group covers, > 0
  int64_t total;         // S, the whole slot: the row length of the [W, S] buffers
};
template <typename Src, typename Dst>
void launch_all_gather_copy_in(const ShardGroup& g, Dst* row, int sms, cudaStream_t stream);
template <typename Src, typename Dst>
void launch_all_gather_copy_out(const ShardGroup& g, const Src* gathered, int64_t world, int sms, cudaStream_t stream);
template <typename Src, typename Dst>
void launch_reduce_scatter_copy_in(const ShardGroup& g, Dst* buf, int64_t world, double pre_scale, int sms,
                                   cudaStream_t stream);
template <typename Src, typename Dst>
void launch_reduce_scatter_copy_out(const ShardGroup& g, const Src* reduced, double post_scale, bool accumulate,
                                    int sms, cudaStream_t stream);

}  // namespace parallel_layers::cuda
