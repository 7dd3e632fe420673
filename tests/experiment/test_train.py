"""`jaxmon train` (`_experiment/train.py`): the start-up line at the first step."""

import re
import subprocess
import sys

from helpers import ROOT, cpu_env

LINE = re.compile(r"Step 1 after (?P<total>[\d.]+) s: (?P<parts>.*)\.$", re.MULTILINE)


def test_the_first_step_prints_where_the_start_up_time_went_and_the_parts_add_up(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jaxmon", "train", "--config", "configs/default.py",
                           "--workdir", str(tmp_path / "run"), "--config.steps=20"],
                          cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [match] = LINE.finditer(done.stderr)  # a log line: stdout holds the result alone
    parts = {name: float(secs) for name, secs in re.findall(r"([a-z0-9 -]+?) ([\d.]+) s(?:, |$)", match["parts"])}
    assert list(parts) == ["imports and config", "data and model", "state", "checkpoint 0", "session set-up",
                           "compile", "first evaluation", "first batch and hooks", "the rest"]
    assert done.stdout.startswith("step 20: test accuracy")
    total = float(match["total"])
    # every second counted once: each part and the total rounded to 0.01 s
    assert abs(sum(parts.values()) - total) <= 0.005 * (len(parts) + 1) + 1e-9
    assert total - parts["the rest"] >= 0.9 * total, parts  # the named parts account for the time, within 10%
    assert parts["imports and config"] > 0 and parts["compile"] > 0 and parts["state"] > 0
