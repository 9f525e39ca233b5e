# dynbatchd: the commands a newcomer needs.
#   make run    install into .venv and run the daemon on the bundled model
#   make test   install into .venv and run the test suite
#   make bench  run the benchmarks (figures go to stdout and benchmarks/results/)
#   make bench-gpu  the shipped model's offline curve on a CUDA device (exits 0 without one)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= etc/dynbatchd.toml

# An unpinned torch pulls a multi-GB CUDA build: pin the CPU build where no NVIDIA driver is present.
HAVE_NVIDIA := $(shell test -e /proc/driver/nvidia/version && echo yes)
TORCH_CONSTRAINT := $(if $(HAVE_NVIDIA),,-c constraints-cpu.txt)

.PHONY: install run test bench bench-gpu clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_CONSTRAINT) -e '.[test]'
	touch $@

run: install
	HF_HUB_OFFLINE=1 $(BIN)/dynbatchd start --config $(CONFIG)

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.run_all

bench-gpu: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.gpu

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
