// The per-row math of RMSNorm shared by the CPU loops (csrc/rms_norm.cpp) and the CUDA kernels
// (csrc/cuda/rms_norm_kernels.cu); the formulas and roundings are in parallel_layers/rms_norm.h.
// No torch headers here: the kernels compile without them (Note [kernels apart from torch's
// headers], parallel_layers/cuda/kernels.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "parallel_layers/macros.h"

namespace parallel_layers {

// 1 / sqrt(sum_sq / n + eps) in M with the Hugging Face module's roundings: the sum rounded to M,
// divided by n, eps added, then the reciprocal square root (on CPU ATen's float rsqrt is a
// correctly rounded 1 / sqrt; on CUDA torch.rsqrt is rsqrtf, used here too).
template <typename M, typename Acc>
PL_HOST_DEVICE M rms_rstd(Acc sum_sq, int64_t n, M eps) {
  const M var = static_cast<M>(sum_sq) / static_cast<M>(n);
#if defined(__CUDA_ARCH__)
  return ::rsqrt(var + eps);
#else
  return M(1) / std::sqrt(var + eps);
#endif
}

// dx of one element: rstd * (g - h~ * c), c = mean(g * h~) over the row; see the file comment.
template <typename M>
PL_HOST_DEVICE M rms_dx(M g, M h_unrounded, M rstd, M mean_gh) {
  return rstd * (g - h_unrounded * mean_gh);
}

}  // namespace parallel_layers
