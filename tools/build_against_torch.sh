#!/usr/bin/env bash
# Build the extension against another torch release and run the op and fused-model tests on CPU.
#
#   tools/build_against_torch.sh 2.11.0        (after `make build`: it borrows the .venv)
#
# CI builds against the pinned torch (requirements.txt); users and the lent GPU machines bring
# their own (torch 2.11 on the GPU images so far). The C++ API moves between releases: torch
# 2.14 holds autograd nodes by c10::intrusive_ptr, 2.11 by std::shared_ptr, and the first build
# on a GPU would have failed on that (csrc/autograd.cpp, NodePtr). This builds the working tree
# (tracked files, uncommitted changes included) in build/torch-VERSION/ against that torch's
# wheel from the package index, CUDA kernels too (one arch, sm_90) when the wheel is a CUDA
# build, and runs tests/ops and tests/test_fused.py there (~3 min of build on 2 cores, a ~530 MB
# download). The other packages (numpy, pytest, transformers, the nvidia wheels' headers) come
# from .venv: a .pth puts its site-packages after the new torch's.
set -euo pipefail
version=${1:?usage: tools/build_against_torch.sh TORCH_VERSION (e.g. 2.11.0)}
root=$(git rev-parse --show-toplevel)
cd "$root"
test -x .venv/bin/python || { echo "no .venv: run 'make build' first" >&2; exit 1; }
dir=build/torch-$version
venv=$dir/venv
src=$dir/src
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

if [ ! -x "$venv/bin/python" ]; then
    "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --no-deps "torch==$version"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$main_site" > "$site/zz_parallel_layers_main_venv.pth"  # after the venv's own packages
    [ -e "$main_site/nvidia" ] && ln -sfn "$main_site/nvidia" "$site/nvidia"  # the CUDA headers setup.py looks for
fi
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__, "from", torch.__file__)'

rm -rf "$src" && mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | xargs -0 tar --ignore-failed-read -cf - | tar -xf - -C "$src"
cd "$src"
PARALLEL_LAYERS_CUDA_ARCHS=${PARALLEL_LAYERS_CUDA_ARCHS:-90} "$root/$venv/bin/python" setup.py --quiet build_ext --inplace
"$root/$venv/bin/python" -m pytest -p no:cacheprovider -q -o addopts="" -m "not slow" tests/ops tests/test_fused.py
