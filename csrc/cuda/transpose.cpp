// transpose_2d on CUDA: ATen's transpose copy. Nothing on the GPU needs a faster one (cuBLAS
// reads transposed operands at full speed); the op exists here for one schema across backends.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "parallel_layers/ops.h"

namespace parallel_layers::cuda {

at::Tensor transpose_2d(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "transpose_2d: x must be 2-D, got shape ", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  return x.t().clone(at::MemoryFormat::Contiguous);  // a copy even where x.t() is contiguous
}

}  // namespace parallel_layers::cuda

TORCH_LIBRARY_IMPL(parallel_layers, CUDA, m) { m.impl("transpose_2d", &parallel_layers::cuda::transpose_2d); }
