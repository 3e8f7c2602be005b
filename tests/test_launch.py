"""Launching through torchrun: clean exits, two nodes, and automatic restart after a SIGKILL.

- A ZeRO-3 + FSDP2 script (tests/_zero3_then_fsdp2.py) exits 0 every time, however it ends
  (Note [collective watchdog] in parallel_layers/fault.py: the heartbeat stops first).
- Two torchrun agents on this machine act as two nodes (c10d rendezvous on localhost) and run
  the main job as dp=2 x tp=2 with checkpoints.
- `torchrun --max-restarts 1` brings the main job back from its last checkpoint after the test
  SIGKILLs a worker mid-training; it ends bit-identical to the run that was never killed.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallel_layers import checkpoint

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# The smallest GPT that still has every part: d_model 32 over 4 heads, one block.
SMALL_GPT = [str(ROOT / "examples" / "train_gpt.py"), "--d-model", "32", "--layers", "1", "--seq-len", "32"]


def _failure(r) -> str:
    return r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("repeats", [1, pytest.param(3, marks=pytest.mark.slow)], ids=["once", "thrice-more"])
def test_zero3_then_fsdp2_exits_cleanly_every_time(repeats):
    # A 0.5 ms heartbeat keeps the heartbeat thread in its store call most of the time, where an
    # unstopped thread aborts the exit (without the stop: SIGABRT in ~1 run of 8 here). Each way
    # of ending: dist.destroy_process_group(), parallel_layers.shutdown(), neither (atexit);
    # once in the default run, three more times each in the slow one.
    for end in ("destroy", "shutdown", "exit") * repeats:
        r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2",
                            str(ROOT / "tests" / "_zero3_then_fsdp2.py"), end, "0.0005"],
                           env=ENV, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"ending with {end}: " + _failure(r)
        assert r.stdout.count("trained") == 2, _failure(r)
        if end != "exit":
            assert r.stdout.count(f"heartbeat running after {end}: False") == 2, _failure(r)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_through_c10d_rendezvous(tmp_path):
    port = _free_port()
    agents = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                "--rdzv-id", f"two-nodes-{port}", *SMALL_GPT, "--dp", "2", "--tp", "2",
                                "--steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"],
                               env=ENV, stdout=open(tmp_path / f"node{node}.out", "w"),
                               stderr=open(tmp_path / f"node{node}.err", "w")) for node in (0, 1)]
    codes = [a.wait(timeout=300) for a in agents]
    out = "".join((tmp_path / f"node{n}.{kind}").read_text() for n in (0, 1) for kind in ("out", "err"))
    assert codes == [0, 0], out[-6000:]
    assert "layout: dp=2 x tp=2 x pp=1 on 4 process(es)" in out and ": PASS" in out, out[-6000:]
    assert checkpoint.latest_checkpoint(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "step_4")
    assert "step_2" in os.listdir(tmp_path / "ckpt")


# ---- automatic restart --------------------------------------------------------------------
STEPS, EVERY = 16, 4
# Plain torchrun: its agent keeps one store across restarts, and init_parallel gives each
# attempt its own prefix there (Note [a store per restart] in parallel_layers/parallel_dims.py).
RESTART_ENV = ENV


def _workers(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the agent's worker processes (read from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().decode().split("\0")
                       if "=" in kv)
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
        if "RANK" in env:  # the agent's other children (multiprocessing helpers) have none
            out[int(env["RANK"])] = int(entry)
    return out


def _train_with_restarts(ckpt_dir: Path, log: Path, kill_rank: int | None):
    """The main job under `torchrun --max-restarts 1 ... --resume`; if kill_rank is given, SIGKILL
    that rank once the first checkpoint is complete. Returns (exit code, output, killed)."""
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *SMALL_GPT, "--dp", "2",
           "--zero", "1", "--steps", str(STEPS), "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", str(EVERY),
           "--resume"]
    with open(log, "w") as f:
        agent = subprocess.Popen(cmd, env=RESTART_ENV, stdout=f, stderr=subprocess.STDOUT)
        killed, deadline = False, time.monotonic() + 300
        while agent.poll() is None and time.monotonic() < deadline:
            if kill_rank is not None and not killed and checkpoint.latest_checkpoint(str(ckpt_dir)):
                pid = _workers(agent.pid).get(kill_rank)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            time.sleep(0.02)
        if agent.poll() is None:
            agent.kill()
        code = agent.wait()
    return code, log.read_text(), killed


def _final(ckpt_dir: Path):
    path = ckpt_dir / f"step_{STEPS}"
    extra = json.loads((path / "parallel_layers.json").read_text())["extra"]
    return checkpoint.export_state_dict(str(path)), extra["losses"]


def test_sigkilled_rank_restarts_from_the_last_checkpoint_bit_identical(tmp_path):
    code, out, _ = _train_with_restarts(tmp_path / "straight", tmp_path / "straight.log", kill_rank=None)
    assert code == 0 and ": PASS" in out and "resumed from" not in out, out[-3000:]
    code, out, killed = _train_with_restarts(tmp_path / "killed", tmp_path / "killed.log", kill_rank=1)
    assert killed and code == 0, out[-6000:]
    assert "exitcode: -9" in out and ": PASS" in out, out[-6000:]
    # The restarted workers found the checkpoint the killed ones left, before the end.
    resumed = [int(line.rsplit("(step ", 1)[1].rstrip(")")) for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and EVERY <= resumed[0] < STEPS and resumed[0] % EVERY == 0, out[-6000:]

    params, losses = _final(tmp_path / "straight")
    params_killed, losses_killed = _final(tmp_path / "killed")
    assert losses_killed == losses  # every step's loss, as JSON floats: bit for bit
    assert params.keys() == params_killed.keys()
    for name in params:
        assert torch.equal(params[name], params_killed[name]), name
