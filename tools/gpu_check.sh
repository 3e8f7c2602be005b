#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU: build the extension for that GPU against the torch
# installed there, run every CUDA test, the kernels under compute-sanitizer (memcheck,
# racecheck, synccheck), the kernel benchmarks and a kernel profile on the GPU. Everything it
# prints goes to $OUT/log.txt, the build log, test log and profile to
# $OUT/{build,pytest,profile}.txt, benchmark results (gpu_*.json, bench_shard_copy.json) in one
# $OUT/gpu_results.tar (5 files: the device tool brings back at most 8).
#
#   OUT=/tmp/gpu tools/gpu_check.sh        (OUT defaults to build/gpu_check)
#
# It uses whatever python3 holds a CUDA torch (not the pinned .venv: a GPU machine brings its own
# torch, and the extension is compiled against the torch that loads it). Before a lease, check the
# build against that torch here: tools/build_against_torch.sh 2.11.0 (the GPU images' so far).
set -u -o pipefail
out=${OUT:-build/gpu_check}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { echo; echo "=== $* ($(date +%T))"; }
# the benchmark results in one file; again after each later benchmark (a run cut short keeps these)
save_results() {
    tar -cf "$out/gpu_results.tar" -C benchmarks/results $(cd benchmarks/results && ls gpu_*.json bench_shard_copy.json 2>/dev/null)
}

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'

step build
arch=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
export PARALLEL_LAYERS_CUDA_ARCHS=$arch MAX_JOBS=$(nproc)
build() { rm -rf build/temp.* parallel_layers/_C.*.so; python3 setup.py --quiet build_ext --inplace > "$out/build.txt" 2>&1; }
# A default CXX that links libstdc++ statically is refused by the build (Note [one libstdc++],
# tools/build_env.py); the image seen here had one, and the system g++ next to it.
time build || { tail -5 "$out/build.txt"; echo "retrying with /usr/bin/g++"; CXX=/usr/bin/g++ CC=/usr/bin/gcc build; } \
    || { tail -60 "$out/build.txt"; exit 1; }
python3 -m parallel_layers.info

step "CUDA tests"
# Eight worker processes (pytest-xdist, where installed): a crash takes down one worker, reported
# with its test, not the whole run.
xdist=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
timeout 360 python3 -m pytest -p no:cacheprovider -q -o addopts="-ra" -m "not slow" -k "cuda or gpu" $xdist \
    tests/ops tests/zero/test_zero.py tests/test_fused.py tests/tensor_parallel/test_vocab.py \
    tests/test_activation_checkpointing.py tests/test_bad_inputs.py > "$out/pytest.txt" 2>&1
echo "pytest exit: $?"; grep -v "^SKIPPED" "$out/pytest.txt" | tail -30

step "compute-sanitizer memcheck"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
    --print-limit 20 python3 tools/cuda_probe.py 2>&1 | tail -40
echo "memcheck exit: $?"

step benchmarks
# what a benchmark that fails here would otherwise leave: the committed CPU results of the same name
rm -f benchmarks/results/gpu_*.json benchmarks/results/bench_shard_copy.json
timeout 150 python3 benchmarks/bench_linear_gelu.py --device cuda --reps 10 --name gpu_linear_gelu 2>&1 | tail -30
timeout 150 python3 benchmarks/bench_linear_swiglu.py --device cuda --reps 10 --name gpu_linear_swiglu \
    --shapes 512,512,1376 4096,4096,11008 8192,4096,14336 2>&1 | tail -30
timeout 60 python3 benchmarks/bench_rms_norm.py --device cuda --name gpu_rms_norm 2>&1 | tail -20
timeout 60 python3 benchmarks/bench_shard_copy.py --device cuda 2>&1 | tail -20  # writes bench_shard_copy.json
timeout 120 python3 benchmarks/bench_op_overhead.py --device cuda --name gpu_op_overhead 2>&1 | tail -6
save_results

step "kernel profile"
timeout 120 python3 tools/cuda_profile_ops.py > "$out/profile.txt" 2>&1; echo "profile exit: $?"

step "compute-sanitizer racecheck, synccheck"
# Last, so that a slow sanitizer cannot starve the benchmarks of the device time a lease has.
# The backward kernels sum over row lanes / warps in shared memory: hazards and barrier misuse.
# Every kernel is instrumented (the probe's shapes are small: ~20 s on an H100). With only ours
# (--kernel-name kns=parallel_layers) racecheck failed inside cuBLAS's bfloat16 GEMMs on an H100
# ("Internal Sanitizer Error: ... failed to handle a hardware exception", then
# CUBLAS_STATUS_EXECUTION_FAILED), a failure of the tool: the same probe instrumented whole ran clean.
for tool in racecheck synccheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
        --print-limit 20 python3 tools/cuda_probe.py 2>&1 | tail -15
    echo "$tool exit: $?"
done

step "residual add in the norm or apart (one RMSNorm, forward + backward)"
timeout 60 python3 tools/residual_add_probe.py 2>&1 | grep " x \|rows"

step "Hugging Face Llama step, plain vs fused"
# After the sanitizers: a model-level number, less urgent than the kernels' checks.
timeout 120 python3 benchmarks/bench_fused_hf.py --device cuda --hidden 1024 2048 --seq 1024 --reps 10 \
    --name gpu_fused_hf 2>&1 | grep -v "^Loading\|^Writing" | tail -8
save_results

step done
