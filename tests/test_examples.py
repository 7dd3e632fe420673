"""The examples that come with the README train and report their results."""

import pathlib
import re
import sys

import warm_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_first_loop_example_trains_and_reports_its_loss():
    result = warm_processes.run([sys.executable, str(ROOT / "examples" / "first_loop.py")],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"trained 2000 steps in [\d.]+s \((\d+) compilations\): loss ([\d.]+) -> ([\d.]+)", last)
    assert match, last
    compilations, first, final = int(match[1]), float(match[2]), float(match[3])
    assert compilations == 1 and final < 0.05 * first
