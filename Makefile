# Two entry points for a fresh machine: `make demo` and `make test`. Both build .venv once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.parallel_lab-installed
# DeepSpeed JIT-compiles a C++ op on first use (~30-60 s each; none of the strategies here needs
# one: docs/facts.md); a config that asks for one (FusedAdam, CPU Adam) caches it inside .venv.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo lint test test-all venv clean bench

venv: $(STAMP)

# torch goes in FIRST and pinned (CPU wheel on disk); then the project with every extra.
# DS_BUILD_OPS=0: DeepSpeed builds its ops lazily at first use instead of at install.
# --no-compile: pip would compile every file of every package on one core (56 s of installing;
# compileall on both cores 16 s more). Instead, one import of what every run imports writes their
# bytecode here (~7 s), so the first run after installing starts as fast as the next; any other
# module writes its own at its first import (below; docs/testing.md). torch's part is written on the
# other core while pip fetches the rest (mostly waiting on the index); the last import finishes it
# whatever that one met (it ignores its outcome: a package half-installed beside it, say).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -c constraints.txt torch==2.13.0 numpy setuptools wheel
	$(PY) -c "import torch._dynamo, torch.distributed" > /dev/null 2>&1 & warm=$$!; \
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-compile --no-build-isolation -c constraints.txt -e ".[all,dev]"; \
	status=$$?; wait $$warm; exit $$status
	$(PY) -c "import torch._dynamo, torch.distributed, deepspeed, hydra, parallel_lab.worker.main"
	touch $@

# Bytecode is written at first import: a machine that sets PYTHONDONTWRITEBYTECODE (this one does)
# would otherwise compile torch again in every process (6.0 s of imports against 2.2 s, measured).
unexport PYTHONDONTWRITEBYTECODE

demo: $(STAMP)
	$(PY) -m parallel_lab +experiment=compare_all

# ruff (settings in pyproject.toml, version in constraints.txt): lint, then formatting, checked only.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# make test: lint, then every README claim (each strategy's parity, every launcher, checkpoint/resume,
# the bad-input catalogue), then one float comparison per kind of verdict (tests/support/dispatch.py:
# the parity criterion, each family of kernels, the 16-bit tolerance, the construction bits) once more
# under a foreign CPU dispatch (every kernel library on another instruction set: docs/facts.md), so
# that no verdict depends on the CPU it ran on; under 10 minutes on 2 cores. make test-all adds the
# extra matrices and runs every parity/floats test under the foreign dispatch.
# oneDNN on AVX2, not SSE4.1: the reported failing CPU class (AMD EPYC, AVX2), and 37 s shorter (SSE4.1
# runs the convolutions several times slower); bench parity_robustness covers SSE4.1 among all 18.
# Which float comparisons the second pass leaves out, and why: docs/testing.md; it collects only their files.
FOREIGN_DISPATCH := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
# Two test processes side by side (pytest-xdist), each test file whole in one of them (its module
# fixtures train once): one process alone leaves a core idle while it composes configs or waits on its
# ranks (docs/testing.md#how-long). TEST_WORKERS=0 runs the suite in this one process. Files go out
# longest first (tests/conftest.py LONGEST_FIRST), not by their count of tests.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: lint
	$(PY) -m pytest -q $(XDIST) --durations=15 -m "not extra"
	env $(FOREIGN_DISPATCH) $(PY) -m pytest -q $(XDIST) --durations=5 -p no:cacheprovider -m "dispatch and not extra" \
		$$($(PY) -m tests.support.dispatch)

test-all: lint
	$(PY) -m pytest -q $(XDIST) --durations=15
	env $(FOREIGN_DISPATCH) $(PY) -m pytest -q $(XDIST) --durations=5 -p no:cacheprovider -m "parity or floats"

clean:
	rm -rf $(VENV) runs outputs multirun
