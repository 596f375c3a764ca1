# hvd_lars: `make train` runs the main job, `make test` the test suite; both set everything up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
FLAGFILE ?= flags/fashion_mnist_lars.flags
# pytest-xdist workers for make test: one per core (tests/conftest.py says how the tests are grouped).
TEST_WORKERS ?= $(shell nproc)
# The run directory (--run_name; default the flagfile's) and the record written from its summary.json. A
# finished run resumes as complete: `make train RUN_NAME=another` trains again in a new directory.
RUN_NAME ?= $(shell sed -n 's/^--run_name=//p' $(FLAGFILE))
RECORD ?= results/$(basename $(notdir $(FLAGFILE))).md

# Quiet TensorFlow's C++ INFO lines; let Open MPI run as root (containers, CI).
export TF_CPP_MIN_LOG_LEVEL ?= 2
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
export PYTHONUNBUFFERED ?= 1

.PHONY: setup train test lint format clean

setup:
	bash install/setup.sh

train: setup
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) $(PY) -m hvd_lars.main --flagfile=$(FLAGFILE) \
		--run_name=$(RUN_NAME)
	$(PY) -m benchmarks.record_run results/runs/$(RUN_NAME)/summary.json $(RECORD) \
		"make train FLAGFILE=$(FLAGFILE) NP=$(NP)"
	@echo "record: $(RECORD)"

test: setup
	bash install/test_services.sh
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -v -rs --durations=40 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf results/runs .pytest_cache
