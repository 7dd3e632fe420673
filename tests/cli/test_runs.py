"""`jaxmon inspect --verify` (`jaxmon/_cli/runs.py`) on a real `jaxmon train` run's
checkpoints: a step's directory emptied or left partial is named broken, with the fix,
and the command exits 1; so is a checkpoint stripped of its manifest and of the run's
record that it seals its checkpoints.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, tiny_config, train

from jaxmon._checkpoints import integrity as _integrity
from jaxmon._checkpoints.step_dirs import COMMIT_MARKER
from jaxmon._cli import main as _cli

SOUND = r"  step +{} +sound +\d+ files, \d+ bytes, each as its jaxmon-integrity.json records"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A `jaxmon train` run of `tiny_config` with checkpoints 0, 20 and 40, each sealed."""
    directory = tmp_path_factory.mktemp("trained")
    workdir = directory / "run"
    result = train(workdir, config=tiny_config(directory, steps=40))
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run, for a test to damage."""
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    return workdir


def verify(workdir, capsys, *args):
    """`jaxmon inspect WORKDIR --verify ARGS`, in this process: its exit code and its stdout."""
    code = _cli.main(["inspect", str(workdir), "--verify", *args])
    return code, capsys.readouterr().out


def test_a_sound_run_verifies_with_exit_0(run, capsys):
    code, out = verify(run, capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"run {run}: 3 checkpoints re-read", out
    for line, step in zip(lines[1:], (0, 20, 40), strict=True):
        assert re.fullmatch(SOUND.format(step), line), line


def test_an_emptied_checkpoint_directory_is_named_broken_and_the_command_exits_1(run):
    for path in (run / "40").rglob("*"):  # its files deleted, its directories left
        if path.is_file():
            path.unlink()
    result = subprocess.run([sys.executable, "-m", "jaxmon", "inspect", str(run), "--verify"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"run {run}: 3 checkpoints re-read"
    assert re.fullmatch(SOUND.format(20), lines[2]), lines[2]
    assert lines[3] == (f"  step       40  broken    empty directory, no checkpoint: a restore skips it. Put its files "
                        f"back from a copy, or remove {run / '40'} (that step is lost)")


def test_a_partial_checkpoint_directory_is_named_broken_and_the_command_exits_1(run, capsys):
    removed = [path for path in (run / "40").iterdir() if path.is_file()]  # `rm 40/*`: its top's files
    assert {COMMIT_MARKER, _integrity.MANIFEST} <= {path.name for path in removed}
    for path in removed:
        path.unlink()
    left = sum(len(names) for _, _, names in os.walk(run / "40"))
    code, out = verify(run, capsys)
    assert code == 1
    assert out.splitlines()[3] == (f"  step       40  broken    partial directory ({left} files, neither "
                                   f"{COMMIT_MARKER} nor {_integrity.MANIFEST}), no checkpoint: a restore skips it. "
                                   f"Put its files back from a copy, or remove {run / '40'} (that step is lost)")
    code, out = verify(run, capsys, "--json")
    assert code == 1
    assert [(c["step"], c["state"]) for c in json.loads(out)["checkpoints"]] == [(0, "sound"), (20, "sound"),
                                                                                 (40, "broken")]


def test_a_checkpoint_stripped_of_its_manifest_and_the_runs_record_is_refused_and_the_command_exits_1(run, capsys):
    os.remove(run / "40" / _integrity.MANIFEST)
    os.remove(run / _integrity.SEALED_RUN)
    code, out = verify(run, capsys)
    assert code == 1
    assert out.splitlines()[3] == (f"  step       40  unsealed  no {_integrity.MANIFEST}, and its run seals every "
                                   "checkpoint: a restore refuses it")


def test_a_run_without_any_manifest_is_unsealed_throughout_and_restores_unchecked(run, capsys):
    for step in ("0", "20", "40"):
        os.remove(run / step / _integrity.MANIFEST)
    os.remove(run / _integrity.SEALED_RUN)
    code, out = verify(run, capsys)
    assert code == 1
    assert out.splitlines()[1:] == [f"  step {step:>8}  unsealed  no {_integrity.MANIFEST} (written without one): it "
                                    "restores unchecked" for step in (0, 20, 40)]


def test_inspect_and_plot_show_an_lm_runs_metrics_not_the_sums_they_divide(tmp_path, capsys):
    """The lm task's `loss_sum`, `tokens` and `correct` stay in metrics.jsonl; inspect and
    plot show the metrics (plot draws a part asked for by name)."""
    workdir = tmp_path / "lm"
    workdir.mkdir()
    (workdir / "hparams.json").write_text(json.dumps({"task": "lm", "steps": 4}))
    rows = [{"step": s, "loss": 2.0 / s, "loss_sum": 64.0 / s, "tokens": 32.0, "correct": 8.0 * s}
            for s in (1, 2, 3, 4)]
    rows.append({"step": 4, "eval/loss": 0.6, "eval/accuracy": 0.7})
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert _cli.main(["inspect", str(workdir)]) == 0
    shown = capsys.readouterr().out
    assert "eval/loss" in shown and "  loss  " in shown
    assert not re.search(r"^\s+(loss_sum|tokens|correct)\s", shown, re.M), shown
    assert "loss_sum" in (workdir / "metrics.jsonl").read_text()  # kept for whoever reads the records
    pytest.importorskip("matplotlib")
    assert _cli.main(["plot", str(workdir)]) == 0
    assert capsys.readouterr().out.endswith("(3 scalars: eval/accuracy, eval/loss, loss)\n")
    assert _cli.main(["plot", str(workdir), "--tags", "tokens"]) == 0  # asked for by name
    assert capsys.readouterr().out.endswith("(1 scalars: tokens)\n")
