// The CPU GeLU epilogue: GeLU (and its derivative) over a [rows, cols] block that is already
// in cache, vectorised. Callers (bias_gelu, linear_gelu) split their work into such blocks and
// run one block per task inside at::parallel_for; these functions run on the calling thread.
//
// Blocks are 2-D tensors whose rows are contiguous (stride(1) == 1) with any row stride, so a
// tile of a larger matrix is passed as a view. Math is float32 (float64 for float64 tensors),
// with parallel_layers/gelu.h's formulas, the same the CUDA kernels use.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "parallel_layers/gelu.h"

namespace parallel_layers::cpu {

// y = gelu(in + bias), and z = in + bias when z is defined. bias: [cols] or nullopt.
// y may be the same tensor as in (in place).
void gelu_epilogue(const at::Tensor& in, const std::optional<at::Tensor>& bias, const at::Tensor& z,
                   const at::Tensor& y, GeluApprox approx);

// dz = dy * gelu'(z), and partial[c] += sum over rows of dz[:, c] when partial is defined
// (partial: [cols], float32 for 16-bit and float32 blocks, float64 for float64 blocks).
// dz_t, when defined, is a [cols, rows] block (e.g. a column range of a [cols, M] matrix)
// that receives dz transposed, written from a cache-resident tile of rows; dz itself may then
// be undefined. At least one of dz and dz_t is defined.
void dgelu_epilogue(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& dz, const at::Tensor& dz_t,
                    const at::Tensor& partial, GeluApprox approx);

// dgelu_epilogue over a whole [rows, cols] matrix, in parallel over chunks of rows
// (parallel_layers/row_chunks.h); each chunk sums its bias gradient into its own row of
// float partials, which are then added in chunk order, so dbias does not depend on the
// thread count. Returns dbias [cols] in z's dtype when want_dbias, else an undefined tensor.
at::Tensor dgelu_parallel(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& dz, const at::Tensor& dz_t,
                          bool want_dbias, GeluApprox approx);

}  // namespace parallel_layers::cpu
