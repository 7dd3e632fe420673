"""Files that are not what they seem: a symbolic link where a run writes a file (its
target is never written: the run refuses it, exit 2, naming it, or writes its own file),
terminal escapes in what `jaxmon inspect` prints, directories that are not runs, a
binary metrics.jsonl, `plot --out DIR`; and grain's worker processes, which end with
their parent however it ends."""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import warm_processes
from helpers import DEFAULT, ROOT, assert_fails, cpu_env, train

from jaxmon._base.paths import LinkedFileError, open_file
from jaxmon._checkpoints import integrity as _integrity
from jaxmon._checkpoints.step_dirs import COMMIT_MARKER
from jaxmon._cli import main as _cli
from jaxmon._experiment.train import _check_workdir
from jaxmon._writers import events
from jaxmon._writers.jsonl import JsonlWriter

TARGET_TEXT = "not jaxmon's: must stay as it is\n"


@pytest.fixture
def target(tmp_path):
    """A file outside the run directory, which a link in it points to."""
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_text(TARGET_TEXT)
    return path


def _link(path, target):
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    return path


# -- a link where a run writes a file ---------------------------------------------------------


@pytest.mark.parametrize("name", [".jaxmon-writer.lock", "metrics.jsonl", "hparams.json"])
def test_a_run_refuses_a_link_where_it_writes_a_file_and_leaves_the_target_alone(tmp_path, target, name):
    link = _link(tmp_path / "run" / name, target)
    last = assert_fails(train(tmp_path / "run", "--config.steps=2", "--no_compilation_cache"), 2,
                        f"{link} is a symbolic link", "Remove the link")
    assert "jaxmon then writes its own file there" in last
    assert target.read_text() == TARGET_TEXT and os.path.islink(link)


def test_the_write_test_removes_a_link_of_its_name_and_writes_its_own_file(tmp_path, target):
    link = _link(tmp_path / "run" / f".jaxmon-write-test-{os.getpid()}", target)
    _check_workdir(tmp_path / "run")
    assert target.read_text() == TARGET_TEXT and not os.path.lexists(link)  # its own file, removed after


def test_metrics_jsonl_rewritten_on_resume_goes_through_a_copy_of_its_own(tmp_path, target):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)))
    writer = JsonlWriter(path)
    link = _link(tmp_path / f"metrics.jsonl.{os.getpid()}.tmp", target)  # the name of restart's copy
    writer.restart(2)
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert target.read_text() == TARGET_TEXT and not os.path.lexists(link) and not path.is_symlink()


def test_an_event_file_is_never_written_through_a_link(tmp_path, target, monkeypatch):
    monkeypatch.setattr(events.time, "time", lambda: 1234.0)
    link = _link(tmp_path / f"events.out.tfevents.1234.{events.socket.gethostname()}.x", target)
    with pytest.raises(LinkedFileError, match=f"{link} is a symbolic link"):
        events.EventFile(str(tmp_path), ".x")
    assert target.read_text() == TARGET_TEXT


def test_an_event_file_cut_back_on_resume_goes_through_a_copy_of_its_own(tmp_path, target):
    from tensorboardX.proto import event_pb2

    file = events.EventFile(str(tmp_path), ".cut")
    for step in (1, 2, 3):
        file.write(event_pb2.Event(step=step, wall_time=1.0))
    file.close()
    link = _link(tmp_path / f".jaxmon-cut.{os.getpid()}.tmp", target)
    assert events.cut_after(file.path, 1)
    with open(file.path, "rb") as written:
        steps = [event_pb2.Event.FromString(data).step for _, _, data in events._spans(written)]
    assert steps == [0, 1]  # the version record and step 1
    assert target.read_text() == TARGET_TEXT and not os.path.lexists(link)


def test_a_checkpoints_manifest_goes_through_a_copy_of_its_own(tmp_path, target):
    step = tmp_path / "7"
    step.mkdir()
    (step / "data").write_bytes(b"weights")
    _link(step / f"{_integrity.MANIFEST}.tmp", target)
    _integrity.seal(str(step))
    assert target.read_text() == TARGET_TEXT
    assert "data" in json.loads((step / _integrity.MANIFEST).read_text())["files"]


def test_the_error_log_is_not_written_through_a_link_and_the_failure_still_ends_the_output(tmp_path, target, capsys):
    link = _link(tmp_path / "jaxmon-error.log", target)
    args = argparse.Namespace(debug=False, workdir=str(tmp_path), command="train")
    assert _cli._fail(args, 1, "FloatingPointError: NaN loss at step 3", RuntimeError("x")) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "jaxmon train: FloatingPointError: NaN loss at step 3"
    assert len(lines) == 2 and f"{link} is a symbolic link" in lines[0]
    stream = _cli._MainThreadOnly(sys.stderr, str(link))  # what other threads print, meant for the log
    import threading

    thread = threading.Thread(target=stream.write, args=("Event loop is closed\n",))
    thread.start()
    thread.join()
    assert target.read_text() == TARGET_TEXT


def test_open_file_refuses_a_link_even_one_that_points_nowhere(tmp_path):
    link = tmp_path / "hparams.json"
    os.symlink(tmp_path / "missing" / "file", link)
    with pytest.raises(LinkedFileError) as raised:
        open_file(link, "w")
    assert raised.value.filename == str(link) and not (tmp_path / "missing").exists()
    assert isinstance(raised.value, OSError)


# -- jaxmon inspect and plot ------------------------------------------------------------------


def _fake_run(directory, *, time_text="2026-01-01T00:00:00", tag="loss", metrics=None):
    """A run's directory as inspect reads it: checkpoint 5 (committed, its meta) and metrics.jsonl."""
    step = directory / "5"
    (step / "meta").mkdir(parents=True)
    (step / COMMIT_MARKER).write_text("committed")
    (step / "meta" / "metadata").write_text(json.dumps({"time": time_text, "config": {"name\x1b]0;x\x07": 1}}))
    lines = metrics if metrics is not None else (json.dumps({"step": 5, tag: 0.5}) + "\n").encode()
    (directory / "metrics.jsonl").write_bytes(lines)
    return directory


def test_inspect_escapes_the_terminal_control_characters_a_runs_files_hold(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", time_text="2026\x1b[2J\x1b[31m\r\u202e", tag="lo\x1b[1Ass")
    assert _cli.main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    assert "2026\\x1b[2J\\x1b[31m\\r\\u202e" in out and "lo\\x1b[1Ass  0.5  (step 5)" in out
    assert "\\u001b]0;x\\u0007" in out  # the config, as JSON


def test_inspect_and_plot_of_a_directory_that_is_not_a_run_exit_2_saying_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for directory in (str(tmp_path / "empty"), "/etc"):
        assert _cli.main(["inspect", directory]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"jaxmon inspect: {directory!r} is not a jaxmon run: it holds no checkpoint, metrics.jsonl, "
                       "TensorBoard event file or hparams.json. Pass the --workdir of a `jaxmon train` run."]
        assert _cli.main(["plot", directory]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"no metrics.jsonl in {directory!r}, a directory that is not a jaxmon run" in err[0]


def test_a_binary_metrics_jsonl_is_skipped_line_by_line_naming_the_file_and_lines(tmp_path, capsys):
    good = json.dumps({"step": 5, "loss": 0.5}).encode()
    run = _fake_run(tmp_path / "run", metrics=b"\xff\xfe\x00garbage\n" + good + b"\n\x80\x81\n")
    assert _cli.main(["inspect", str(run)]) == 0
    captured = capsys.readouterr()
    assert "loss  0.5  (step 5)" in captured.out and "step        5" in captured.out
    assert captured.err.strip() == (f"jaxmon: skipped 2 unreadable line(s) of {run / 'metrics.jsonl'} (lines 1, 3): "
                                    "not a JSON record of a step")
    (run / "metrics.jsonl").write_bytes(os.urandom(4096).replace(b"\n", b"") + b"\n")  # all binary
    assert _cli.main(["inspect", str(run)]) == 0
    captured = capsys.readouterr()
    assert "latest metrics: none (no scalar in metrics.jsonl)" in captured.out and "step        5" in captured.out
    assert _cli.main(["plot", str(run)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"jaxmon plot: {run / 'metrics.jsonl'} holds no scalars."


def test_plot_out_a_directory_writes_the_runs_png_in_it_and_prints_that_path(tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the jaxmon[plot] extra
    run = _fake_run(tmp_path / "myrun", metrics=b"".join(
        json.dumps({"step": s, "loss": 1.0 / s}).encode() + b"\n" for s in range(1, 6)))
    out = tmp_path / "figures"
    out.mkdir()
    assert _cli.main(["plot", str(run), "--out", str(out)]) == 0
    written = out / "myrun.png"
    assert capsys.readouterr().out == f"wrote {written} (1 scalars: loss)\n"
    assert written.read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "figures.png").exists()
    assert _cli.main(["plot", str(run), "--out", str(tmp_path / "curves")]) == 0  # no extension: .png added
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'curves.png'} (")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert _cli.main(["plot", str(run)]) == 0  # the default: DIR/metrics.png
    assert capsys.readouterr().out.startswith(f"wrote {run / 'metrics.png'} (")
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert _cli.main(["plot", str(run), "--out", str(tmp_path / "curves.txt")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib cannot write .txt files" in err and "png" in err and not (tmp_path / "curves.txt").exists()


def test_plot_refuses_a_link_where_it_writes_the_runs_metrics_png(tmp_path, target, capsys):
    pytest.importorskip("matplotlib")
    run = _fake_run(tmp_path / "run")
    link = _link(run / "metrics.png", target)
    assert _cli.main(["plot", str(run)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"jaxmon plot: {link} is a symbolic link")
    assert target.read_text() == TARGET_TEXT


# -- grain's worker processes -------------------------------------------------------------------


def _grain_train(workdir, *args):
    return warm_processes.popen([sys.executable, "-m", "jaxmon", "train", "--config", DEFAULT, "--workdir",
                                 str(workdir), "--config.data.loader=grain", "--config.data.worker_count=2",
                                 *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT, env=cpu_env(), start_new_session=True)


def _children() -> dict[int, list[int]]:
    """Every process's children, by /proc (psutil where it is installed)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    tree: dict[int, list[int]] = {}
    if psutil is not None:
        for process in psutil.process_iter(["pid", "ppid"]):
            tree.setdefault(process.info["ppid"], []).append(process.info["pid"])
        return tree
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/stat") as file:
                ppid = int(file.read().rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def grain_run(tmp_path_factory):
    pytest.importorskip("grain")  # the jaxmon[grain] extra (installed by `make test`)
    workdir = tmp_path_factory.mktemp("grain") / "run"
    process = _grain_train(workdir, "--config.steps=20")
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output[-3000:]
    return workdir, output


def test_a_clean_grain_run_prints_nothing_after_its_result_line(grain_run):
    workdir, output = grain_run
    assert output.rstrip("\n").splitlines()[-1].startswith("step 20: test accuracy"), output[-2000:]
    assert "leaked" not in output and "resource_tracker" not in output


def test_a_sigkilled_grain_run_leaves_no_process_behind(grain_run):
    workdir, _ = grain_run
    process = _grain_train(workdir, "--config.steps=100000", "--config.session.save_checkpoint_steps=None")
    try:
        deadline, workers = time.monotonic() + 180, set()
        while len(workers) < 3:  # grain's 2 workers and multiprocessing's resource_tracker
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
            time.sleep(0.2)
            workers = _descendants(process.pid)
        time.sleep(1.0)  # the workers at work, batches in shared memory
        os.kill(process.pid, signal.SIGKILL)  # the trainer only: its workers are left to themselves
        process.wait(timeout=30)
        deadline = time.monotonic() + 5
        while (left := {pid for pid in workers if _running(pid)}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running 5 s after the trainer's SIGKILL: {sorted(left)}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.stdout.close()


def test_plot_of_a_sweeps_glob_skips_what_is_no_run_in_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for seed in (0, 1):
        _fake_run(tmp_path / "sweep" / f"seed={seed}", metrics=b"".join(
            json.dumps({"step": s, "loss": seed + 1.0 / s}).encode() + b"\n" for s in range(1, 6)))
    (tmp_path / "sweep" / "sweep.json").write_text("{}")
    (tmp_path / "sweep" / "empty").mkdir()
    paths = sorted(str(path) for path in (tmp_path / "sweep").iterdir())  # as the shell expands runs/sweep/*
    out = tmp_path / "all.png"
    assert _cli.main(["plot", *paths, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"jaxmon plot: skipped 2 path(s) with no metrics.jsonl: {tmp_path / 'sweep'}"
                                    f"/empty, {tmp_path / 'sweep' / 'sweep.json'}.")
    assert captured.out == f"wrote {out} (2 runs, 1 scalars: loss)\n" and out.read_bytes()[:4] == b"\x89PNG"
    assert _cli.main(["plot", str(tmp_path / "sweep" / "sweep.json"), str(tmp_path / "sweep" / "empty")]) == 2
    assert "no metrics.jsonl in" in capsys.readouterr().err  # none plottable: the first named
