// C++ unit tests of the CPU bias_gelu kernels and the shared helpers they use
// (parallel_layers/gelu.h, parallel_layers/row_chunks.h), against float64 ATen references.
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "check.h"
#include "parallel_layers/checks.h"
#include "parallel_layers/cpu/gelu_epilogue.h"
#include "parallel_layers/gelu.h"
#include "parallel_layers/ops.h"
#include "parallel_layers/row_chunks.h"

namespace pl = parallel_layers;

namespace {

// max |a - b| / (|b| + scale), elementwise, in float64.
double max_scaled_error(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale) {
  if (a.numel() == 0) return 0.0;
  auto a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  return ((a64 - b64).abs() / (b64.abs() + scale.to(at::kDouble).abs() + 1e-300)).max().item<double>();
}

void check_forward(at::IntArrayRef shape, at::ScalarType dtype, const std::string& approx, double tol) {
  at::manual_seed(0);
  auto x = (3 * at::randn(shape, at::kDouble)).to(dtype);
  auto b = at::randn({shape.back()}, at::kDouble).to(dtype);
  auto [y, z] = pl::cpu::bias_gelu(x, b, approx);
  auto z_ref = x.to(at::kDouble) + b.to(at::kDouble);
  auto y_ref = at::gelu(z_ref, approx);
  PL_CHECK(y.sizes() == x.sizes() && z.sizes() == x.sizes()) << "shape " << y.sizes();
  PL_CHECK(max_scaled_error(y, y_ref, z_ref) < tol) << "gelu " << approx << " " << dtype << " " << shape;
  PL_CHECK(max_scaled_error(z, z_ref, at::zeros_like(z_ref)) < tol) << "preact " << dtype << " " << shape;
}

}  // namespace

PL_TEST(forward_float32_and_float64) {
  for (const char* approx : {"none", "tanh"}) {
    // float32: a few ulps (eps 1.2e-7) relative to |y| + |z|.
    check_forward({7, 13}, at::kFloat, approx, 5e-7);
    check_forward({3, 4, 257}, at::kFloat, approx, 5e-7);
    check_forward({0, 5}, at::kFloat, approx, 5e-7);
    check_forward({129, 1}, at::kDouble, approx, 1e-15);
  }
}

PL_TEST(backward_matches_float64) {
  at::manual_seed(1);
  for (const char* approx : {"none", "tanh"}) {
    auto z = 3 * at::randn({300, 17}, at::kDouble);
    auto dy = at::randn({300, 17}, at::kDouble);
    auto [dz, db] = pl::cpu::bias_gelu_backward(dy.to(at::kFloat), z.to(at::kFloat), approx);
    auto zf = z.to(at::kFloat).to(at::kDouble);  // the kernel sees z rounded to float32
    auto dz_ref = at::gelu_backward(dy, zf, approx);
    auto scale = dy.abs() * (1 + zf.abs());
    PL_CHECK(max_scaled_error(dz, dz_ref, scale) < 5e-7) << approx;
    // float32 sum of 300 rows: error grows ~sqrt(rows) ulps of the sum of magnitudes.
    PL_CHECK(max_scaled_error(db, dz_ref.sum(0), scale.sum(0)) < 1e-5) << approx;
  }
}

PL_TEST(gelu_derivative_matches_finite_difference) {
  for (double z : {-6.0, -2.5, -0.3, 0.0, 0.7, 3.1}) {
    const double h = 1e-6;
    const double fd_none = (pl::gelu_forward<pl::GeluApprox::kNone>(z + h) -
                            pl::gelu_forward<pl::GeluApprox::kNone>(z - h)) / (2 * h);
    const double fd_tanh = (pl::gelu_forward<pl::GeluApprox::kTanh>(z + h) -
                            pl::gelu_forward<pl::GeluApprox::kTanh>(z - h)) / (2 * h);
    PL_CHECK(std::abs(fd_none - pl::gelu_derivative<pl::GeluApprox::kNone>(z)) < 1e-8) << z;
    PL_CHECK(std::abs(fd_tanh - pl::gelu_derivative<pl::GeluApprox::kTanh>(z)) < 1e-8) << z;
  }
}

// The float formulas are what the CUDA kernels run: check them against float64 ATen on a
// dense grid, including the tails where the textbook forms cancel.
PL_TEST(float_gelu_math_matches_float64) {
  auto z = at::linspace(-12, 12, 200001, at::kDouble);
  auto zf = z.to(at::kFloat).to(at::kDouble);  // the float inputs, exactly
  auto zacc = zf.accessor<double, 1>();
  for (const char* approx : {"none", "tanh"}) {
    auto y_ref = at::gelu(zf, approx);
    auto d_ref = at::gelu_backward(at::ones_like(zf), zf, approx);
    auto y = at::empty_like(zf), d = at::empty_like(zf);
    auto ya = y.accessor<double, 1>(), da = d.accessor<double, 1>();
    for (int64_t i = 0; i < zf.numel(); ++i) {
      const float v = static_cast<float>(zacc[i]);
      const bool tanh_form = std::string(approx) == "tanh";
      ya[i] = tanh_form ? pl::gelu_forward<pl::GeluApprox::kTanh>(v) : pl::gelu_forward<pl::GeluApprox::kNone>(v);
      da[i] = tanh_form ? pl::gelu_derivative<pl::GeluApprox::kTanh>(v)
                        : pl::gelu_derivative<pl::GeluApprox::kNone>(v);
    }
    // A few float32 ulps (eps 1.19e-7) of the magnitudes involved (|y| + |z|, and the
    // derivative's terms, which grow like |z|^3 in the tanh form).
    PL_CHECK(max_scaled_error(y, y_ref, zf) < 3e-7) << approx << " " << max_scaled_error(y, y_ref, zf);
    PL_CHECK(max_scaled_error(d, d_ref, 1 + zf.abs().pow(3)) < 3e-7) << approx;
  }
}

PL_TEST(row_chunks_cover_every_row_once) {
  for (int64_t rows : {0, 1, 2, 15, 16, 17, 1000, 4097}) {
    for (int64_t max_chunks : {1, 3, 8, 256}) {
      for (int64_t min_rows : {1, 16}) {
        const auto c = pl::make_row_chunks(rows, max_chunks, min_rows);
        PL_CHECK(c.num_chunks() <= std::max<int64_t>(max_chunks, 1)) << rows << " " << max_chunks;
        int64_t next = 0;
        for (int64_t i = 0; i < c.num_chunks(); ++i) {
          PL_CHECK(c.begin(i) == next && c.end(i) > c.begin(i)) << rows << " chunk " << i;
          next = c.end(i);
        }
        PL_CHECK(next == rows) << "rows " << rows << " covered up to " << next;
      }
    }
  }
}

PL_TEST(bad_inputs_raise_with_the_values) {
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
    } catch (const c10::Error& e) {
      PL_CHECK(std::string(e.what()).find(needle) != std::string::npos) << "message: " << e.what();
      return;
    }
    PL_CHECK(false) << "no error, expected one containing: " << needle;
  };
  expect_error([] { pl::cpu::bias_gelu(at::randn({3, 4}), at::randn({5}), "none"); },
               "bias has 5 elements but the last dim of x is 4");
  expect_error([] { pl::cpu::bias_gelu(at::randn({3, 4}), at::randn({4}), "erf"); },
               "approximate must be 'none' or 'tanh', got 'erf'");
  expect_error([] { pl::cpu::bias_gelu_backward(at::randn({3, 4}), at::randn({4, 3}), "none"); },
               "grad_out has shape [3, 4] but preact has shape [4, 3]");
}

#if defined(__x86_64__)
// Note [no subnormals in the GeLU math] (parallel_layers/gelu.h): no SIMD instruction of the
// float32 / bfloat16 GeLU passes may read or produce a subnormal from normal inputs, not even
// in lanes a blend later discards (x86 runs each such instruction ~100x slower). MXCSR's
// sticky DE (subnormal operand) and UE (underflow) flags record any that did.
PL_TEST(gelu_passes_touch_no_subnormals) {
  at::set_num_threads(1);  // MXCSR is per thread: keep the work on this one
  // Seven decades of magnitudes, a coarser sweep up to 1e12, and a dense one over 5..20, where
  // exp's argument crosses its -80 clamp (tanh gate at |z| ~ 9.5-10, erf's e^{-z^2/2} at ~12.6).
  const auto mags = at::cat({at::logspace(-3, 4, 1024, 10.0, at::kDouble), at::logspace(4, 12, 256, 10.0, at::kDouble),
                             at::linspace(5, 20, 4096, at::kDouble)});
  const auto z64 = at::cat({mags, -mags}).reshape({-1, 32});  // both tails, 32 elements per row
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto z = z64.to(dtype), dy = at::ones_like(z), bias = at::zeros({32}, z.options());
    for (const char* approx : {"none", "tanh"}) {
      _mm_setcsr(_mm_getcsr() & ~0x3Fu);  // clear the exception flags
      pl::cpu::bias_gelu(z, bias, approx);
      pl::cpu::bias_gelu_backward(dy, z, approx);
      // linear_gelu_backward's bfloat16 pass: dz and dz^T written from the same tiles.
      pl::cpu::dgelu_parallel(dy, z, at::empty_like(z), at::empty({z.size(1), z.size(0)}, z.options()),
                              /*want_dbias=*/true, pl::parse_gelu_approx(approx));
      const unsigned flags = _mm_getcsr();
      PL_CHECK((flags & 0x12u) == 0) << approx << " " << dtype << ": MXCSR flags " << std::hex << (flags & 0x3Fu)
                                     << " (0x2 = subnormal operand, 0x10 = underflow)";
    }
  }
}
#endif

int main() { return pl_test::run_all(); }
