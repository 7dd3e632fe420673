"""Orbax's log: a program's `logging.basicConfig(level=INFO)` around a session that saves
checkpoints shows jaxmon's lines and none of Orbax's, unless absl's logger asks for them."""

import subprocess
import sys
import textwrap

import pytest
from helpers import cpu_env

import jaxmon as jm

ORBAX_NOISE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(pathname)s %(message)s")
    if sys.argv[2] == "absl-info":
        logging.getLogger("absl").setLevel(logging.INFO)
    import jax.numpy as jnp
    import jaxmon as jm

    def step_fn(state, batch):
        return state + 1, {"loss": state}

    with jm.MonitoredTrainingSession(step_fn, state=jnp.zeros(()), checkpoint_dir=sys.argv[1],
                                     save_checkpoint_steps=5, hooks=[jm.StopAtStepHook(last_step=10)],
                                     log_step_count_steps=None, save_summaries_steps=None) as sess:
        while not sess.should_stop():
            sess.run()
""")


@pytest.mark.parametrize("mode", ["quiet", "absl-info"])
def test_a_programs_info_logging_gets_no_orbax_line_unless_absl_s_logger_asks(tmp_path, mode):
    """`logging.basicConfig(level=INFO)` around a session that saves three checkpoints:
    jaxmon's lines, none of Orbax's (144 before); absl's logger set to INFO lets them in."""
    script = tmp_path / "noise.py"
    script.write_text(ORBAX_NOISE)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), mode], env=cpu_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert jm.latest_checkpoint_step(tmp_path / "run") == 10
    lines = done.stderr.splitlines()
    orbax = [line for line in lines if line.startswith("absl ")]  # Orbax logs through absl's logger
    assert any(line.startswith("jaxmon INFO") for line in lines), lines
    if mode == "quiet":
        assert orbax == [], orbax[:5]
    else:
        assert len(orbax) > 20
