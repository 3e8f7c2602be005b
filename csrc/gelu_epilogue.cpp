// CPU GeLU epilogue (see parallel_layers/cpu/gelu_epilogue.h).
//
// The float32 and bfloat16 inner loops are compiled for several x86 instruction sets and
// picked at load time (parallel_layers/cpu/simd.h), so one binary is fast on this machine and
// still runs on any x86-64. Math is float32 throughout; bfloat16 is converted inside the same
// loop as the math, float16 goes through float32 row buffers, float64 runs the scalar templates.
#include "parallel_layers/cpu/gelu_epilogue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "parallel_layers/cpu/linear_panels.h"
#include "parallel_layers/cpu/simd.h"
#include "parallel_layers/cpu/transpose.h"
#include "parallel_layers/row_chunks.h"

namespace parallel_layers::cpu {
namespace {

// y = gelu(x + b); z = x + b if z. b may be null; y may alias x. S: float, or uint16_t for
// bfloat16 (math in float32; z and y each rounded once from the float32 values).
template <GeluApprox kA, typename S>
PL_ALWAYS_INLINE void forward_loop(const S* x, const S* b, S* z, S* y, int64_t n) {
  if (b != nullptr && z != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float pre = widen(x[i]) + widen(b[i]);
      z[i] = narrow<S>(pre);
      y[i] = narrow<S>(gelu_forward<kA>(pre));
    }
  } else if (b != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = narrow<S>(gelu_forward<kA>(widen(x[i]) + widen(b[i])));
  } else if (z != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const S v = x[i];
      z[i] = v;
      y[i] = narrow<S>(gelu_forward<kA>(widen(v)));
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = narrow<S>(gelu_forward<kA>(widen(x[i])));
  }
}

// dz = dy * gelu'(z); acc += dz (as rounded to S, the value eager's bias gradient sums) if acc.
template <GeluApprox kA, typename S>
PL_ALWAYS_INLINE void backward_loop(const S* dy, const S* z, S* dz, float* acc, int64_t n) {
  if (acc != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const S g = narrow<S>(widen(dy[i]) * gelu_derivative<kA>(widen(z[i])));
      dz[i] = g;
      acc[i] += widen(g);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dz[i] = narrow<S>(widen(dy[i]) * gelu_derivative<kA>(widen(z[i])));
  }
}

template <typename S>
PL_ALWAYS_INLINE void forward_any(const S* x, const S* b, S* z, S* y, int64_t n, GeluApprox a) {
  if (a == GeluApprox::kNone) {
    forward_loop<GeluApprox::kNone>(x, b, z, y, n);
  } else {
    forward_loop<GeluApprox::kTanh>(x, b, z, y, n);
  }
}

template <typename S>
PL_ALWAYS_INLINE void backward_any(const S* dy, const S* z, S* dz, float* acc, int64_t n, GeluApprox a) {
  if (a == GeluApprox::kNone) {
    backward_loop<GeluApprox::kNone>(dy, z, dz, acc, n);
  } else {
    backward_loop<GeluApprox::kTanh>(dy, z, dz, acc, n);
  }
}

PL_SIMD_CLONES void forward_f32(const float* x, const float* b, float* z, float* y, int64_t n, GeluApprox a) {
  forward_any(x, b, z, y, n, a);
}
PL_SIMD_CLONES void forward_bf16(const uint16_t* x, const uint16_t* b, uint16_t* z, uint16_t* y, int64_t n,
                                 GeluApprox a) {
  forward_any(x, b, z, y, n, a);
}
PL_SIMD_CLONES void backward_f32(const float* dy, const float* z, float* dz, float* acc, int64_t n,
                                 GeluApprox a) {
  backward_any(dy, z, dz, acc, n, a);
}
PL_SIMD_CLONES void backward_bf16(const uint16_t* dy, const uint16_t* z, uint16_t* dz, float* acc, int64_t n,
                                  GeluApprox a) {
  backward_any(dy, z, dz, acc, n, a);
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

// y = gelu(in + bias) (and z) over one block, for one dtype: a template, so that if constexpr
// discards the other dtypes' branches.
template <typename scalar_t>
void forward_block(const at::Tensor& in, const std::optional<at::Tensor>& bias, const at::Tensor& z,
                   const at::Tensor& y, GeluApprox approx) {
  const int64_t rows = in.size(0), cols = in.size(1);
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
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {  // through float32 row buffers
    std::vector<float> b32(bias ? cols : 0), x32(cols), z32(z.defined() ? cols : 0), y32(cols);
    if (bias) widen_row(bias->data_ptr<scalar_t>(), b32.data(), cols);
    for (int64_t r = 0; r < rows; ++r) {
      widen_row(row<scalar_t>(in, r), x32.data(), cols);
      forward_f32(x32.data(), bias ? b32.data() : nullptr, z.defined() ? z32.data() : nullptr, y32.data(),
                  cols, approx);
      narrow_row(y32.data(), row<scalar_t>(y, r), cols);
      if (z.defined()) narrow_row(z32.data(), row<scalar_t>(z, r), cols);
    }
  } else {  // float32, bfloat16: converted inside the SIMD loop
    const auto* b = bias ? simd_ptr(bias->const_data_ptr<scalar_t>()) : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const auto* x = simd_ptr(static_cast<const scalar_t*>(row<scalar_t>(in, r)));
      auto* zr = simd_ptr(row<scalar_t>(z, r));
      auto* yr = simd_ptr(row<scalar_t>(y, r));
      if constexpr (std::is_same_v<scalar_t, float>) {
        forward_f32(x, b, zr, yr, cols, approx);
      } else {
        forward_bf16(x, b, zr, yr, cols, approx);
      }
    }
  }
}

}  // namespace

void gelu_epilogue(const at::Tensor& in, const std::optional<at::Tensor>& bias, const at::Tensor& z,
                   const at::Tensor& y, GeluApprox approx) {
  check_block(in, "in", in);
  check_block(y, "y", in);
  if (z.defined()) check_block(z, "z", in);
  const int64_t rows = in.size(0), cols = in.size(1);
  if (rows == 0 || cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "gelu_epilogue",
                                  [&] { forward_block<scalar_t>(in, bias, z, y, approx); });
}

void dgelu_epilogue(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& dz, const at::Tensor& dz_t,
                    const at::Tensor& partial, GeluApprox approx) {
  check_block(dy, "dy", z);
  TORCH_CHECK(dz.defined() || dz_t.defined(), "dgelu epilogue: neither dz nor dz_t to write");
  if (dz.defined()) check_block(dz, "dz", z);
  if (dz_t.defined()) check_block(dz_t, "dz_t", z.t());
  const int64_t rows = z.size(0), cols = z.size(1);
  if (rows == 0 || cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "dgelu_epilogue", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    acc_t* acc = ptr_or_null<acc_t>(partial);
    // float32 row buffers for float16 rows (widen, compute, narrow once).
    constexpr bool kBuffered = std::is_same_v<scalar_t, at::Half>;
    std::vector<float> dy32(kBuffered ? cols : 0), z32(kBuffered ? cols : 0), dz32(kBuffered ? cols : 0);
    // out = dy * gelu'(z) for one row; the bias gradient sums the rounded values, as eager does.
    auto dgelu_row = [&](const auto* g, const auto* zr, auto* out) {  // generic: if constexpr prunes
      if constexpr (std::is_same_v<scalar_t, double>) {
        dispatch_gelu_approx(approx, [&](auto a) {
          for (int64_t c = 0; c < cols; ++c) {
            out[c] = g[c] * gelu_derivative<decltype(a)::value>(zr[c]);
            if (acc) acc[c] += out[c];
          }
        });
      } else if constexpr (std::is_same_v<scalar_t, float>) {
        backward_f32(g, zr, out, acc, cols, approx);
      } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        backward_bf16(simd_ptr(g), simd_ptr(zr), simd_ptr(out), acc, cols, approx);
      } else {
        widen_row(g, dy32.data(), cols);
        widen_row(zr, z32.data(), cols);
        backward_f32(dy32.data(), z32.data(), dz32.data(), nullptr, cols, approx);
        narrow_row(dz32.data(), out, cols);
        if (acc) {
          widen_row(out, dz32.data(), cols);
          for (int64_t c = 0; c < cols; ++c) acc[c] += dz32[c];
        }
      }
    };
    // With dz_t, rows go into a tile of kTileRows rows first, which is then written
    // transposed (transpose_tile) while it is still in L1/L2: each dz_t row receives
    // kTileRows consecutive elements, a whole cache line for 16-bit types. The tile's rows are
    // one cache line longer than cols, so that for power-of-two cols they do not all map to
    // the same L1 set (the blocks read 8 tile rows at a time).
    constexpr int64_t kTileRows = 32;
    const int64_t tile_ld = cols + 64 / static_cast<int64_t>(sizeof(scalar_t));
    std::vector<scalar_t> tile(dz_t.defined() ? kTileRows * tile_ld : 0);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int64_t r1 = std::min(rows, r0 + kTileRows);
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* out = dz_t.defined() ? tile.data() + (r - r0) * tile_ld : row<scalar_t>(dz, r);
        dgelu_row(row<scalar_t>(dy, r), row<scalar_t>(z, r), out);
        if (dz_t.defined() && dz.defined()) std::copy(out, out + cols, row<scalar_t>(dz, r));
      }
      if (dz_t.defined()) {
        scalar_t* dst = dz_t.data_ptr<scalar_t>() + r0;
        const int64_t ld = dz_t.stride(0);
        transpose_tile(tile.data(), tile_ld, r1 - r0, cols, dst, ld);
      }
    }
  });
}

at::Tensor dgelu_parallel(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& dz, const at::Tensor& dz_t,
                          bool want_dbias, GeluApprox approx) {
  const int64_t rows = z.size(0), cols = z.size(1);
  // Chunks of ~64K elements at least: enough work to amortise scheduling, small enough for L2.
  const int64_t min_rows = std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1));
  // At most 256 chunks whatever the thread count: the chunking, and so dbias's summation order,
  // depends on the shape only (as rms_norm_backward's and the CUDA kernels' do).
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/256, min_rows);
  const at::Tensor partials =
      want_dbias ? bias_partials(chunks.num_chunks(), cols, z.options().dtype(at::toOpMathType(z.scalar_type())))
                 : at::Tensor();
  at::parallel_for(0, chunks.num_chunks(), 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t r0 = chunks.begin(c), r1 = chunks.end(c);
      dgelu_epilogue(row_range(dy, r0, r1), row_range(z, r0, r1), dz.defined() ? row_range(dz, r0, r1) : at::Tensor(),
                     dz_t.defined() ? dz_t.slice(1, r0, r1) : at::Tensor(),
                     !want_dbias ? at::Tensor() : partials.dim() == 1 ? partials : partials[c], approx);
    }
  });
  return want_dbias ? sum_bias_partials(partials, z.scalar_type()) : at::Tensor();
}

}  // namespace parallel_layers::cpu
