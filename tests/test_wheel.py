"""`make wheel`'s wheel is self-contained: installed into a fresh venv, its op runs."""

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "--wheel-dir", str(dist), str(ROOT)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = dist.glob("parallel_layers-*.whl")

    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # The same torch, without a second 5 GB install: the fresh venv sees the current one's
    # site-packages *after* its own (a .pth path entry), and nothing of parallel_layers
    # is installed there (tests import it from the source tree).
    fresh_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    Path(fresh_site, "same_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    probe = (
        "import parallel_layers, torch, torch.nn.functional as F\n"
        "print(parallel_layers.__file__)\n"
        "x, b = torch.randn(4, 8), torch.randn(8)\n"
        "torch.testing.assert_close(parallel_layers.ops.bias_gelu(x, b), F.gelu(x + b))\n"
        "print(torch.__version__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    location, version = r.stdout.split()
    assert location.startswith(fresh_site), f"imported from {location}, not from the wheel in {fresh_site}"
    assert version == torch.__version__
