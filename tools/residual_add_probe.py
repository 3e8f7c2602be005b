"""The residual add inside the norm or apart, one norm's forward + backward on CUDA.

    python tools/residual_add_probe.py

fused: `y, s = rms_norm_add(x, r, w)`; apart: `s = r + x; y = rms_norm(s, w)`, with gradients
flowing into both y and s (as in a decoder layer: the norm feeds the MLP, the sum the next residual).
Prints wall time per forward + backward (100 iterations, synchronised; at these sizes mostly the
host's time per call) and the kernels' summed GPU time from the profiler, at the shapes of
bench_fused_hf's step on CUDA and larger. Note [rms_norm backward in registers] quotes its numbers.

    python tools/residual_add_probe.py cpu     (a dry run of the same calls on the CPU kernels)
"""

import sys
import time

import torch

import parallel_layers.ops as ops


def main(dev: str = "cuda") -> None:
    eps = 1e-6
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    activity = torch.profiler.ProfilerActivity.CUDA if dev == "cuda" else torch.profiler.ProfilerActivity.CPU
    print(f"{'rows x hidden':>14} {'dtype':>9} | {'wall us: fused':>14} {'apart':>7} | {'gpu us: fused':>13} {'apart':>7}")
    for rows, hidden in [(1024, 1024), (1024, 2048), (4096, 2048), (4096, 4096)]:
        for dtype in (torch.float32, torch.bfloat16):
            def t(*shape, grad=True):
                return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=grad)
            x, r, w = t(rows, hidden), t(rows, hidden), t(hidden)
            gy, gs = t(rows, hidden, grad=False), t(rows, hidden, grad=False)

            def fused():
                y, s = ops.rms_norm_add(x, r, w, eps)
                torch.autograd.backward([y, s], [gy, gs])

            def apart():
                s = r + x
                y = ops.rms_norm(s, w, eps)
                torch.autograd.backward([y, s], [gy, gs])

            wall, gpu, profs = {}, {}, {}
            for name, fn in (("fused", fused), ("apart", apart)) * 2:  # second round counts
                for _ in range(10):
                    fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(100):
                    fn()
                sync()
                wall[name] = (time.perf_counter() - t0) * 1e4  # us per call
                with torch.profiler.profile(activities=[activity]) as prof:
                    for _ in range(10):
                        fn()
                    sync()
                profs[name] = prof
                gpu[name] = sum(e.self_device_time_total for e in prof.key_averages()) / 10
            print(f"{rows:>6} x {hidden:<5} {str(dtype)[6:]:>9} | {wall['fused']:14.1f} {wall['apart']:7.1f} | "
                  f"{gpu['fused']:13.1f} {gpu['apart']:7.1f}", flush=True)
            if (rows, hidden) == (1024, 2048) and dtype == torch.bfloat16:
                for name, prof in profs.items():
                    print(name, prof.key_averages().table(sort_by="self_device_time_total", row_limit=6,
                                                          max_name_column_width=60))


if __name__ == "__main__":
    main(*sys.argv[1:])
