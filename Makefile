# `make test` and `make bench` create or reuse .venv and install what they
# need; constraints.txt pins every package, so a fresh machine gets the same set.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The backends CI expects: a test for one of these that cannot import it fails.
EXPECT_BACKENDS ?= numpy,torch,jax,tensorflow,keras

.PHONY: setup test test-fast test-gpu typecheck docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "Installing mixedpolicy, the four frameworks and the test and docs tools into $(VENV)"
	@echo "(pinned by constraints.txt; a few minutes the first time, nothing after that)..."
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[all,test,docs]"
	@# keras-hub's requirements would pull tensorflow-text and the full tensorflow wheel beside
	@# tensorflow-cpu; what it imports is installed above, so it goes in without its requirements
	$(PY) -m pip install --quiet --no-deps -c constraints.txt keras-hub
	@# timm imports torchvision, and the registry's torchvision is a CUDA build whose operators do
	@# not load beside the CPU torch; in the venv it would stop transformers' import too. Both go to
	@# $(VENV)/zoo, off the venv's path: tests/zoo_helper.py adds it for the tests that use timm
	$(PY) -m pip install --quiet --no-deps --upgrade -c constraints.txt --target $(VENV)/zoo timm torchvision
	touch $(STAMP)

# Two pytest workers (pytest-xdist): many tests wait on a process of their own (a Keras
# backend, two DDP ranks, a doc block), so both cores of a CI machine stay busy; work
# stealing, since a few tests take a minute and most a second.
JOBS ?= 2

test: setup typecheck docs
	MIXEDPOLICY_EXPECT_BACKENDS=$(EXPECT_BACKENDS) $(PY) -m pytest -q -n $(JOBS) --dist worksteal $(PYTEST_ARGS)

# The suite without the tests that start processes of their own (marked slow).
test-fast: setup
	MIXEDPOLICY_EXPECT_BACKENDS=$(EXPECT_BACKENDS) $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The public API and the core, type-checked (mypy; settings in pyproject.toml).
typecheck: setup
	$(PY) -m mypy

# The docs site (MkDocs + mkdocstrings), warnings as errors; written to site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The checks only a CUDA GPU can make (marked gpu; they skip on a machine without one).
test-gpu: setup
	MIXEDPOLICY_EXPECT_BACKENDS=$(EXPECT_BACKENDS) $(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# The framework comparison on its built-in default (digits MLP, every installed
# framework, three policies); BENCH_ARGS passes options, e.g. BENCH_ARGS="--frameworks torch".
bench: setup
	$(PY) -m mixedpolicy bench --out bench-results $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist site *.egg-info .mypy_cache
