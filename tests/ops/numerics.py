"""Error measures shared by the op tests: compare against float64 references; and how the CPU
ops' bfloat16 and float32 GEMMs run on this machine."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import parallel_layers

CUDA_COMPILED_AND_PRESENT = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine (the CUDA kernels are compiled, not run)")


def devices() -> list:
    """CPU always; CUDA as a parameter that skips with a reason when no GPU is present."""
    return ["cpu", pytest.param("cuda", marks=CUDA_COMPILED_AND_PRESENT)]


def max_abs_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - reference.double()).abs().max().item()


def assert_within_rounding(actual: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor, ulps: float,
                           what: str) -> None:
    """|actual - reference| <= ulps * eps(actual.dtype) * (|reference| + scale), elementwise.

    `scale` is the magnitude the computation went through (e.g. |pre-activation| for GeLU,
    whose 1 + erf(z / sqrt 2) cancels for large negative z), so that the bound is that of
    rounding in the working precision, not a loose absolute tolerance.
    """
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    eps = torch.finfo(actual.dtype).eps
    bound = ulps * eps * (reference.double().abs() + scale.double().abs())
    err = (actual.double() - reference.double()).abs()
    bad = err > bound
    if bad.any():
        i = bad.flatten().nonzero()[0].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements beyond {ulps} ulps of {actual.dtype}; first at flat "
            f"index {i}: got {actual.flatten()[i].item()!r}, reference {reference.flatten()[i].item()!r}, "
            f"error {err.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g}")


# Note [bfloat16 GEMM without oneDNN] (csrc/linear_gelu.cpp): where ATen's oneDNN has no bfloat16
# support on this CPU, the fused ops' bfloat16 GEMMs are float32 products rounded once.
BF16_GEMMS_WIDEN = not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def conversions_inside(fn) -> int:
    """How many dtype conversions (aten::_to_copy) fn makes: the profiler sees the ATen calls a
    C++ kernel makes inside an op, which a dispatch mode does not."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "aten::_to_copy" for e in prof.events())


# Note [float32 GEMMs through oneDNN] (csrc/gemm.cpp): the fused ops' float32 forward and
# input-gradient GEMMs run through oneDNN on AMD CPUs with AVX-512 ("auto"), else through ATen.
def _cpu_is_amd_with_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return False
    return "AuthenticAMD" in text and "avx512f" in text.split()


FP32_GEMMS_ONEDNN = _cpu_is_amd_with_avx512()


@contextlib.contextmanager
def cpu_gemm(backend: str):
    """The fused ops' float32 CPU GEMMs through `backend` ("auto", "aten", "onednn") inside."""
    previous = parallel_layers._C._set_cpu_gemm(backend)
    try:
        yield
    finally:
        parallel_layers._C._set_cpu_gemm(previous)


def device_gemms() -> list:
    """(device, cpu_gemm) for the float32 tests: the CPU with both GEMM libraries, CUDA as devices()."""
    return [("cpu", "aten"), ("cpu", "onednn"), pytest.param("cuda", "auto", marks=CUDA_COMPILED_AND_PRESENT)]


def fp32_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, backend: str = "auto"):
    """x @ w.T + b as the fused ops' float32 CPU forward computes it under `backend`: the same bits."""
    onednn = backend == "onednn" or (backend == "auto" and FP32_GEMMS_ONEDNN)
    if onednn and x.dtype == torch.float32 and x.numel() and w.numel():
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)
