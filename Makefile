# hvd_lars: `make train` runs the main job, `make test` the test suite; both set everything up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
FLAGFILE ?= flags/fashion_mnist_lars.flags
# pytest-xdist workers for make test: one per core (tests/conftest.py says how the tests are grouped).
TEST_WORKERS ?= $(shell nproc)
# The run directory (--run_name; default the flagfile's). A finished run resumes as complete:
# `make train RUN_NAME=another` trains again in a new directory.
RUN_NAME ?= $(shell sed -n 's/^--run_name=//p' $(FLAGFILE))
# Where the run directories go (--workdir).
WORKDIR ?= results/runs
# The run's record, in its own directory: the committed results/<flagfile>.md changes only by
# `python -m benchmarks.record_run` (its docstring).
RECORD ?= $(WORKDIR)/$(RUN_NAME)/record.md
# The data folder (--data_dir; empty: the data set's default, Debian's /usr/share/datasets/fashion-mnist for
# Fashion-MNIST). For a Fashion-MNIST flagfile it is also the folder install/setup.sh checks for the files.
DATA_DIR ?=
DATASET := $(or $(shell sed -n 's/^--dataset=//p' $(FLAGFILE)),fashion_mnist)
# More flags for the main program, after the flagfile's (they override it), e.g. TRAIN_FLAGS="--epochs=2".
TRAIN_FLAGS ?=

# TensorFlow's C++ INFO and WARNING lines left out (its start-up notices are, by hvd_lars.quiet_tensorflow,
# in any case; TF_CPP_MIN_LOG_LEVEL=0 shows them all); let Open MPI run as root (containers, CI).
export TF_CPP_MIN_LOG_LEVEL ?= 2
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
# Time for the ranks' stop checkpoint when mpirun is signalled (launch/env.sh says why).
export OMPI_MCA_odls_base_sigkill_timeout ?= 10
export PYTHONUNBUFFERED ?= 1

.PHONY: setup train test test-quick test-backends check-docs lint format clean

setup:
	$(if $(and $(DATA_DIR),$(filter fashion_mnist,$(DATASET))),FASHION_MNIST_DIR=$(DATA_DIR)) bash install/setup.sh

# The standard error of a command whose own import of TensorFlow is not the main program's (horovodrun's
# build check, record_run) without TensorFlow's start-up notices, as the ranks start (hvd_lars/quiet_tensorflow.py).
QUIET := 2> >($(PY) hvd_lars/quiet_tensorflow.py >&2)

train: setup
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) $(PY) -m hvd_lars.main --flagfile=$(FLAGFILE) \
		--run_name=$(RUN_NAME) --workdir=$(WORKDIR) $(if $(DATA_DIR),--data_dir=$(DATA_DIR)) $(TRAIN_FLAGS) $(QUIET)
	$(PY) -m benchmarks.record_run --summary=$(WORKDIR)/$(RUN_NAME)/summary.json --out=$(RECORD) \
		--command="make train FLAGFILE=$(FLAGFILE) NP=$(NP)$(if $(DATA_DIR), DATA_DIR=$(DATA_DIR))$(if $(TRAIN_FLAGS), TRAIN_FLAGS='$(TRAIN_FLAGS)')" $(QUIET)
	@echo "record: $(RECORD)"

test: setup
	bash install/test_services.sh
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -v -rs --durations=40 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
	bash install/backends.sh

# The README's code and commands as written, and its figures against results/ (checks/, with the tests'
# tiers and fixtures).
check-docs: setup
	bash install/test_services.sh
	$(PY) -m pytest -p tests.conftest -v -rs --durations=20 -n $(TEST_WORKERS) --dist loadgroup checks

# The library on Keras's JAX and PyTorch backends, each in an environment without TensorFlow (.venv-backends/).
test-backends:
	bash install/backends.sh

# The unit tier (no subprocess): the edit-test loop's few minutes.
test-quick: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m unit -n $(TEST_WORKERS) --dist loadgroup

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf results/runs .pytest_cache
