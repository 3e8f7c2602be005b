"""Every CUDA kernel of parallel_layers._C once, at shapes with tails, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python tools/cuda_probe.py

Without the caching allocator every tensor is its own cudaMalloc, so a read or write past a
tensor's end is outside any allocation and memcheck reports it. The shapes are small (the tool
slows kernels down ~100x) and odd: columns not a multiple of the vector width, rows not a
multiple of the block, one row, one column - and columns that are whole 16-byte units (264, for
the vectorised kernels), with rows that leave a short last chunk of row lanes. Values are not
checked here (tests/ops does that); this only runs each kernel, forward and backward, in
float32, bfloat16, float16 and float64 (the vectorised kernels' widths differ by dtype: 4, 8, 8
and 2 elements a 16-byte unit), and once on operands that start one element past an aligned
address, which must take the scalar path (each launch checks every pointer's alignment). tools/gpu_check.sh also runs it under racecheck and synccheck, for the
backward kernels' shared-memory sums (parallel_layers/cuda/column_sums.h, the RMSNorm block
reductions).
"""

import sys

import torch

import parallel_layers.ops as ops


def _probe_dtype(dtype: torch.dtype, dev: str) -> None:
    def randn(*shape, grad=False):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=grad)

    # The RMSNorm backward's register kernel at 1, 2, 4 and 8 columns a thread, its loop kernel at
    # n = 4096 and 4500 (Note [rms_norm backward in registers]).
    for rows, n in [(1, 1), (3, 5), (37, 130), (129, 1031), (70, 264), (11, 600), (5, 4096), (3, 4500)]:
        x, b = randn(rows, n, grad=True), randn(n, grad=True)
        for approximate in ("none", "tanh"):
            ops.bias_gelu(x, b, approximate).sum().backward()

        w = randn(n)
        ops.rms_norm(x, w.requires_grad_(), 1e-6).sum().backward()
        r = randn(rows, n, grad=True)
        y, s = ops.rms_norm_add(x, r, w, 1e-6)
        (y.sum() + s.sum()).backward()

        ops.transpose_2d(x).sum().backward()

    for m, k, n in [(1, 3, 5), (7, 17, 33), (65, 129, 257), (70, 64, 264)]:
        x = randn(m, k, grad=True)
        w, b = randn(n, k, grad=True), randn(n, grad=True)
        for approximate in ("none", "tanh"):
            ops.linear_gelu(x, w, b, approximate).sum().backward()
            ops.linear_gelu(x, w, None, approximate).sum().backward()
        w2, b2 = randn(2 * n, k, grad=True), randn(2 * n, grad=True)
        ops.linear_swiglu(x, w2, b2).sum().backward()
        ops.linear_swiglu(x, w2, None).sum().backward()

    # Views one element past an aligned start, columns whole 16-byte units (n = 264): the
    # vectorised kernels must see the misalignment and run scalar.
    rows, n = 70, 264
    x = randn(rows * n + 1)[1:].view(rows, n).detach().requires_grad_()
    b = randn(n + 1)[1:].detach().requires_grad_()
    ops.bias_gelu(x, b, "tanh").sum().backward()
    z = randn(rows * 2 * n + 1)[1:].view(rows, 2 * n)
    ops.swiglu_backward(randn(rows * n + 1)[1:].view(rows, n), z)
    ops.rms_norm(x, randn(n + 1)[1:], 1e-6)

    world = 3
    # 70 tensors: two launches of the CUDA ops (Note [shard tables by value]); empty ones too.
    tensors = [randn(7, 5), randn(13), randn(1), randn(4, 4)] + [randn(i % 9) for i in range(66)]
    shards = [randn(ops.shard_copy.shard_numel(t.numel(), world)) for t in tensors]
    for rank in range(world):
        buf = ops.shard_copy.all_gather_copy_in(shards, world, rank, dtype)
        ops.shard_copy.all_gather_copy_out(buf, [torch.empty_like(t) for t in tensors])
        rs = ops.shard_copy.reduce_scatter_copy_in(tensors, world, torch.float32, pre_scale=0.5)
        grads = [torch.zeros_like(s) for s in shards]
        ops.shard_copy.reduce_scatter_copy_out(rs[rank], grads, post_scale=2.0, accumulate=True)


def main() -> None:
    # `python tools/cuda_probe.py cpu` runs the same calls on the CPU kernels (a dry run of the probe).
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        _probe_dtype(dtype, dev)
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"cuda_probe: every kernel ran on {dev}")


if __name__ == "__main__":
    main()
