# jaxmon: `make train` and `make test` set themselves up in .venv/ from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: install test test-loaded test-gpu wheels train lint bench bench-peers clean

install: $(STAMP)

# ml_dtypes 0.7.0 (which JAX imports) takes 0.55 s of CPU to import against NumPy 2: it adds
# its ufunc loops one at a time, each a search of those before. Every `jaxmon` command and
# every JAX process of a run pays it; a 20-step `jaxmon train` of an MLP takes 1.6 s without.
$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "jaxmon needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' 'ml_dtypes!=0.7.0'
	@touch $(STAMP)

# Three workers, a test file each at a time (a file's tests share its compiled fixtures):
# many tests wait on child processes or sleep (a late peer, a hung one), so on two cores two
# workers kept 1.55 cores busy (13:15) and three keep 1.81 (11:49). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
PYTEST = $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
# The bytecode of this checkout's Python, written first: where PYTHONDONTWRITEBYTECODE is set
# (container images often set it) every one of the suite's ~280 JAX processes would compile
# jaxmon's source again on import, 0.15 s of CPU each. Only what changed is compiled again.
# A file that does not compile is named here, and then by the test that imports it.
BYTECODE = $(PY) -m compileall -q jaxmon tests benchmarks examples configs || true
test: $(STAMP)
	$(BYTECODE)
	$(PYTEST)

# The same suite with two CPU-bound processes beside it (a busy machine), which .ci/loaded.py
# starts and stops however the suite ends: the timing of no test may depend on a quiet machine.
test-loaded: $(STAMP)
	$(BYTECODE)
	$(PY) .ci/loaded.py $(PYTEST)

# The suite on a GPU machine whose python3 has jax (CUDA), flax, optax, orbax, pytest,
# pytest-xdist, tensorboard and pyyaml but no network (no .venv there), on JAX's default
# platforms: the GPU, with the CPU beside it. 12 workers share the GPU, none preallocating
# its memory (gpu.sh and tests/conftest.py set XLA_PYTHON_CLIENT_PREALLOCATE=false), so that
# the suite ends within 5 minutes on a 16-core H200 machine (8 workers ran 71% of it in
# 150 s there). Carry .wheels/ there, filled here by `make wheels`: the rest is installed
# from it. See benchmarks/gpu.sh.
GPU_TEST_WORKERS ?= 12
test-gpu:
	bash benchmarks/gpu.sh --test -n $(GPU_TEST_WORKERS) --dist loadfile

# What `make test-gpu` installs from on a machine without network: the packages such an
# image lacks (tensorboardX; grain and matplotlib for their tests, with what they need
# beyond JAX's own), and a setuptools that can install this checkout (pyproject.toml
# needs >= 77). About 25 MB, built for that machine's Python (3.12) on x86-64 Linux:
# `make wheels WHEELS_PYTHON=3.11` for a venv here that stands for it. Replaces .wheels/.
WHEELS = tensorboardX grain array_record dm-tree cloudpickle more-itertools portpicker matplotlib contourpy \
	cycler fonttools kiwisolver pillow pyparsing python-dateutil six 'setuptools>=77'
WHEELS_PYTHON ?= 3.12
WHEELS_PLATFORMS = $(foreach tag,manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014,\
	--platform $(tag)_x86_64)
wheels: $(STAMP)
	rm -rf .wheels
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(WHEELS_PYTHON) \
	  $(WHEELS_PLATFORMS) -d .wheels $(WHEELS)

train: $(STAMP)
	$(VENV)/bin/jaxmon train --config configs/default.py --workdir runs/default

# Every benchmark with the settings of benchmarks/RESULTS.md (tens of minutes; JSON on stdout).
bench: $(STAMP)
	$(PY) benchmarks/core_overhead.py --steps 2000 --repeats 9
	$(PY) benchmarks/host_cost.py --rounds 7
	$(PY) benchmarks/trigger_pair.py --base baa03a3 --rounds 4 --cycles 30
	$(PY) benchmarks/step_pair.py --base baa03a3 --rounds 5 --cycles 20 --steps 500
	$(PY) benchmarks/step_parts.py --cycles 20 --steps 500
	$(PY) benchmarks/hooks_overhead.py --steps 2000 --rounds 21
	$(PY) benchmarks/steps_per_dispatch.py --rounds 11
	$(PY) benchmarks/steps_per_dispatch.py --workload large --steps 320 --rounds 11
	$(PY) benchmarks/nan_check_designs.py --rounds 21
	$(PY) benchmarks/checkpoint_save.py --rounds 21
	$(PY) benchmarks/agreement_cost.py --steps 300 --rounds 7
	$(PY) benchmarks/orbax_save_floor.py --saves 15
	$(PY) benchmarks/memory.py --rounds 5
	$(PY) benchmarks/suite.py --rounds 7
	$(PY) benchmarks/suite.py --workload large --rounds 5

# The peers of benchmarks/suite.py, each in its own environment under $(PEERS):
# Keras 3 on JAX and TF 1.x, each with tensorflow-cpu and tensorboard, the implementation
# of tf.summary that TF no longer brings (without it Keras's TensorBoard callback fails:
# TBNotInstalledError). One that cannot be installed is skipped with a message; one that
# fails in the suite is reported in its row.
PEERS := .venv-peers
# An environment's stamp; -2: with tensorboard (an environment made before gets it added).
PEER_STAMP := .installed-2
JAX_VERSION = $(shell $(PY) -c 'import jax; print(jax.__version__)')

bench-peers: $(STAMP)
	@test -f $(PEERS)/keras/$(PEER_STAMP) || { $(PYTHON) -m venv $(PEERS)/keras \
	  && $(PEERS)/keras/bin/pip install --quiet keras jax==$(JAX_VERSION) tensorflow-cpu tensorboard \
	  && touch $(PEERS)/keras/$(PEER_STAMP); } \
	  || echo "bench-peers: could not install keras, jax, tensorflow-cpu and tensorboard into $(PEERS)/keras; skipping Keras"
	@test -f $(PEERS)/tf/$(PEER_STAMP) || { $(PYTHON) -m venv $(PEERS)/tf \
	  && $(PEERS)/tf/bin/pip install --quiet tensorflow-cpu tensorboard && touch $(PEERS)/tf/$(PEER_STAMP); } \
	  || echo "bench-peers: could not install tensorflow-cpu and tensorboard into $(PEERS)/tf; skipping TF 1.x"
	$(PY) benchmarks/suite.py --rounds 7 --peers-dir $(PEERS)
	$(PY) benchmarks/suite.py --workload large --rounds 5 --peers-dir $(PEERS)

lint: $(STAMP)
	$(PY) -m ruff check jaxmon tests examples benchmarks configs

clean:
	rm -rf $(VENV) $(PEERS) runs .pytest_cache
