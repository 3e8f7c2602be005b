"""The parallel layout: one dataclass that validates the degrees, and `init_parallel` that
builds the process groups for it.

Ranks are laid out on a mesh of shape (pp, dp, tp) with tensor parallelism innermost, as
every reference system does: the ranks of one TP group are adjacent (on one node, on the
fastest links), pipeline stages are outermost. Layers take their group explicitly
(`tp_group=...`); `init_parallel` only builds the groups, it keeps no hidden global state
beyond torch.distributed's own default group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel_layers import fault

MESH_AXES = ("pp", "dp", "tp")
DEFAULT_TIMEOUT_S = 600.0  # init_parallel's collective timeout when neither the caller nor a process group sets one
MAX_TIMEOUT_S = 1e12  # ~31,700 years; torch's timeouts overflow a C int of days from ~1.9e14 s


def divisors(n: int, limit: int = 1024) -> list[int]:
    """The sizes an axis of `n` items can be split into (for error messages)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, tensor and pipeline parallelism; their product is the world size."""

    dp: int
    tp: int
    pp: int
    world_size: int

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(
                f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.dp * self.tp * self.pp} != world_size "
                f"{self.world_size}; choose degrees whose product is {self.world_size} (tp and pp must divide it: "
                f"valid values are {divisors(self.world_size)})")

    @classmethod
    def infer(cls, world_size: int, *, tp: int = 1, pp: int = 1, dp: int | None = None) -> ParallelDims:
        """Fill in dp = world_size / (tp * pp) when it is not given."""
        if dp is None:
            if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
                raise ValueError(
                    f"tp({tp}) * pp({pp}) = {tp * pp} does not divide world_size {world_size}; valid values for "
                    f"tp * pp are {divisors(world_size)}")
            dp = world_size // (tp * pp)
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size)

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)


def _check_axis(axis: str) -> None:
    if axis not in MESH_AXES:
        raise ValueError(f"axis must be one of {MESH_AXES}, got {axis!r}")


@dataclasses.dataclass
class ParallelContext:
    """What `init_parallel` built: the layout, the mesh, and one process group per axis."""

    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device

    def group(self, axis: str) -> dist.ProcessGroup:
        _check_axis(axis)
        return self.mesh.get_group(axis)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    def coordinate(self, axis: str) -> int:
        """This rank's index along `axis`."""
        _check_axis(axis)
        return self.mesh.get_local_rank(axis)

    def shutdown(self) -> None:
        """The end of the job: `parallel_layers.shutdown()`."""
        shutdown()


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when GPUs are visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device a rank computes on: `device`, with "cuda" given no index taken as this rank's
    local GPU (torch.cuda.set_device refused the README's `--device cuda` with "Expected a
    torch.device with a specified index": review finding); None: `default_device()`."""
    device = torch.device(device) if device is not None else default_device()
    if device.type not in ("cpu", "cuda"):  # "mps" failed in torch.mps, "meta" was taken
        raise ValueError(f"init_parallel: device must be 'cpu' (gloo) or 'cuda' / 'cuda:<index>' (NCCL), got "
                         f"{str(device)!r}")
    if device.type == "cuda" and device.index is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % torch.cuda.device_count() if torch.cuda.is_available() else local)
    return device


def init_parallel(*, tp: int = 1, pp: int = 1, dp: int | None = None, device: torch.device | str | None = None,
                  timeout_s: float | None = None) -> ParallelContext:
    """Build the (pp, dp, tp) mesh and its groups; initialise torch.distributed if needed.

    The backend follows the device: NCCL for CUDA, gloo for CPU. Collectives time out after
    `timeout_s` instead of hanging forever (None: 600 s, or the timeout of a process group the
    caller initialised already; given, it also becomes that world group's timeout, for the rest
    of the job: Note [one timeout for every group]); on NCCL, torch's async
    error handling and flight recorder are turned on unless the environment sets them (Note
    [collective watchdog] in parallel_layers/fault.py). Works under torchrun (reads the usual env
    vars) and after an existing `init_process_group` (tests). End the job with `shutdown()`.
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"init_parallel: timeout_s must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}, "
                         f"after which a collective that has not completed fails (or None: {DEFAULT_TIMEOUT_S:g} s, "
                         f"or an existing process group's own), got {timeout_s!r}")
    device = resolve_device(device)
    timeout = _world_timeout(timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
            os.environ.update(fault.nccl_env_defaults(os.environ))  # read when the process group is created
            with contextlib.suppress(OSError):  # torch creates only its default dump directory
                os.makedirs(os.path.dirname(fault.flight_recorder_prefix(os.environ)), exist_ok=True)
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            store, rank, world = _attempt_store(timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    dims = ParallelDims.infer(dist.get_world_size(), tp=tp, pp=pp, dp=dp)
    mesh = init_device_mesh(device.type, dims.mesh_shape, mesh_dim_names=MESH_AXES,
                            backend_override=_axis_timeouts(dims, timeout))
    for axis, size in zip(MESH_AXES, dims.mesh_shape):  # a world group of several backends ("cpu:gloo,
        if 1 < size < dist.get_world_size():  # cuda:nccl") gets no override above: set on each backend
            _set_timeout(mesh.get_group(axis), timeout)
    return ParallelContext(dims=dims, mesh=mesh, device=device)


# Note [one timeout for every group]: `timeout_s` is every group's - the world group's and each
# axis group's (Note [axis groups time out too]). A process group the caller initialised before
# init_parallel kept its own timeout (gloo's default is 30 min) while the docstring promised
# timeout_s: a job that asked for 60 s could hang half an hour in a world-sized collective.
# Given, timeout_s now replaces the existing world group's (torch's `ProcessGroup.set_timeout`,
# which NCCL and gloo honour); not given, the existing group's timeout stands and the axis groups
# take it too, so one job has one timeout. Without an existing group, None is 600 s. The groups
# of an earlier init_parallel keep the timeout they were built with.
def _world_timeout(timeout_s: float | None) -> datetime.timedelta:
    if timeout_s is not None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if dist.is_initialized():
            _set_timeout(dist.group.WORLD, timeout)
        return timeout
    existing = _timeout_of(dist.group.WORLD) if dist.is_initialized() else None
    return existing if existing is not None else datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


def _backends(group) -> list:
    """The backends of `group` whose options can carry a timeout (none for a backend without
    options, such as the tests' fake one)."""
    found = []
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except (RuntimeError, ValueError):  # no backend for that device type
            continue
        if getattr(getattr(backend, "options", None), "_timeout", None) is not None and backend not in found:
            found.append(backend)
    return found


def _timeout_of(group) -> datetime.timedelta | None:
    timeouts = [b.options._timeout for b in _backends(group)]
    return max(timeouts) if timeouts else None


def _set_timeout(group, timeout: datetime.timedelta) -> None:
    backends = _backends(group)
    if backends and hasattr(group, "set_timeout"):  # torch 2.14; its backends' own setter before
        group.set_timeout(timeout)
        return
    for backend in backends:
        backend._set_default_timeout(timeout)


# Note [axis groups time out too]: init_device_mesh creates a process group for every axis
# smaller than the world, and gives it the backend's default timeout (30 min on gloo, 10 on
# NCCL), not the world group's, unless it is handed backend options that carry one. A rank
# hung outside any collective at tp2 x dp2 held its peers for the default (the job ran past a
# 300 s limit with timeout_s=10; at world 2 the axes are the world group, so the tests saw the
# right timeout: review finding). Axes as large as the world keep the world group itself. A
# world group of several backends (init_process_group("cpu:gloo,cuda:nccl")) has no one options
# type to hand over; init_parallel sets the axis groups' timeout on each of their backends after
# (review finding, helper-85: they kept 30 min there).
def _axis_timeouts(dims: ParallelDims, timeout: datetime.timedelta) -> dict:
    backend = dist.get_backend()
    options = {"gloo": getattr(dist.ProcessGroupGloo, "_Options", None),
               "nccl": getattr(dist, "ProcessGroupNCCL", None) and dist.ProcessGroupNCCL.Options}.get(backend)
    if options is None:  # another backend (the fake one of the tests): its own defaults
        return {}
    override = {}
    for axis, size in zip(MESH_AXES, dims.mesh_shape):
        if 1 < size < dist.get_world_size():
            opts = options()
            opts._timeout = timeout
            override[axis] = (backend, opts)
    return override


def _attempt_store(timeout: datetime.timedelta) -> tuple[dist.Store, int, int]:
    """The env:// store of torch.distributed's own rendezvous, under a prefix of its own for
    each restart of the job.

    Note [a store per restart]: torchrun's agent keeps one store for its workers across
    restarts (torch 2.14, pytorch/pytorch#135712), so a restarted process group can read the
    dead workers' addresses there ("Gloo connectFullMesh failed ... Connection refused") or
    a stale barrier. Each rank counts its own initialisations in the store; every attempt
    starts every rank anew, so all ranks of an attempt count the same n and meet under the
    fresh prefix "attempt<n>". (A rank killed before it reached init_parallel would leave
    its count one behind; launching with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every
    restart a new store and sidesteps the count.)
    """
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    attempt = store.add(f"parallel_layers/inits/rank{rank}", 1)
    return dist.PrefixStore(f"parallel_layers/attempt{attempt}/default_pg", store), rank, world


def shutdown() -> None:
    """Stop the collective watchdog's heartbeat, then destroy the process groups: the clean end
    of a job (Note [collective watchdog]). A plain `dist.destroy_process_group()` is safe too."""
    fault.stop_heartbeat()
    if dist.is_initialized():
        dist.destroy_process_group()
