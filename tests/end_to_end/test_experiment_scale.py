"""Research scale from one config: `configs/lm.py` and `configs/lm_fsdp.py` through the
`jaxmon` command (train, check), a user's task beside a config, and the FSDP run on 8
simulated devices against one device and against two processes of 4 devices.

Every run is a real `jaxmon` process; the tests read back its checkpoints,
`metrics.jsonl` and what it printed.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from helpers import ROOT, cpu_env, kill_once_checkpointed, run_jaxmon

import jaxmon as jm

CONFIGS = os.path.join(ROOT, "configs")
#: A short lm run: 20 steps, a checkpoint and an evaluation every 10, the schedule over 20.
SHORT = ["--config.steps=20", "--config.session.save_checkpoint_steps=10", "--config.hooks.1.every_n_steps=10",
         "--config.optimizer.learning_rate.decay_steps=20", "--config.optimizer.learning_rate.warmup_steps=5",
         "--config.session.save_summaries_steps=5", "--config.model.num_layers=1"]


def jaxmon(*args, devices=None, timeout=600, env=None):
    """Runs `python -m jaxmon ARGS` on the CPU with `devices` simulated devices."""
    return run_jaxmon(args, cwd=ROOT, env=env or cpu_env(devices), timeout=timeout)


def final_params(workdir):
    """The parameters of the latest checkpoint in `workdir`, as host arrays by path."""
    state = jm.restore_checkpoint(workdir).state
    params = state["params"] if isinstance(state, dict) else state.params
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def eval_losses(workdir):
    """{step: eval/loss} from the run's metrics.jsonl."""
    losses = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "eval/loss" in record:
                losses[record["step"]] = record["eval/loss"]
    return losses


def train_losses(workdir):
    """{step: loss} of the training summaries in the run's metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


# -- jaxmon check ------------------------------------------------------------------------------


def test_check_prints_the_lm_configs_parameters_mesh_shardings_batch_memory_and_compile_time():
    done = jaxmon("check", "--config", "configs/lm.py", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for expected in ('"task": "lm"', "parameters:", "block_0", "total", "mesh: none (one device)",
                     "state.params['embed']['embedding']", "(128, 64)", "batch (global):", "x: (16, 64) int32",
                     "programs (compile time; memory per device):", "step, runs of 1 step", "argument",
                     "temp", "evaluation, one batch"):
        assert expected in out, (expected, out[-3000:])
    assert "runs of 4 steps" not in out  # one step per run: no scanned program


def test_check_lists_the_program_for_runs_of_steps_per_dispatch_steps_with_its_memory():
    done = jaxmon("check", "--config", "configs/lm.py", "--config.session.steps_per_dispatch=4", "--json",
                  timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    programs = {program["name"]: program for program in report["programs"]}
    assert list(programs) == ["step, runs of 1 step", "step, runs of 4 steps", "evaluation, one batch"]
    assert all(program["compile_secs"] > 0 for program in programs.values())
    one, four = (programs[f"step, runs of {n}"]["memory_per_device"] for n in ("1 step", "4 steps"))
    assert four["argument"] > one["argument"]  # four steps' batches
    assert report["compile_secs"] == programs["step, runs of 1 step"]["compile_secs"]


def test_check_and_a_short_training_in_bfloat16_from_the_command_line(tmp_path):
    done = jaxmon("check", "--config", "configs/lm.py", "--config.model.dtype=bfloat16", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"dtype": "bfloat16"' in done.stdout and "step, runs of 1 step" in done.stdout
    workdir = tmp_path / "bf16"
    done = jaxmon("train", "--config", "configs/lm.py", *SHORT, "--config.model.dtype=bfloat16",
                  "--workdir", str(workdir), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = train_losses(workdir)
    assert max(losses) == 20 and all(np.isfinite(list(losses.values())))
    assert losses[20] < losses[min(losses)]  # it learned in bfloat16
    assert {leaf.dtype for leaf in final_params(workdir).values()} == {np.dtype(np.float32)}  # param_dtype


def test_a_dtype_that_is_no_dtype_is_refused_with_its_name():
    done = jaxmon("check", "--config", "configs/lm.py", "--config.model.dtype=bf16", timeout=300)
    assert done.returncode == 2 and "dtype='bf16' is not a floating dtype" in done.stderr, done.stderr[-2000:]


@pytest.fixture(scope="module")
def fsdp_check():
    done = jaxmon("check", "--config", "configs/lm_fsdp.py", "--json", devices=8, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_check_of_the_fsdp_config_shows_parameters_and_optimizer_state_split_over_fsdp(fsdp_check):
    assert fsdp_check["mesh"] == {"data": 2, "fsdp": 4}
    sharding = {row["path"]: row["sharding"] for row in fsdp_check["state"]}
    kernel = "['block_0']['mlp_in']['kernel']"
    assert sharding["state.params" + kernel] == "P('fsdp', None)"
    assert [path for path, spec in sharding.items() if path.endswith(".mu" + kernel)] != []
    assert all(spec == "P('fsdp', None)" for path, spec in sharding.items() if path.endswith(kernel))
    assert fsdp_check["batch"]["x"]["sharding"] == "P(('data', 'fsdp'),)"
    assert fsdp_check["memory_per_device"]["argument"] > 0 and fsdp_check["compile_secs"] > 0
    assert fsdp_check["parameters"]["total"] == sum(
        count for name, count in fsdp_check["parameters"].items() if name != "total")


def test_check_names_the_parameter_shape_and_mesh_axis_of_heads_that_do_not_divide_fsdp():
    # heads on fsdp (the first rule, whose logical axis becomes "heads"), 4 heads on fsdp=8
    done = jaxmon("check", "--config", "configs/lm_fsdp.py", "--config.mesh.fsdp=8",
                  "--config.sharding.rules.1.0=heads", devices=8, timeout=300)
    assert done.returncode == 2, (done.stdout[-1000:], done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert "state.params['block_0']['attention']" in lines[-1], lines[-1]
    assert "(4, 16)" in lines[-1] or "(64, 4, 16)" in lines[-1]
    assert "mesh axis 'fsdp' (8 devices)" in lines[-1] and "size 4" in lines[-1]


# -- a user's task beside its config -------------------------------------------------------------


def test_a_user_task_from_a_module_beside_the_config_trains_from_the_config(tmp_path):
    here = tmp_path / "experiment"
    here.mkdir()
    (here / "line_task.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, optax
        import jaxmon as jm

        def data(split, n=256):
            rng = np.random.default_rng(0 if split == "train" else 1)
            x = rng.standard_normal((n, 1)).astype(np.float32)
            return {"x": x, "y": 3.0 * x + 0.5}

        def make_task(context):  # one parameter: a task, not a loss
            tx = context.optimizer

            def init_fn():
                params = {"w": jnp.zeros((1, 1)), "b": jnp.zeros((1,))}
                return {"params": params, "opt": tx.init(params)}

            def errors(params, batch):
                return (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2

            def step_fn(state, batch):
                loss, grads = jax.value_and_grad(lambda p: errors(p, batch).mean())(state["params"])
                updates, opt = tx.update(grads, state["opt"], state["params"])
                return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

            def eval_fn(state, batch):
                e = errors(state["params"], batch)
                return {"sse": e.sum(), "count": jnp.float32(e.size)}

            return jm.Task(init_fn, step_fn, eval_fn, eval_metrics={"mse": jm.Ratio("sse", "count")})
    """))
    (here / "config.py").write_text(textwrap.dedent("""
        def get_config():
            return {"seed": 0, "steps": 200, "data": {"source": "line_task:data", "batch_size": 32},
                    "task": "line_task:make_task", "optimizer": {"name": "adam", "learning_rate": 0.1},
                    "hooks": [{"name": "EvalHook", "every_n_steps": 100}],
                    "session": {"save_checkpoint_steps": 100, "save_summaries_steps": 50}}
    """))
    workdir = tmp_path / "run"
    done = jaxmon("train", "--config", str(here / "config.py"), "--workdir", str(workdir), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 200: test mse 0.0000  (" in done.stdout, done.stdout
    params = final_params(workdir)
    np.testing.assert_allclose(params["['w']"], [[3.0]], atol=0.05)
    with open(workdir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "eval/mse" in r] == [100, 200]
    assert records[-1]["eval/mse"] < 1e-2


# -- configs/lm.py: below the unigram entropy, and a SIGKILL resumed bit for bit ----------------


@pytest.mark.slow
def test_the_lm_config_trains_below_the_unigram_entropy_of_its_data_in_under_two_minutes(tmp_path):
    start = time.monotonic()  # as a user runs it: XLA's default optimisations, no cache of the suite's
    env = {**cpu_env(), "XLA_FLAGS": "", "JAX_COMPILATION_CACHE_DIR": ""}
    done = jaxmon("train", "--config", "configs/lm.py", "--workdir", str(tmp_path / "lm"), timeout=600, env=env)
    wall = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-2000:]
    entropy = jm.datasets.unigram_entropy(jm.datasets.python_text("test", seq_len=64)["y"])
    final = eval_losses(tmp_path / "lm")
    last = max(final)
    print(f"lm: {wall:.1f} s, eval loss {final[last]:.3f} at step {last}, unigram entropy {entropy:.3f}")
    assert final[last] < entropy - 0.5
    assert wall < 120


# -- configs/lm_fsdp.py: 8 devices, one device, two processes --------------------------------------

def running(pid):
    """Whether `pid` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_sigkilled_lm_run_rerun_ends_with_the_parameters_of_an_uninterrupted_run(fsdp_runs, tmp_path):
    command = [sys.executable, "-m", "jaxmon", "train", "--config", "configs/lm.py", *SHORT, "--workdir",
               str(tmp_path / "killed")]
    code, _, _ = kill_once_checkpointed(command, tmp_path / "killed", 10)
    assert code == -signal.SIGKILL and jm.latest_checkpoint_step(tmp_path / "killed") < 20
    rerun = jaxmon(*command[3:])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "Resumed from step 10" in rerun.stdout
    expected, got = final_params(fsdp_runs["root"] / "one"), final_params(tmp_path / "killed")
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_array_equal(got[path], expected[path], err_msg=path)


def process_1(launcher_pid):
    """The pid of the launcher's child with JAX_PROCESS_ID=1."""
    for pid in open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            if b"JAX_PROCESS_ID=1\0" in f.read() + b"\0":
                return int(pid)
    raise AssertionError("no child with JAX_PROCESS_ID=1")


PROBE = textwrap.dedent("""
    import json, jax
    import jaxmon as jm

    class ShardingProbe(jm.Hook):
        '''Writes the live state's shardings at the end, as the session holds them.'''
        def __init__(self, path):
            self.path = path
        def end(self, session):
            if jax.process_index() == 0:
                with open(self.path, "w") as f:
                    json.dump({jax.tree_util.keystr(p): str(leaf.sharding.spec)
                               for p, leaf in jax.tree_util.tree_leaves_with_path(session.state)}, f)
""")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """lm_fsdp for 20 steps on 8 devices (with a probe of the live state) and lm on one
    (also the uninterrupted run a killed one is compared with)."""
    root = tmp_path_factory.mktemp("fsdp")
    (root / "probe.py").write_text(PROBE)
    (root / "config.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {CONFIGS!r})
        import lm_fsdp

        def get_config():
            config = lm_fsdp.get_config()
            config["hooks"].append({{"name": "probe:ShardingProbe", "path": {str(root / "live.json")!r}}})
            return config
    """))
    eight = jaxmon("train", "--config", str(root / "config.py"), "--workdir", str(root / "eight"), *SHORT,
                   devices=8)
    assert eight.returncode == 0, eight.stderr[-3000:]
    one = jaxmon("train", "--config", "configs/lm.py", "--workdir", str(root / "one"), *SHORT)
    assert one.returncode == 0, one.stderr[-3000:]
    with open(root / "live.json") as f:
        live = json.load(f)
    return {"root": root, "live": live, "saved": saved_shardings(root / "eight" / "20")}


def saved_shardings(step_dir):
    """{"params.block_0.mlp_in.kernel": partition spec} as Orbax recorded each array of a
    checkpoint's state on disk (state/_sharding: base64 paths, NamedSharding records)."""
    with open(step_dir / "state" / "_sharding") as f:
        records = json.load(f)
    return {base64.b64decode(key).decode(): json.loads(value)["partition_spec"] if isinstance(value, str)
            else value["partition_spec"] for key, value in records.items()}


@pytest.mark.slow
def test_fsdp_on_8_devices_splits_parameters_and_optimizer_state_live_and_in_the_checkpoint(fsdp_runs):
    live, saved = fsdp_runs["live"], fsdp_runs["saved"]
    kernel = "['block_0']['mlp_in']['kernel']"
    split = ("P('fsdp',)", "P('fsdp', None)")  # the first dimension over fsdp (trailing None dropped or not)
    assert live[".params" + kernel] in split
    assert [spec in split for path, spec in live.items() if path.endswith(".mu" + kernel)] == [True]
    assert [spec in split for path, spec in live.items() if path.endswith(".nu" + kernel)] == [True]
    checkpointed = {path: spec for path, spec in saved.items() if path.endswith("block_0.mlp_in.kernel")}
    assert sorted(checkpointed) == ["opt_state.1.0.mu.block_0.mlp_in.kernel", "opt_state.1.0.nu.block_0.mlp_in.kernel",
                                    "params.block_0.mlp_in.kernel"], checkpointed
    assert all(spec in (["fsdp"], ["fsdp", None]) for spec in checkpointed.values()), checkpointed
    assert sum("fsdp" in spec for spec in live.values()) > len(live) / 2


@pytest.mark.slow
def test_fsdp_on_8_devices_ends_with_the_loss_of_one_device(fsdp_runs):
    eight, one = eval_losses(fsdp_runs["root"] / "eight"), eval_losses(fsdp_runs["root"] / "one")
    assert sorted(eight) == sorted(one) == [10, 20]  # the eval loss, token-weighted over the test split
    for step in one:
        np.testing.assert_allclose(eight[step], one[step], rtol=1e-4)
    # (parameters whose gradient is zero in exact arithmetic, the attention keys' bias, are
    # Adam-normalised rounding noise, which differs with the reduction order: compare losses)
    eight, one = train_losses(fsdp_runs["root"] / "eight"), train_losses(fsdp_runs["root"] / "one")
    assert sorted(eight) == sorted(one) == [1, 5, 10, 15, 20]
    np.testing.assert_allclose([eight[s] for s in sorted(one)], [one[s] for s in sorted(one)], rtol=1e-4)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the child process in /proc")
def test_fsdp_as_two_processes_survives_a_sigkill_and_ends_with_the_parameters_of_one_process_of_8(fsdp_runs,
                                                                                                   tmp_path):
    two = tmp_path / "two"
    command = [sys.executable, "-m", "jaxmon", "train", "--config", "configs/lm_fsdp.py", "--workdir", str(two),
               "--processes", "2", *SHORT]
    code, seconds, children = kill_once_checkpointed(command, two, 10, pick=process_1, env=cpu_env(4),
                                                     stderr=tmp_path / "launcher.err")
    print(f"SIGKILL of process 1: the launcher and process 0 ended {seconds:.1f} s later, exit {code}")
    err = (tmp_path / "launcher.err").read_text()
    assert code == 128 + signal.SIGKILL and seconds < 30, err[-3000:]
    assert len(children) == 2 and not any(running(pid) for pid in children)  # every process has ended
    assert f"jaxmon train: process 1 of 2 was killed by SIGKILL (its log is {two}/process-1.log); the other " \
           "processes were stopped." in err, err[-3000:]
    assert jm.latest_checkpoint_step(two) == 10
    rerun = jaxmon(*command[3:], devices=4)
    assert rerun.returncode == 0, (rerun.stdout[-2000:], rerun.stderr[-3000:])
    assert f"Resumed from step 10 in {two}; training on to step 20." in rerun.stdout
    expected, got = final_params(fsdp_runs["root"] / "eight"), final_params(two)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-5, atol=1e-6, err_msg=path)
    assert sorted(eval_losses(two)) == [10, 20]
