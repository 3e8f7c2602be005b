# The two front-door commands:  make test  and  make demo  (each sets everything up first).
#
#   make test        venv + pinned deps, build the extension (CUDA kernels when nvcc is found),
#                    C++ tests (ctest), Python tests (pytest, without those marked slow)
#   make test-slow   the tests marked slow only; make test-all: everything
#   make demo        venv + build, then the main jobs: a GPT trained on 4 local processes
#                    (dp=2 x tp=2, ZeRO-1; torchrun, gloo), then on 8 (dp=2 x tp=2 x pp=2,
#                    1F1B), each checked against one process; a Hugging Face Llama fine-tuned
#                    at dp=2 x tp=2 ZeRO-3 (examples/finetune_hf.py), checked, exported, reloaded
#   make wheel       dist/parallel_layers-*.whl
#   make info        python -m parallel_layers.info
#   make test-cpu-torch   build + test against the CPU-only torch 2.13.0 wheel in .venv-cpu (the wheel
#                         pip finds; TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu where that is a CUDA one)
#
# PARALLEL_LAYERS_FORCE_CPU=1, PARALLEL_LAYERS_CUDA_ARCHS=80;90+PTX and MAX_JOBS=N pass through.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CMAKE_BUILD := build/cmake
NPROC := $(shell nproc 2>/dev/null || echo 2)
export MAX_JOBS ?= $(NPROC)

.PHONY: test test-slow test-all demo build cpp-test pytest wheel info test-cpu-torch clean

test: build cpp-test pytest

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

build: $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace

cpp-test: $(STAMP)
	$(VENV)/bin/cmake -S . -B $(CMAKE_BUILD) -G Ninja -DCMAKE_MAKE_PROGRAM=$(CURDIR)/$(VENV)/bin/ninja \
		$$($(PY) tools/build_env.py --cmake-args) > $(CMAKE_BUILD).configure.log 2>&1 \
		|| (cat $(CMAKE_BUILD).configure.log; exit 1)
	$(VENV)/bin/cmake --build $(CMAKE_BUILD)
	$(VENV)/bin/ctest --test-dir $(CMAKE_BUILD) --output-on-failure

pytest: build
	$(PY) -m pytest

# The tests marked slow (pyproject.toml: repeated exit races, the CPU-only build, more example
# runs under torchrun), which `make test` leaves out; test-all runs everything.
test-slow: build
	$(PY) -m pytest -m slow

test-all: build cpp-test
	$(PY) -m pytest -m "slow or not slow"

demo: build
	PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 4 \
		examples/train_gpt.py --dp 2 --tp 2 --zero 1 --steps 60
	PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 8 \
		examples/train_gpt.py --dp 2 --tp 2 --pp 2 --schedule 1f1b --microbatches 4 --steps 30
	PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 4 \
		examples/finetune_hf.py --dp 2 --tp 2 --zero 3 --steps 10

wheel: $(STAMP)
	$(PY) -m pip wheel --no-build-isolation --no-deps --wheel-dir dist .

info: build
	$(PY) -m parallel_layers.info

# A CPU-only torch (the 2.13.0 CPU wheel on this machine's disk): proves the CPU-only build.
test-cpu-torch:
	test -x .venv-cpu/bin/python || $(PYTHON) -m venv .venv-cpu
	.venv-cpu/bin/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_CPU_INDEX),--extra-index-url $(TORCH_CPU_INDEX)) \
		$$(grep -v -E '^(-r|torch|#)' requirements-dev.txt)
	.venv-cpu/bin/python -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else \
		'test-cpu-torch: pip installed torch ' + torch.__version__ + ', a CUDA build; give the CPU wheels: ' \
		'make test-cpu-torch TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu')"
	rm -rf build-cpu && mkdir -p build-cpu
	.venv-cpu/bin/python setup.py --quiet build_ext --inplace --build-temp build-cpu
	.venv-cpu/bin/python -m pytest tests -q
	$(MAKE) build  # put back the extension of the default venv

clean:
	rm -rf build build-cpu dist *.egg-info parallel_layers/_C*.so parallel_layers/_build_meta.py
