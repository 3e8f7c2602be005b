"""Kernel-level profile of the fused ops' forward + backward on CUDA, against eager.

    python tools/cuda_profile_ops.py        (on a machine with a GPU; tools/gpu_check.sh runs it)

One bfloat16 shape each: linear_gelu (both forward paths, Note [linear_gelu's CUDA forward path])
and eager GeLU at 2048 x 1024 -> 4096, linear_swiglu and eager packed SwiGLU at 8192 x 4096 ->
2 x 14336. Prints torch.profiler's per-kernel GPU times: what each kernel of ours costs next to
the GEMMs and next to eager's kernels, apart from the per-call CPU time that the benchmarks'
wall-clock ratios include.
"""
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from parallel_layers import _C
from parallel_layers.ops import linear_gelu, linear_swiglu


def run(name, fn, args, dy):
    for _ in range(3):
        out = fn(*args)
        torch.autograd.grad(out, args, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            out = fn(*args)
            torch.autograd.grad(out, args, dy)
        torch.cuda.synchronize()
    print(f"\n##### {name} (5 iterations of forward + backward)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=90))


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    m, k, n = 2048, 1024, 4096
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(dt).requires_grad_()
    b = torch.randn(n, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    run("linear_gelu kernel path", linear_gelu, (x, w, b), dy)
    _C._set_cuda_gelu_path("cublaslt")
    run("linear_gelu cublaslt path", linear_gelu, (x, w, b), dy)
    _C._set_cuda_gelu_path("kernel")
    run("eager gelu", lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), (x, w, b), dy)
    m, k, n = 8192, 4096, 14336
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(2 * n, k, device=dev) / k ** 0.5).to(dt).requires_grad_()
    dy = torch.randn(m, n, device=dev, dtype=dt)
    run("linear_swiglu", lambda x, w: linear_swiglu(x, w, None), (x, w), dy)

    def eager_swiglu(x, w):
        g, u = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(g) * u
    run("eager swiglu", eager_swiglu, (x, w), dy)


if __name__ == "__main__":
    main()
