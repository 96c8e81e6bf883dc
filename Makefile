# `make demo` and `make test` work on a fresh clone: they create .venv, install torch pinned first
# (override for a CUDA build: `make test TORCH="torch==2.13.0 --index-url <your index>"`), then
# the package with its test and MPI extras.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH)' | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-all smoke-lowest lint format docs bench bench-quick clean gpu-check mutants

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(TORCH_STAMP): | $(PY)
	$(PY) -m pip install $(TORCH)
	touch $@

$(STAMP): pyproject.toml $(TORCH_STAMP)
	$(PY) -m pip install -e ".[test,mpi]"
	touch $@

install: $(STAMP)

demo: install
	$(PY) recipes/train_lm.py fit --config lstm_demo

# pytest exits 5 when it collected nothing: a misconfigured suite, reported as a failure.
test: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

test-all: install
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# The mutant zoo (tests/mutants/zoo.py), not part of `make test`: each one-line mutant of the package is
# applied in turn to a copy of the repository, and its tests (the reference's replays, the mutant's own,
# the quick matrix cases) must fail there; tests/mutants/results/ gets the table. About 35 min on 2 cores.
# One mutant: `make mutants MUTANTS_ARGS="--only pseudo_gradient_sign --out /tmp/m"`.
MUTANTS_ARGS ?=
mutants: install
	$(PY) tests/mutants/run.py $(MUTANTS_ARGS)

# On a machine with a CUDA GPU (and a CUDA build of torch: TORCH=...): every test marked cuda (one
# GPU, NCCL ranks on it; skipped tests mean no GPU was found), then one short run of every scheme,
# unsharded and shard="fsdp", with the device's peak memory at a sync step (a table).
gpu-check: install
	$(PY) -m pytest -m cuda tests/cuda -v -rs $(PYTEST_ARGS)
	$(PY) benchmarks/gpu_check.py

# The lowest supported Lightning (pyproject's bound), without the [mpi] extra, in its own virtual
# environment: a short subset of the suite (CI runs it after `make test`; a few minutes).
LOWEST_LIGHTNING ?= 2.6.0
LOW_VENV ?= .venv-lowest
SMOKE_TESTS ?= tests/test_install.py tests/test_fabric.py tests/strategies tests/test_bad_configuration.py \
	tests/test_cli.py tests/recipes/test_train_lm.py tests/multiprocess/test_allreduce_ranks.py \
	tests/multiprocess/test_fabric_ranks.py tests/multiprocess/test_checkpoint_ranks.py
smoke-lowest:
	$(PYTHON) -m venv $(LOW_VENV)
	$(LOW_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOW_VENV)/bin/python -m pip install $(TORCH)
	$(LOW_VENV)/bin/python -m pip install -e ".[test]" "lightning==$(LOWEST_LIGHTNING)"
	COMMSTRATS_EXPECT_LIGHTNING=$(LOWEST_LIGHTNING) $(LOW_VENV)/bin/python -m pytest -m "not slow" $(SMOKE_TESTS)

# The standard race on an emulated cluster at 100 and 1000 Mbit/s, two seeds (network namespaces;
# needs root, else loopback), then ring all-reduce bytes for 2, 4 and 8 ranks. Hours on 2 cores.
bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/compare.py $(BENCH_ARGS)
	$(PY) benchmarks/compare.py --scaling --rates 1000

# A smoke run of the race: loopback, tiny model, 2 ranks, one seed, seconds per entry.
bench-quick: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/compare.py --quick --seeds 0 $(BENCH_ARGS)

# The documentation site (Sphinx: the API reference from the docstrings, the recipes, the benchmarks'
# tables and plots, the notebooks from their committed outputs) into docs/_build/html/index.html.
# Warnings are errors, as in CI; -E re-reads every page so that each build reports all of them.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[docs]"
	touch $@

docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -E -b html docs docs/_build/html

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(LOW_VENV) .pytest_cache .ruff_cache lightning_logs docs/_build docs/notebooks
