#!/usr/bin/env bash
# Runs a benchmark with JAX on a GPU machine whose Python has jax (CUDA), flax, optax and
# orbax but may lack pure-Python packages and the network: wheels carried in .wheels/
# (tensorboardX: `.venv/bin/pip download --no-deps -d .wheels tensorboardX`) are installed
# from there first. No JAX process preallocates the GPU's memory
# (XLA_PYTHON_CLIENT_PREALLOCATE=false, unless set): several share it.
#
# Usage: bash benchmarks/gpu.sh [SCRIPT [ARGS...]]   (default: benchmarks/suite.py --no-peers)
#        bash benchmarks/gpu.sh --test [PYTEST ARGS...]   (the test suite: `make test-gpu`)
#        bash benchmarks/gpu.sh check   (the GPU check: each part under its own time limit, logs in
#                                         $OUT or /tmp/jaxmon-gpu-check, one table at the end; about 8
#                                         minutes; GPU_CHECK_SMALL=1: a tiny transformer, to try it on a CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".wheels/*.whl" >/dev/null; then
  python3 -m pip install --quiet --no-index --no-deps .wheels/*.whl
fi
python3 -c 'import jax, tensorboardX, yaml; print("devices:", jax.devices(), "jax", jax.__version__, file=__import__("sys").stderr)'
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
if [ "${1-}" = "--test" ]; then
  shift
  # Installed (no dependencies, none fetched): the tests also run the `jaxmon` command.
  python3 -m pip install --quiet --no-deps --no-build-isolation -e . || { echo "gpu.sh: could not install" \
    "jaxmon with this python3's setuptools (pyproject.toml needs >= 77): carry one in .wheels/ with" \
    "\`.venv/bin/pip download --no-deps -d .wheels 'setuptools>=77'\`" >&2; exit 1; }
  export JAX_PLATFORMS=  # JAX's default platforms; tests/conftest.py would pin the CPU
  exec python3 -m pytest -q "$@"
fi
if [ "${1-}" = "check" ]; then
  out="${OUT:-/tmp/jaxmon-gpu-check}"
  mkdir -p "$out" && : > "$out/status"
  python3 -m pip install --quiet --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
    || echo "gpu.sh: installing the checkout failed (see $out/install.log); the parts run from PYTHONPATH" >&2
  export JAX_PLATFORMS=  # JAX's default platforms: the GPU
  part() {  # part NAME SECONDS COMMAND...: one part under its own limit, its output kept whatever happens
    local name=$1 limit=$2; shift 2
    echo "gpu.sh check: $name (at most ${limit} s)" >&2
    local started=$SECONDS code=0
    timeout "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err" || code=$?
    echo "$name $code $((SECONDS - started))" >>"$out/status"
  }
  if [ "${GPU_CHECK_SMALL-}" = 1 ]; then
    model=(--override model.num_layers=1 --override model.embed_dim=32 --override model.mlp_dim=64)
  else  # 6 x 512, sequences of 256: seconds to compile, milliseconds a step
    model=(--override model.num_layers=6 --override model.embed_dim=512 --override model.mlp_dim=2048
           --override model.num_heads=8 --override model.max_len=256 --override data.seq_len=256
           --override data.batch_size=32)
  fi
  part tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts= \
    "tests/metrics/test_accumulators_in_session.py::test_the_default_set_with_logging_and_nan_checks_dispatches_runs_without_waiting" \
    "tests/run/test_steps_per_dispatch.py::test_a_1000_step_run_with_the_usual_hooks_compiles_one_program_per_run_length_at_most" \
    "tests/run/test_scan_unroll.py::test_a_run_whose_program_compiles_in_the_background_runs_step_by_step_meanwhile"
  part host_cost 60 python3 benchmarks/host_cost.py --rounds 2 --steps 500 --trigger_cycles 10
  part transformer_f32 90 python3 benchmarks/transformer_overhead.py --steps 30 --cycles 6 --warmup 40 "${model[@]}"
  part transformer_bf16 90 python3 benchmarks/transformer_overhead.py --steps 30 --cycles 6 --warmup 40 \
    "${model[@]}" --override model.dtype=bfloat16
  if [ "${GPU_CHECK_SMALL-}" = 1 ]; then
    gpt2=(--config.model.num_layers=1 --config.model.embed_dim=32 --config.model.num_heads=2 --config.model.mlp_dim=64
          --config.data.seq_len=64 --config.model.max_len=64)
  else
    gpt2=()
  fi
  rm -rf "$out/gpt2_small_run"  # a fresh start: its time to the first step, then tokens/s and MFU
  part gpt2_small 120 python3 -m jaxmon train --config configs/gpt2_small.py --workdir "$out/gpt2_small_run" \
    --config.steps=100 --config.optimizer.learning_rate.decay_steps=100 --config.optimizer.learning_rate.warmup_steps=10 \
    --config.perf.every_n_steps=50 "${gpt2[@]}"
  exec python3 - "$out" <<'TABLE'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
print("| part | exit | seconds | figures |\n|---|---|---|---|")
for name, code, secs in (line.split() for line in (out / "status").read_text().splitlines()):
    text = (out / f"{name}.out").read_text()
    if name == "tests":
        figures = (re.findall(r"\d+ (?:passed|failed)[^\n]*", text) or ["no summary"])[-1]
    elif name == "gpt2_small":  # its log: the start-up line and the last perf line
        log = (out / f"{name}.err").read_text()
        lines = re.findall(r"(Step 1 after [\d.]+ s)|perf at step \d+: (.*)", log)
        figures = "; ".join(part for found in lines[:1] + lines[-1:] for part in found if part) or "no perf line"
    else:
        try:
            report = json.loads(text[text.index("{"):])
            figures = json.dumps(report.get("ratio_to_bare") or report.get("ratio_to_bare_jit"))
            figures += " us/step " + json.dumps(report.get("median_us_per_step"))
        except ValueError:
            figures = "no report (see the .err log)"
    print(f"| {name} | {code}{' (time limit)' if code == '124' else ''} | {secs} | {figures} |")
TABLE
fi
if [ "$#" -eq 0 ]; then set -- benchmarks/suite.py --no-peers; fi
exec python3 "$@"
