"""ZeRO-3 for a few steps, then FSDP2 for a few steps, then destroy_process_group: a script
that must exit 0 under torchrun (tests/test_launch.py runs it several times).

    torchrun --standalone --nproc-per-node 2 tests/_zero3_then_fsdp2.py [destroy|shutdown|exit] [HEARTBEAT_S]

It ends with dist.destroy_process_group() (destroy, the default), parallel_layers.shutdown(), or
nothing (exit: the heartbeat stops at interpreter exit), and rank 0 prints whether the heartbeat
thread is still running after that end.
HEARTBEAT_S (default: the library's) sets the watchdog's heartbeat period: a short one keeps the
heartbeat inside its store call most of the time, where an exit that does not stop it first
aborts (Note [collective watchdog] in parallel_layers/fault.py).
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import parallel_layers
from parallel_layers import fault


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 4))


def train(net, step, zero_grad, steps=3):
    for i in range(steps):
        torch.manual_seed(100 + i + dist.get_rank())
        net(torch.randn(8, 16)).square().mean().backward()
        step()
        zero_grad()


def main():
    end = sys.argv[1] if len(sys.argv) > 1 else "destroy"
    if len(sys.argv) > 2:
        fault.HEARTBEAT_S = float(sys.argv[2])
    ctx = parallel_layers.init_parallel()
    zero = parallel_layers.ZeRO(model(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), stage=3, group=ctx.dp_group)
    train(zero, zero.step, zero.zero_grad)

    fsdp = model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in fsdp:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    train(fsdp, opt.step, opt.zero_grad)
    print(f"rank {dist.get_rank()} trained", flush=True)
    heartbeat = fault._local.heartbeat.thread
    if end == "shutdown":
        parallel_layers.shutdown()
    elif end == "destroy":
        dist.destroy_process_group()
    if end != "exit":
        heartbeat.join(timeout=2 * fault.HEARTBEAT_S + 1)  # a plain destroy stops it within one beat
        print(f"heartbeat running after {end}: {heartbeat.is_alive()}", flush=True)


if __name__ == "__main__":
    main()
