// CPU GeLU epilogue (see parallel_layers/cpu/gelu_epilogue.h).
//
// The float32 and bfloat16 inner loops are compiled several times for different x86
// instruction sets (target_clones: AVX-512, AVX2, baseline) and picked at load time, so one
// binary is fast on this machine and still runs on any x86-64. Math is float32 throughout;
// 16-bit rows are widened into float32 row buffers and narrowed once at the end; float64
// runs the scalar templates.
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

#include "parallel_layers/row_chunks.h"

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
    // float32 row buffers for 16-bit rows (widen, compute, narrow once).
    constexpr bool kNarrow = !std::is_same_v<scalar_t, double> && !std::is_same_v<scalar_t, float>;
    std::vector<float> dy32(kNarrow ? cols : 0), z32(kNarrow ? cols : 0), dz32(kNarrow ? cols : 0);
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
      } else {
        widen(g, dy32.data(), cols);
        widen(zr, z32.data(), cols);
        backward_f32(dy32.data(), z32.data(), dz32.data(), nullptr, cols, approx);
        narrow(dz32.data(), out, cols);
        if (acc) {
          widen(out, dz32.data(), cols);
          for (int64_t c = 0; c < cols; ++c) acc[c] += dz32[c];
        }
      }
    };
    // With dz_t, rows go into a tile of kTileRows rows first; the tile is then written
    // transposed, each column of it as kTileRows consecutive elements of a dz_t row (whole
    // cache lines for 16-bit types) while the tile is still in L2.
    constexpr int64_t kTileRows = 32;
    std::vector<scalar_t> tile(dz_t.defined() ? kTileRows * cols : 0);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int64_t r1 = std::min(rows, r0 + kTileRows);
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* out = dz_t.defined() ? tile.data() + (r - r0) * cols : row<scalar_t>(dz, r);
        dgelu_row(row<scalar_t>(dy, r), row<scalar_t>(z, r), out);
        if (dz_t.defined() && dz.defined()) std::copy(out, out + cols, row<scalar_t>(dz, r));
      }
      if (dz_t.defined()) {
        scalar_t* dst = dz_t.data_ptr<scalar_t>() + r0;
        const int64_t ld = dz_t.stride(0);
        for (int64_t c = 0; c < cols; ++c) {
          for (int64_t t = 0; t < r1 - r0; ++t) dst[c * ld + t] = tile[t * cols + c];
        }
      }
    }
  });
}

at::Tensor dgelu_parallel(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& dz, const at::Tensor& dz_t,
                          bool want_dbias, GeluApprox approx) {
  const int64_t rows = z.size(0), cols = z.size(1);
  // Chunks of ~64K elements at least: enough work to amortise scheduling, small enough for L2.
  const int64_t min_rows = std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1));
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/4 * at::get_num_threads(), min_rows);
  const at::Tensor partials =
      want_dbias ? at::zeros({chunks.num_chunks(), cols}, z.options().dtype(at::toOpMathType(z.scalar_type())))
                 : at::Tensor();
  at::parallel_for(0, chunks.num_chunks(), 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t r0 = chunks.begin(c), r1 = chunks.end(c);
      dgelu_epilogue(dy.slice(0, r0, r1), z.slice(0, r0, r1), dz.defined() ? dz.slice(0, r0, r1) : at::Tensor(),
                     dz_t.defined() ? dz_t.slice(1, r0, r1) : at::Tensor(),
                     want_dbias ? partials[c] : at::Tensor(), approx);
    }
  });
  return want_dbias ? partials.sum(0).to(z.scalar_type()) : at::Tensor();
}

}  // namespace parallel_layers::cpu
