#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU: build the extension for that GPU against the torch
# installed there, run every CUDA test, the kernels under compute-sanitizer, and the kernel
# benchmarks on the GPU. Everything it prints goes to $OUT/log.txt, the benchmark results to
# $OUT/*.json.
#
#   OUT=/tmp/gpu tools/gpu_check.sh        (OUT defaults to build/gpu_check)
#
# It uses whatever python3 holds a CUDA torch (not the pinned .venv: a GPU machine brings its own
# torch, and the extension is compiled against the torch that loads it).
set -u -o pipefail
out=${OUT:-build/gpu_check}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { echo; echo "=== $* ($(date +%T))"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'

step build
arch=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
export PARALLEL_LAYERS_CUDA_ARCHS=$arch MAX_JOBS=$(nproc)
rm -rf build/temp.* parallel_layers/_C.*.so
time python3 setup.py --quiet build_ext --inplace > "$out/build.txt" 2>&1 || { tail -60 "$out/build.txt"; exit 1; }
python3 -m parallel_layers.info

step "CUDA tests"
timeout 360 python3 -m pytest -p no:cacheprovider -q -o addopts="-ra" -m "not slow" -k cuda \
    tests/ops tests/zero/test_zero.py --junitxml="$out/junit.xml" 2>&1 | tail -60

step "compute-sanitizer memcheck"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
    --print-limit 20 python3 tools/cuda_probe.py 2>&1 | tail -40
echo "memcheck exit: $?"

step benchmarks
timeout 120 python3 benchmarks/bench_linear_gelu.py --device cuda --reps 10 --name gpu_linear_gelu 2>&1 | tail -30
timeout 150 python3 benchmarks/bench_linear_swiglu.py --device cuda --reps 10 --name gpu_linear_swiglu \
    --shapes 512,512,1376 4096,4096,11008 8192,4096,14336 2>&1 | tail -30
timeout 60 python3 benchmarks/bench_rms_norm.py --device cuda --name gpu_rms_norm 2>&1 | tail -20
timeout 60 python3 benchmarks/bench_shard_copy.py --device cuda 2>&1 | tail -20
cp benchmarks/results/gpu_*.json benchmarks/results/bench_shard_copy.json "$out"/ 2>/dev/null
step done
