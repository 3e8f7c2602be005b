// Fused linear + SwiGLU on CPU: y = silu(gate) * up from one packed GEMM,
// [gate | up] = x @ weight^T + bias, keeping that pre-activation for backward when asked to.
//
// Shapes: x [M, K] (leading dims flattened), weight [2N, K] (gate rows [0, N) on up rows
// [N, 2N)), bias [2N], pre-activation z [M, 2N] (gate | up in each row, parallel_layers/swiglu.h),
// y [M, N].
//
// Forward: as linear_gelu's (csrc/linear_gelu.cpp), the GEMM (ATen's BLAS, bias folded into
// addmm, all threads; in float32 gate and up as two GEMMs, Note [split forward GEMM]) writes row
// panels of z, and the SwiGLU epilogue runs over each panel in parallel while it is still in
// cache. Without a kept pre-activation the panel is scratch
// (Note [backward scratch on CPU]), so inference allocates only y - or, where oneDNN computes
// the dtype's GEMM, inference is two oneDNN GEMMs with fused epilogues (Note [SwiGLU inference
// through oneDNN post-ops]), or in float32 with enough rows SwiGLU blocks from oneDNN's brgemm
// microkernel (Note [float32 SwiGLU inference through brgemm]). Where float32 GEMMs go
// through oneDNN (Note [float32 GEMMs through oneDNN], csrc/gemm.cpp) the GEMM is one packed
// oneDNN call writing all of z, then the same epilogue. Backward: one pass over z and grad_y
// writes d_gate | d_up (the gradient of the packed pre-activation) and sums the bias gradient,
// then dx = dz @ weight (input_grad_gemm) and dweight through the shared weight_grad.
//
// Rounding (math in float32 for 16-bit and float32 tensors, float64 for float64): z is rounded
// to the dtype by the GEMM, as F.linear's output is; y = silu(g) * u is computed from those
// values and rounded once (eager rounds silu(g) to the dtype, then the product); d_gate and d_up
// are each rounded once from dy, g, u.
#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "parallel_layers/checks.h"
#include "parallel_layers/cpu/linear_panels.h"
#include "parallel_layers/cpu/simd.h"
#include "parallel_layers/cpu/transpose.h"
#include "parallel_layers/ops.h"
#include "parallel_layers/row_chunks.h"
#include "parallel_layers/swiglu.h"

namespace parallel_layers::cpu {
namespace {

// y = silu(g) * u over one row of n outputs. S: float, or uint16_t for bfloat16.
template <typename S>
PL_ALWAYS_INLINE void forward_loop(const S* g, const S* u, S* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = narrow<S>(swiglu_forward(widen(g[i]), widen(u[i])));
}

// d_gate, d_up of one row; acc_g / acc_u += them (as rounded to S, the values the bias gradient
// sums) when acc_g is not null.
template <typename S>
PL_ALWAYS_INLINE void backward_loop(const S* dy, const S* g, const S* u, S* dg, S* du, float* acc_g, float* acc_u,
                                    int64_t n) {
  if (acc_g != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const auto d = parallel_layers::swiglu_backward(widen(dy[i]), widen(g[i]), widen(u[i]));
      const S dg_r = narrow<S>(d.gate), du_r = narrow<S>(d.up);
      dg[i] = dg_r;
      du[i] = du_r;
      acc_g[i] += widen(dg_r);
      acc_u[i] += widen(du_r);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const auto d = parallel_layers::swiglu_backward(widen(dy[i]), widen(g[i]), widen(u[i]));
      dg[i] = narrow<S>(d.gate);
      du[i] = narrow<S>(d.up);
    }
  }
}

PL_SIMD_CLONES void forward_f32(const float* g, const float* u, float* y, int64_t n) { forward_loop(g, u, y, n); }
// y = silu(g + bg) * (u + bu): a GEMM accumulator's row plus the bias, as F.linear rounds it.
PL_SIMD_CLONES void forward_bias_f32(const float* g, const float* u, const float* bg, const float* bu, float* y,
                                     int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = swiglu_forward(g[i] + bg[i], u[i] + bu[i]);
}
PL_SIMD_CLONES void forward_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n) {
  forward_loop(g, u, y, n);
}
PL_SIMD_CLONES void backward_f32(const float* dy, const float* g, const float* u, float* dg, float* du, float* acc_g,
                                 float* acc_u, int64_t n) {
  backward_loop(dy, g, u, dg, du, acc_g, acc_u, n);
}
PL_SIMD_CLONES void backward_bf16(const uint16_t* dy, const uint16_t* g, const uint16_t* u, uint16_t* dg,
                                  uint16_t* du, float* acc_g, float* acc_u, int64_t n) {
  backward_loop(dy, g, u, dg, du, acc_g, acc_u, n);
}

// y[r] = swiglu of z[r] for rows [r0, r1): z [rows, 2n] and y [rows, n], contiguous.
template <typename scalar_t>
void swiglu_rows(const scalar_t* z, scalar_t* y, int64_t n, int64_t r0, int64_t r1) {
  const PackedGateUp pk{n};
  if constexpr (std::is_same_v<scalar_t, double>) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < n; ++c) y[pk.out(r, c)] = swiglu_forward(z[pk.gate(r, c)], z[pk.up(r, c)]);
    }
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {  // through float32 row buffers
    std::vector<float> g32(n), u32(n), y32(n);
    for (int64_t r = r0; r < r1; ++r) {
      widen_row(z + pk.gate(r, 0), g32.data(), n);
      widen_row(z + pk.up(r, 0), u32.data(), n);
      forward_f32(g32.data(), u32.data(), y32.data(), n);
      narrow_row(y32.data(), y + pk.out(r, 0), n);
    }
  } else {  // float32, bfloat16: converted inside the SIMD loop
    for (int64_t r = r0; r < r1; ++r) {
      const auto* g = simd_ptr(z + pk.gate(r, 0));
      const auto* u = simd_ptr(z + pk.up(r, 0));
      auto* yr = simd_ptr(y + pk.out(r, 0));
      if constexpr (std::is_same_v<scalar_t, float>) {
        forward_f32(g, u, yr, n);
      } else {
        forward_bf16(g, u, yr, n);
      }
    }
  }
}

// dz[r] = (d_gate | d_up) of row r for rows [r0, r1), and partial[c] += dz[r, c] over those rows
// when partial (float [2n], double for float64) is not null.
template <typename scalar_t, typename acc_t>
void dswiglu_rows(const scalar_t* dy, const scalar_t* z, scalar_t* dz, acc_t* partial, int64_t n, int64_t r0,
                  int64_t r1) {
  const PackedGateUp pk{n};
  acc_t* acc_g = partial;
  acc_t* acc_u = partial ? partial + n : nullptr;
  if constexpr (std::is_same_v<scalar_t, double>) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        const auto d = parallel_layers::swiglu_backward(dy[pk.out(r, c)], z[pk.gate(r, c)], z[pk.up(r, c)]);
        dz[pk.gate(r, c)] = d.gate;
        dz[pk.up(r, c)] = d.up;
        if (partial) {
          acc_g[c] += d.gate;
          acc_u[c] += d.up;
        }
      }
    }
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {  // float32 row buffers; sums of the rounded values
    std::vector<float> dy32(n), g32(n), u32(n), dg32(n), du32(n);
    for (int64_t r = r0; r < r1; ++r) {
      widen_row(dy + pk.out(r, 0), dy32.data(), n);
      widen_row(z + pk.gate(r, 0), g32.data(), n);
      widen_row(z + pk.up(r, 0), u32.data(), n);
      backward_f32(dy32.data(), g32.data(), u32.data(), dg32.data(), du32.data(), nullptr, nullptr, n);
      narrow_row(dg32.data(), dz + pk.gate(r, 0), n);
      narrow_row(du32.data(), dz + pk.up(r, 0), n);
      if (partial) {
        for (int64_t c = 0; c < 2 * n; ++c) partial[c] += static_cast<float>(dz[pk.gate(r, c)]);
      }
    }
  } else {
    for (int64_t r = r0; r < r1; ++r) {
      const auto* d = simd_ptr(dy + pk.out(r, 0));
      const auto* g = simd_ptr(z + pk.gate(r, 0));
      const auto* u = simd_ptr(z + pk.up(r, 0));
      auto* dg = simd_ptr(dz + pk.gate(r, 0));
      auto* du = simd_ptr(dz + pk.up(r, 0));
      if constexpr (std::is_same_v<scalar_t, float>) {
        backward_f32(d, g, u, dg, du, acc_g, acc_u, n);
      } else {
        backward_bf16(d, g, u, dg, du, acc_g, acc_u, n);
      }
    }
  }
}

// y = swiglu of z (z [rows, 2n], y [rows, n], both contiguous in their rows), in parallel tasks of rows.
void swiglu_parallel(const at::Tensor& z, const at::Tensor& y) {
  const int64_t n = y.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "linear_swiglu", [&] {
    const scalar_t* zp = z.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, z.size(0), rows_per_task(2 * n), [&](int64_t begin, int64_t end) {
      swiglu_rows(zp, yp, n, begin, end);
    });
  });
}

// dswiglu_rows over all rows, in parallel over chunks of rows (parallel_layers/row_chunks.h);
// each chunk sums its bias gradient into its own row of partials, added in chunk order, so
// dbias does not depend on the thread count. Returns dbias [2n] in z's dtype when want_dbias.
// With dz_t (a contiguous [2n, rows]: Note [weight-gradient operand layout],
// csrc/linear_gelu.cpp) a chunk also writes dz transposed, kTransposeRows rows at a time, right
// after computing them, so the block is read back from cache (32 rows of 2n in bfloat16: 172 KiB
// at n = 1376, within L2; 704 KiB at n = 5632, which with its z and dy rows spills to L3 on a
// 1 MiB L2), and each dz_t row receives 64 consecutive bytes per block. This is linear_gelu's
// dgelu pass's scheme; before it, weight_grad copied the finished dz with transpose_2d, a second
// pass over all of dz. Backward alone, bfloat16, on the 2-core Zen 4 EPYC: 1.01 / 1.02 / 1.045x
// faster at 512x512x1376 / 512x1024x2816 / 1024x2048x5632 (bench_linear_swiglu's "backward
// alone" times the split path). Unlike the dgelu pass, the block is not padded: where 2n * 2
// bytes is a multiple of 4 KiB (n a multiple of 1024) the 8 rows an 8 x 8 block reads share an
// L1 set. At 512x1024x4096, such a shape, the fused pass was still 1.06x faster than the copy.
at::Tensor dswiglu_parallel(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& dz, const at::Tensor& dz_t,
                            bool want_dbias) {
  constexpr int64_t kTransposeRows = 32;
  const int64_t rows = z.size(0), n = z.size(1) / 2;
  TORCH_INTERNAL_ASSERT(!dz_t.defined() || (dz_t.is_contiguous() && dz_t.size(0) == 2 * n && dz_t.size(1) == rows),
                        "dswiglu: dz_t must be a contiguous [2n, rows]");
  // Shape-only chunking (no thread count), so dbias's summation order is the same on any machine.
  const RowChunks chunks = make_row_chunks(rows, /*max_chunks=*/256, rows_per_task(2 * n));
  const auto acc_type = at::toOpMathType(z.scalar_type());
  const at::Tensor partials =
      want_dbias ? bias_partials(chunks.num_chunks(), 2 * n, z.options().dtype(acc_type)) : at::Tensor();
  if (rows > 0 && n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "dswiglu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
      const scalar_t* zp = z.const_data_ptr<scalar_t>();
      scalar_t* dzp = dz.mutable_data_ptr<scalar_t>();
      scalar_t* dztp = dz_t.defined() ? dz_t.mutable_data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, chunks.num_chunks(), 1, [&](int64_t chunk_begin, int64_t chunk_end) {
        for (int64_t c = chunk_begin; c < chunk_end; ++c) {
          acc_t* partial = want_dbias ? partials.mutable_data_ptr<acc_t>() + c * 2 * n : nullptr;
          const int64_t step = dztp ? kTransposeRows : chunks.end(c) - chunks.begin(c);
          for (int64_t r0 = chunks.begin(c); r0 < chunks.end(c); r0 += step) {
            const int64_t r1 = std::min(chunks.end(c), r0 + step);
            dswiglu_rows<scalar_t, acc_t>(dyp, zp, dzp, partial, n, r0, r1);
            if (dztp) transpose_tile(dzp + r0 * 2 * n, 2 * n, r1 - r0, 2 * n, dztp + r0, rows);
          }
        }
      });
    });
  }
  return want_dbias ? sum_bias_partials(partials, z.scalar_type()) : at::Tensor();
}

// Note [split forward GEMM]: the forward's [gate | up] = x @ W^T + b as one GEMM over the packed
// weight, or as two - gate columns, then up columns - each writing its half of the panel in
// place (the output's row stride 2N is BLAS's ldc, so nothing is copied). Each output element is
// the same K-long dot product either way. Which is faster depends on the BLAS: on this project's
// 2-core AVX-512 machine (MKL for float32, oneDNN for bfloat16; x [M, K], N gate columns; median
// of 25-30 interleaved calls, both threads) two float32 GEMMs took 0.98 / 0.97 / 0.99x and, in
// a second run, 0.92 / 0.95 / 0.99x the packed one's time at 512x512x1376 / 512x1024x2816 /
// 1024x2048x5632; two bfloat16 GEMMs 1.05 / 1.04 / 1.02x. So float32 and float64 (MKL both)
// split; 16-bit types keep one GEMM.
// The backward's GEMMs (dz @ W, dz^T @ x) split gained nothing (1.00-1.04x) and stay packed.
std::vector<std::pair<int64_t, int64_t>> forward_gemm_columns(at::ScalarType dtype, int64_t n) {
  if (dtype == at::kFloat || dtype == at::kDouble) return {{0, n}, {n, 2 * n}};
  return {{0, 2 * n}};
}

// Note [SwiGLU inference through oneDNN post-ops]: when no pre-activation is kept (inference)
// and oneDNN computes this dtype's GEMM - bfloat16 where ATen's oneDNN supports it, float32
// where Note [float32 GEMMs through oneDNN] picks oneDNN - the op is two oneDNN GEMMs with their
// epilogues fused, and no pass of ours: s = silu(x Wg^T + bg) (a swish post-op, on the float32
// accumulator), then y = (x Wu^T + bu) * s (a binary-mul post-op reading s). The gate and up
// weights are row slices of the packed weight, so nothing is copied. On this project's 2-core
// Zen 4 EPYC (both threads, medians of 20-30 calls, two or three runs; 512x512x1376 /
// 512x1024x2816 / 1024x2048x5632):
// - float32, against the bare packed oneDNN GEMM: 0.99-1.04 / 1.04 / 0.97-0.99x when first
//   measured (1.05-1.08 at the smallest shape in later benchmark runs); the packed GEMM with our
//   epilogue took 1.13-1.32 / 1.03 / 1.01-1.02x.
// - bfloat16: 3.58-4.19 / 15.2-15.9 ms; the packed GEMM with our epilogue 3.68-4.43 / 15.8-16.6,
//   eager 3.69-3.99 / 15.8-16.2.
// Rounding: in bfloat16 s is rounded once from the unrounded gate and y once from the unrounded
// up times s; the float64 error (max / mean) at 512x512x1376 was 0.099 / 0.0012 against our
// training path's 0.112 / 0.0015 and eager's 0.115 / 0.0017. In float32 both paths had the same
// error there (1.9e-5 / 2.6e-7). Training keeps the packed GEMM and our epilogue: backward needs z.
// Float32 inference of at least kBrgemmMinRows rows takes Note [float32 SwiGLU inference through
// brgemm] instead: sessions 15-16 measured this path at 1.05-1.08x the bare GEMM at 512x512x1376.
std::optional<at::Tensor> onednn_swiglu_inference(const at::Tensor& x2, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias) {
  // bfloat16 where ATen's oneDNN supports it, float32 under Note [float32 GEMMs through oneDNN].
  if (!onednn_forward_gemm(x2) || !has_onednn_linear_binary()) return std::nullopt;
  const int64_t n = weight.size(0) / 2;
  const at::Tensor xc = x2.contiguous(), w = weight.contiguous();
  const auto half = [&](int64_t i) { return bias ? std::optional(bias->slice(0, i * n, (i + 1) * n)) : std::nullopt; };
  const at::Tensor gate = onednn_linear(xc, w.slice(0, 0, n), half(0), "swish");
  return onednn_linear_binary(xc, gate, w.slice(0, n, 2 * n), half(1), "mul");
}

// Note [float32 SwiGLU inference through brgemm]: in float32 where the oneDNN GEMM rule holds
// (Note [float32 GEMMs through oneDNN], csrc/gemm.cpp), inference computes the SwiGLU from each
// block of the GEMM while it is still in L1, with oneDNN's batch-reduce GEMM microkernel
// (ATen's at::native::cpublas::brgemm; ATen's own GEMM where oneDNN's ukernel is missing):
// - A block is kBrgemmCols output columns: the matching gate rows and up rows of the weight,
//   transposed into this thread's scratch as two [K, kBrgemmCols] panels (transpose_tile),
//   once per block.
// - For every kBrgemmRows rows of x, the gate and up accumulators [rows, kBrgemmCols] come from
//   brgemm (K in steps of kBrgemmDepth, so that both panels' slices stay in L2 for large K),
//   and forward_bias_f32 turns them into y: silu(gate + bg) * (up + bu).
// - Work items are (column block, chunk of rows), about four per thread.
// The two post-op GEMMs this replaces (Note [SwiGLU inference through oneDNN post-ops]) pay for
// splitting the packed GEMM in two and for the swish and mul post-ops: 1.05-1.08x oneDNN's bare
// packed GEMM at 512x512x1376 in sessions 15-16. Measured on the 2-core Zen 4 EPYC, both threads,
// against that bare GEMM (probe medians of 20, K x 2N weights 512x2752 / 1024x5632 / 2048x11264
// / 4096x2752 with 512 / 512 / 1024 / 512 rows): this path 1.01-1.045 / 1.006 / 0.983 / 1.012,
// the post-op path 1.07 / 1.026 / 0.999 / -; 1.004 against 1.048 at 2048x512x1376. Packing
// costs a pass over the weight whatever M is, so with few rows the post-op path wins (16 rows:
// 1.26 against 1.20 at 512x2752, 1.22 against 1.05 at 1024x5632); they crossed at 192-256 rows
// on both weights, so this path takes M >= kBrgemmMinRows. y rounds
// once from the float32 accumulator plus bias, as the training path's epilogue does from z;
// the summation order over K is brgemm's, so the bits can differ from oneDNN's matmul in the
// last place (they matched at K = 512). Training keeps the packed oneDNN GEMM and our epilogue:
// writing z from here measured no faster.
// (ATen declares CPUBLAS_BRGEMM_F32F32F32 where it has the float32 brgemm: torch 2.13 and 2.14
// do; without it the post-op path serves every row count.)
constexpr int64_t kBrgemmCols = 64, kBrgemmRows = 128, kBrgemmDepth = 1024;
#if defined(CPUBLAS_BRGEMM_F32F32F32)
constexpr int64_t kBrgemmMinRows = 256;
#else
constexpr int64_t kBrgemmMinRows = std::numeric_limits<int64_t>::max();
#endif

at::Tensor brgemm_swiglu_inference(const at::Tensor& x2, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  const at::Tensor xc = x2.contiguous(), w = weight.contiguous();
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0) / 2;
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  const float* bp = bias ? b.const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  // Items are (column block, chunk of rows), column block major, about 4 per thread: rows are
  // split only when the column blocks are too few to share out evenly, since every thread that
  // takes a block packs its panels again. Chunks are whole kBrgemmRows blocks but the last.
  const auto ceil_div = [](int64_t a, int64_t d) { return (a + d - 1) / d; };
  const int64_t col_blocks = ceil_div(N, kBrgemmCols);
  RowChunks chunks = make_row_chunks(M, ceil_div(4 * at::get_num_threads(), col_blocks), kBrgemmRows);
  chunks.rows_per_chunk = ceil_div(chunks.rows_per_chunk, kBrgemmRows) * kBrgemmRows;
  const int64_t row_chunks = chunks.num_chunks();
  at::parallel_for(0, col_blocks * row_chunks, 1, [&](int64_t begin, int64_t end) {
    const Scratch panels(0, {2, K, kBrgemmCols}, xc.options()), acc(1, {2, kBrgemmRows, kBrgemmCols}, xc.options());
    float* gate_panel = panels.tensor().mutable_data_ptr<float>();
    float* up_panel = gate_panel + K * kBrgemmCols;
    float* gate_acc = acc.tensor().mutable_data_ptr<float>();
    float* up_acc = gate_acc + kBrgemmRows * kBrgemmCols;
    int64_t packed = -1;  // the column block the panels hold
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / row_chunks, chunk = item % row_chunks;
      const int64_t c0 = block * kBrgemmCols, nc = std::min(kBrgemmCols, N - c0);
      if (block != packed) {  // panel[k, c] = weight[c0 + c, k], for gate and for up
        transpose_tile(wp + c0 * K, K, nc, K, gate_panel, kBrgemmCols);
        transpose_tile(wp + (N + c0) * K, K, nc, K, up_panel, kBrgemmCols);
        packed = block;
      }
      for (int64_t r0 = chunks.begin(chunk); r0 < chunks.end(chunk); r0 += kBrgemmRows) {
        const int64_t nr = std::min(kBrgemmRows, chunks.end(chunk) - r0);
        for (int64_t k0 = 0; k0 < K; k0 += kBrgemmDepth) {
#if defined(CPUBLAS_BRGEMM_F32F32F32)
          const int64_t nk = std::min(kBrgemmDepth, K - k0);
          const float* a = xp + r0 * K + k0;
          at::native::cpublas::brgemm(nr, nc, nk, K, kBrgemmCols, kBrgemmCols, /*add_C=*/k0 > 0, a,
                                      gate_panel + k0 * kBrgemmCols, gate_acc);
          at::native::cpublas::brgemm(nr, nc, nk, K, kBrgemmCols, kBrgemmCols, /*add_C=*/k0 > 0, a,
                                      up_panel + k0 * kBrgemmCols, up_acc);
#else
          TORCH_INTERNAL_ASSERT(false, "linear_swiglu: the brgemm path runs only where ATen has the float32 brgemm");
#endif
        }
        for (int64_t r = 0; r < nr; ++r) {
          const float* g = gate_acc + r * kBrgemmCols;
          const float* u = up_acc + r * kBrgemmCols;
          float* yr = yp + (r0 + r) * N + c0;
          if (bp) {
            forward_bias_f32(g, u, bp + c0, bp + N + c0, yr, nc);
          } else {
            forward_f32(g, u, yr, nc);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

int64_t brgemm_swiglu_min_rows() { return kBrgemmMinRows; }

std::tuple<at::Tensor, at::Tensor> linear_swiglu(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias, bool save_preact) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N2] = check_linear_swiglu_args(x, weight, bias, at::kCPU);
  const int64_t N = N2 / 2;
  const at::Tensor x2 = x.reshape({M, K});
  const at::Tensor wt = weight.t();  // [K, 2N] view; BLAS reads it transposed, no copy
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end()), pre_shape = out_shape;
  out_shape.back() = N;
  pre_shape.back() = N2;
  if (!save_preact && M > 0 && N > 0 && K > 0) {
    // Note [float32 SwiGLU inference through brgemm]
    if (x.scalar_type() == at::kFloat && M >= kBrgemmMinRows && onednn_forward_gemm(x2)) {
      return {brgemm_swiglu_inference(x2, weight, bias).view(out_shape), at::empty({0}, x.options())};
    }
    if (auto y = onednn_swiglu_inference(x2, weight, bias)) return {y->view(out_shape), at::empty({0}, x.options())};
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0 && K > 0 && onednn_forward_gemm(x2)) {
    // Notes [float32 GEMMs through oneDNN], [bfloat16 forward GEMM through oneDNN]: one packed
    // GEMM, bias included, into a new z; the epilogue then reads it whole (for M up to 1024 the
    // ATen path below is one panel as well). Inference took the post-op path above unless ATen
    // lacks the binary op; then z is scratch.
    const at::Tensor z = onednn_linear(x2, weight.contiguous(), bias);
    swiglu_parallel(z, y);
    return {y.view(out_shape), save_preact ? z.view(pre_shape) : at::empty({0}, x.options())};
  }
  at::Tensor z = save_preact ? at::empty({M, N2}, x.options()) : at::empty({0}, x.options());
  if (M > 0 && N > 0) {
    const int64_t panel = rows_per_panel(M, N2);
    std::optional<Scratch> scratch;  // the GEMM's output panel when z is not kept
    if (!save_preact) scratch.emplace(0, at::IntArrayRef{panel, N2}, x.options());
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
      const int64_t r1 = std::min(M, r0 + panel);
      at::Tensor acc = save_preact ? row_range(z, r0, r1) : row_range(scratch->tensor(), 0, r1 - r0);
      // The bias goes into the GEMM, rounded once with it, as F.linear rounds (see linear_gelu).
      // Note [split forward GEMM]: in float32 / float64 the gate and up halves are two GEMMs.
      const at::Tensor xr = row_range(x2, r0, r1);
      for (const auto& [c0, c1] : forward_gemm_columns(x.scalar_type(), N)) {
        // BLAS writes the strided half in place (ldc = 2N); Note [bfloat16 GEMM without oneDNN].
        gemm_out(acc.slice(1, c0, c1), bias ? std::optional(bias->slice(0, c0, c1)) : std::nullopt, xr,
                 wt.slice(1, c0, c1));
      }
      swiglu_parallel(acc, row_range(y, r0, r1));
    }
  }
  return {y.view(out_shape), save_preact ? z.view(pre_shape) : z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                      const at::Tensor& weight,
                                                                      const at::Tensor& preact,
                                                                      std::array<bool, 3> output_mask) {
  const NoAutocastInside no_autocast;  // Note [no autocast inside the ops]
  const auto [M, K, N2] = check_linear_swiglu_backward_args(grad_y, x, weight, preact, at::kCPU);
  const auto [need_dx, need_dw, need_db] = output_mask;
  // Unasked gradients: distinct empty tensors (outputs must not alias).
  const auto empty = [&] { return at::empty({0}, x.options()); };
  if (!need_dx && !need_dw && !need_db) return {empty(), empty(), empty()};
  const at::Tensor dy = grad_y.contiguous().view({M, N2 / 2});
  const at::Tensor z = preact.contiguous().view({M, N2});
  const Scratch dz_buf(0, {M, N2}, x.options());  // Note [backward scratch on CPU]
  const at::Tensor& dz = dz_buf.tensor();
  // Note [weight-gradient operand layout]: where the rule wants a row-major dz^T, the pass writes it.
  std::optional<Scratch> dz_t_buf;
  if (need_dw && weight_grad_wants_dz_t(dy)) dz_t_buf.emplace(1, at::IntArrayRef{N2, M}, x.options());
  const at::Tensor dz_t = dz_t_buf ? dz_t_buf->tensor() : at::Tensor();
  at::Tensor db = dswiglu_parallel(dy, z, dz, dz_t, need_db);
  // Notes [float32 GEMMs through oneDNN], [bfloat16 GEMM without oneDNN] (csrc/gemm.cpp).
  at::Tensor dx = need_dx ? input_grad_gemm(dz, weight).view(x.sizes()) : empty();
  at::Tensor dw = need_dw ? weight_grad(dz, dz_t, x.reshape({M, K})) : empty();
  return {dx, dw, need_db ? db : empty()};
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_y, const at::Tensor& preact,
                                                   bool need_dbias) {
  const int64_t n = check_swiglu_backward_args(grad_y, preact, at::kCPU);
  const int64_t rows = n == 0 ? 0 : preact.numel() / (2 * n);
  const at::Tensor z = preact.contiguous().view({rows, 2 * n});
  at::Tensor dz = at::empty_like(z);
  at::Tensor db = dswiglu_parallel(grad_y.contiguous().view({rows, n}), z, dz, at::Tensor(), need_dbias);
  return {dz.view(preact.sizes()), need_dbias ? db : at::empty({0}, preact.options())};
}

}  // namespace parallel_layers::cpu

TORCH_LIBRARY_IMPL(parallel_layers, CPU, m) {
  m.impl("linear_swiglu", &parallel_layers::cpu::linear_swiglu);
  m.impl("linear_swiglu_backward", &parallel_layers::cpu::linear_swiglu_backward);
  m.impl("swiglu_backward", &parallel_layers::cpu::swiglu_backward);
}
