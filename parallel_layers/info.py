"""`python -m parallel_layers.info`: what was built, and what a launch will see.

Prints the extension's build (CUDA kernels, archs, the torch and CUDA it was compiled
against), the installed torch, the visible GPUs and how CUDA_VISIBLE_DEVICES /
CUDA_DEVICE_ORDER mapped them, the distributed backends, and rank / world size when run
under torchrun (each rank prints its own block).
"""

from __future__ import annotations

import os
import platform
import sys

import torch
import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _compiled_archs_cover(archs: list[str], major: int, minor: int) -> bool:
    """True if a cubin for this exact arch or PTX for an equal or older one was compiled."""
    for a in archs:
        ptx = a.endswith("+PTX")
        base = a.removesuffix("+PTX").rstrip("af")
        amaj, amin = (int(v) for v in base.split("."))
        if (amaj, amin) == (major, minor) or (ptx and (amaj, amin) <= (major, minor)):
            return True
    return False


def _devices(archs: list[str]) -> list[dict]:
    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else None
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({
            "index": i,
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1),
            "pci_bus_id": f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}"
            if hasattr(p, "pci_bus_id") else "unknown",
            "physical": entries[i] if entries is not None and i < len(entries) else str(i),
            "kernels_for_this_arch": _compiled_archs_cover(archs, p.major, p.minor),
        })
    return out


def collect() -> dict:
    """Everything `python -m parallel_layers.info` prints, as a dict."""
    import parallel_layers

    build = parallel_layers.build_info()
    launch = {k: os.environ[k] for k in _TORCHRUN_VARS if k in os.environ}
    return {
        "parallel_layers": {"version": parallel_layers.__version__,
                            "location": os.path.dirname(parallel_layers.__file__)},
        "build": build,
        "runtime": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count(),
        },
        "env": {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER")},
        "devices": _devices(build["cuda_archs"]),
        "distributed": {
            "available": dist.is_available(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "torchrun": launch or None,
    }


def _env_notes(env: dict, devices: list[dict]) -> list[str]:
    notes = []
    visible = env["CUDA_VISIBLE_DEVICES"]
    if visible == "":
        notes.append("CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible (CPU only).")
    if len(devices) > 1 and env["CUDA_DEVICE_ORDER"] != "PCI_BUS_ID":
        notes.append("CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers GPUs fastest first, which may differ "
                     "from nvidia-smi's order; set CUDA_DEVICE_ORDER=PCI_BUS_ID to make the indices in "
                     "CUDA_VISIBLE_DEVICES mean what nvidia-smi shows.")
    return notes


def format_report(info: dict) -> str:
    b, r = info["build"], info["runtime"]
    lines = [f"parallel_layers {info['parallel_layers']['version']} at {info['parallel_layers']['location']}",
             "", "build:"]
    if b["cuda_compiled"]:
        lines.append(f"  CUDA kernels: compiled for {', '.join(b['cuda_archs'])} "
                     f"(nvcc {b['nvcc_version']}, CUDA runtime {b['cudart_version']})")
    else:
        lines.append("  CUDA kernels: not compiled (CPU kernels only)")
    lines.append(f"  built against torch {b['torch_version']}"
                 + (f" (CUDA {b['torch_cuda_version']})" if b["torch_cuda_version"] else " (CPU build)"))
    lines += ["", "runtime:",
              f"  python {r['python']}, torch {r['torch']}"
              + (f" (CUDA {r['torch_cuda']})" if r["torch_cuda"] else " (CPU build)"),
              f"  CUDA available: {r['cuda_available']}, devices: {r['device_count']}"]
    env = info["env"]
    lines.append(f"  CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES'] if env['CUDA_VISIBLE_DEVICES'] is not None else '(unset)'}"
                 f"  CUDA_DEVICE_ORDER={env['CUDA_DEVICE_ORDER'] or '(unset: FASTEST_FIRST)'}")
    for d in info["devices"]:
        lines.append(f"  cuda:{d['index']} <- physical GPU {d['physical']}: {d['name']}, sm_{d['capability'].replace('.', '')}, "
                     f"{d['memory_gib']} GiB, PCI {d['pci_bus_id']}"
                     + ("" if d["kernels_for_this_arch"] else "  ** no kernels compiled for this arch **"))
    lines += [f"  note: {n}" for n in _env_notes(env, info["devices"])]
    dd = info["distributed"]
    lines += ["", "distributed backends: " + ", ".join(
        f"{k} {'yes' if dd[k] else 'no'}" for k in ("gloo", "nccl", "mpi"))]
    if info["torchrun"]:
        t = info["torchrun"]
        lines.append(f"torchrun: rank {t.get('RANK', '?')} of world size {t.get('WORLD_SIZE', '?')}, "
                     f"local rank {t.get('LOCAL_RANK', '?')} of {t.get('LOCAL_WORLD_SIZE', '?')}, "
                     f"master {t.get('MASTER_ADDR', '?')}:{t.get('MASTER_PORT', '?')}")
        if info["devices"] and "LOCAL_RANK" in t:
            lines.append(f"  this rank would use cuda:{t['LOCAL_RANK']}")
    else:
        lines.append("torchrun: not running under torchrun (no RANK / WORLD_SIZE in the environment)")
    return "\n".join(lines)


def main() -> int:
    info = collect()
    text = format_report(info)
    if info["torchrun"]:
        text = "\n".join(f"[rank {info['torchrun'].get('RANK', '?')}] {line}" for line in text.splitlines())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
