#!/usr/bin/env bash
# Runs a benchmark with JAX on a GPU machine whose Python has jax (CUDA), flax, optax and
# orbax but may lack pure-Python packages and the network: wheels carried in .wheels/
# (`make wheels`) are installed from there first. No JAX process preallocates the GPU's
# memory (XLA_PYTHON_CLIENT_PREALLOCATE=false, unless set): several share it.
#
# Usage: bash benchmarks/gpu.sh [SCRIPT [ARGS...]]   (default: benchmarks/suite.py --no-peers)
#        bash benchmarks/gpu.sh --test [PYTEST ARGS...]   (the test suite: `make test-gpu`)
#        bash benchmarks/gpu.sh check   (the GPU check, benchmarks/gpu_check.py: at most 6 minutes; ONE
#                                         result file, $OUT/gpu-check.md; logs and runs in a scratch
#                                         directory under /tmp. GPU_CHECK_SMALL=1: tiny models, to try it
#                                         on a CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
if [ "${1-}" = "check" ]; then
  shift
  scratch=$(mktemp -d /tmp/jaxmon-gpu-check.XXXX)  # nothing but the result goes to $OUT
  exec python3 benchmarks/gpu_check.py --out "${OUT:-$scratch}" --scratch "$scratch" "$@"
fi
if compgen -G ".wheels/*.whl" >/dev/null && ! python3 -m pip install --quiet --no-index --no-deps .wheels/*.whl \
    2>/dev/null; then  # one by one: name each wheel that does not fit this Python, install the rest
  for wheel in .wheels/*.whl; do
    python3 -m pip install --quiet --no-index --no-deps "$wheel" >/dev/null 2>&1 || echo "gpu.sh: could not" \
      "install $wheel into $(python3 -V): built for another Python? (make wheels WHEELS_PYTHON=...)" >&2
  done
fi
python3 -c 'import jax, tensorboardX, yaml; print("devices:", jax.devices(), "jax", jax.__version__, file=__import__("sys").stderr)'
if [ "${1-}" = "--test" ]; then
  shift
  # Installed (no dependencies, none fetched): the tests also run the `jaxmon` command.
  python3 -m pip install --quiet --no-deps --no-build-isolation -e . || { echo "gpu.sh: could not install" \
    "jaxmon with this python3's setuptools (pyproject.toml needs >= 77): carry one in .wheels/ with" \
    "\`.venv/bin/pip download --no-deps -d .wheels 'setuptools>=77'\`" >&2; exit 1; }
  export JAX_PLATFORMS=  # JAX's default platforms; tests/conftest.py would pin the CPU
  exec python3 -m pytest -q "$@"
fi
if [ "$#" -eq 0 ]; then set -- benchmarks/suite.py --no-peers; fi
exec python3 "$@"
