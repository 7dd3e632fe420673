#!/usr/bin/env bash
# Runs a benchmark with JAX on a GPU machine whose Python has jax (CUDA), flax, optax and
# orbax but may lack pure-Python packages and the network: wheels carried in .wheels/
# (tensorboardX: `.venv/bin/pip download --no-deps -d .wheels tensorboardX`) are installed
# from there first.
#
# Usage: bash benchmarks/gpu.sh [SCRIPT [ARGS...]]   (default: benchmarks/suite.py --no-peers)
#        bash benchmarks/gpu.sh --test [PYTEST ARGS...]   (the test suite: `make test-gpu`)
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".wheels/*.whl" >/dev/null; then
  python3 -m pip install --quiet --no-index --no-deps .wheels/*.whl
fi
python3 -c 'import jax, tensorboardX, yaml; print("devices:", jax.devices(), "jax", jax.__version__, file=__import__("sys").stderr)'
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
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
