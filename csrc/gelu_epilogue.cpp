// CPU GeLU epilogue (see parallel_layers/cpu/gelu_epilogue.h).
//
// The float32 and bfloat16 inner loops are compiled several times for different x86
// instruction sets (target_clones: AVX-512, AVX2, baseline) and picked at load time, so one
// binary is fast on this machine and still runs on any x86-64. Math is float32 throughout;
// 16-bit rows are widened into float32 row buffers and narrowed once at the end; float64
// runs the scalar templates.
#include "parallel_layers/cpu/gelu_epilogue.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

namespace parallel_layers::cpu {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PL_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PL_SIMD_CLONES
#endif

// The loops are always-inline templates called from the target_clones entry points below,
// so each clone compiles (and vectorises) them for its own instruction set; a lambda would
// be a separate function left at the baseline target.
#if defined(__GNUC__)
#define PL_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PL_ALWAYS_INLINE inline
#endif

// y = gelu(x + b); z = x + b if z. b may be null; y may alias x.
template <GeluApprox kA>
PL_ALWAYS_INLINE void forward_loop(const float* x, const float* b, float* z, float* y, int64_t n) {
  if (b != nullptr && z != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float pre = x[i] + b[i];
      z[i] = pre;
      y[i] = gelu_forward<kA>(pre);
    }
  } else if (b != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = gelu_forward<kA>(x[i] + b[i]);
  } else if (z != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      z[i] = x[i];
      y[i] = gelu_forward<kA>(x[i]);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = gelu_forward<kA>(x[i]);
  }
}

// dz = dy * gelu'(z); acc += dz if acc.
template <GeluApprox kA>
PL_ALWAYS_INLINE void backward_loop(const float* dy, const float* z, float* dz, float* acc, int64_t n) {
  if (acc != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = dy[i] * gelu_derivative<kA>(z[i]);
      dz[i] = g;
      acc[i] += g;
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * gelu_derivative<kA>(z[i]);
  }
}

PL_SIMD_CLONES void forward_f32(const float* x, const float* b, float* z, float* y, int64_t n, GeluApprox a) {
  if (a == GeluApprox::kNone) {
    forward_loop<GeluApprox::kNone>(x, b, z, y, n);
  } else {
    forward_loop<GeluApprox::kTanh>(x, b, z, y, n);
  }
}

PL_SIMD_CLONES void backward_f32(const float* dy, const float* z, float* dz, float* acc, int64_t n,
                                 GeluApprox a) {
  if (a == GeluApprox::kNone) {
    backward_loop<GeluApprox::kNone>(dy, z, dz, acc, n);
  } else {
    backward_loop<GeluApprox::kTanh>(dy, z, dz, acc, n);
  }
}

// bfloat16 <-> float32 on raw bits, in loops the compiler vectorises (c10::BFloat16's scalar
// conversions are not). Narrowing rounds to nearest even and maps NaN to the canonical quiet
// NaN: the same bits as c10::BFloat16(float).
PL_SIMD_CLONES void widen_bf16(const uint16_t* in, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof(float));
  }
}

PL_SIMD_CLONES void narrow_bf16(const float* in, uint16_t* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    out[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
}

// 16-bit rows go through float32 row buffers: widen, run the float32 loop, narrow once.
template <typename scalar_t>
void widen(const scalar_t* in, float* out, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    widen_bf16(reinterpret_cast<const uint16_t*>(in), out, n);
  } else {
    std::copy(in, in + n, out);
  }
}

template <typename scalar_t>
void narrow(const float* in, scalar_t* out, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    narrow_bf16(in, reinterpret_cast<uint16_t*>(out), n);
  } else {
    std::copy(in, in + n, out);
  }
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<T>() : nullptr;
}

void check_block(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 2 && t.sizes() == like.sizes() && (t.size(1) <= 1 || t.stride(1) == 1),
              "gelu epilogue: ", name, " must be a [rows, cols] block with contiguous rows like ", like.sizes(),
              ", got sizes ", t.sizes(), " strides ", t.strides());
}

// Row r of a 2-D block.
template <typename T>
T* row(const at::Tensor& t, int64_t r) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<T>() + r * t.stride(0) : nullptr;
}

}  // namespace

void gelu_epilogue(const at::Tensor& in, const std::optional<at::Tensor>& bias, const at::Tensor& z,
                   const at::Tensor& y, GeluApprox approx) {
  check_block(in, "in", in);
  check_block(y, "y", in);
  if (z.defined()) check_block(z, "z", in);
  const int64_t rows = in.size(0), cols = in.size(1);
  if (rows == 0 || cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "gelu_epilogue", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      const double* b = bias ? bias->data_ptr<double>() : nullptr;
      dispatch_gelu_approx(approx, [&](auto a) {
        for (int64_t r = 0; r < rows; ++r) {
          const double* x = row<double>(in, r);
          double* zr = row<double>(z, r);
          double* yr = row<double>(y, r);
          for (int64_t c = 0; c < cols; ++c) {
            const double pre = x[c] + (b ? b[c] : 0.0);
            if (zr) zr[c] = pre;
            yr[c] = gelu_forward<decltype(a)::value>(pre);
          }
        }
      });
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      const float* b = bias ? bias->data_ptr<float>() : nullptr;
      for (int64_t r = 0; r < rows; ++r) {
        forward_f32(row<float>(in, r), b, row<float>(z, r), row<float>(y, r), cols, approx);
      }
    } else {
      std::vector<float> b32(bias ? cols : 0), x32(cols), z32(z.defined() ? cols : 0), y32(cols);
      if (bias) widen(bias->data_ptr<scalar_t>(), b32.data(), cols);
      for (int64_t r = 0; r < rows; ++r) {
        widen(row<scalar_t>(in, r), x32.data(), cols);
        forward_f32(x32.data(), bias ? b32.data() : nullptr, z.defined() ? z32.data() : nullptr, y32.data(),
                    cols, approx);
        narrow(y32.data(), row<scalar_t>(y, r), cols);
        if (z.defined()) narrow(z32.data(), row<scalar_t>(z, r), cols);
      }
    }
  });
}

void dgelu_epilogue(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& dz,
                    const at::Tensor& partial, GeluApprox approx) {
  check_block(dy, "dy", z);
  check_block(dz, "dz", z);
  const int64_t rows = z.size(0), cols = z.size(1);
  if (rows == 0 || cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "dgelu_epilogue", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      double* acc = ptr_or_null<double>(partial);
      dispatch_gelu_approx(approx, [&](auto a) {
        for (int64_t r = 0; r < rows; ++r) {
          const double* g = row<double>(dy, r);
          const double* zr = row<double>(z, r);
          double* out = row<double>(dz, r);
          for (int64_t c = 0; c < cols; ++c) {
            out[c] = g[c] * gelu_derivative<decltype(a)::value>(zr[c]);
            if (acc) acc[c] += out[c];
          }
        }
      });
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      float* acc = ptr_or_null<float>(partial);
      for (int64_t r = 0; r < rows; ++r) {
        backward_f32(row<float>(dy, r), row<float>(z, r), row<float>(dz, r), acc, cols, approx);
      }
    } else {
      // The bias gradient sums the gradient as returned (rounded), like eager autograd.
      float* acc = ptr_or_null<float>(partial);
      std::vector<float> dy32(cols), z32(cols), dz32(cols);
      for (int64_t r = 0; r < rows; ++r) {
        widen(row<scalar_t>(dy, r), dy32.data(), cols);
        widen(row<scalar_t>(z, r), z32.data(), cols);
        backward_f32(dy32.data(), z32.data(), dz32.data(), nullptr, cols, approx);
        scalar_t* out = row<scalar_t>(dz, r);
        narrow(dz32.data(), out, cols);
        if (acc) {
          widen(out, dz32.data(), cols);
          for (int64_t c = 0; c < cols; ++c) acc[c] += dz32[c];
        }
      }
    }
  });
}

}  // namespace parallel_layers::cpu
