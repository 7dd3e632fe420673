"""The command's signals in this process: inside `handling()` Ctrl-C, SIGTERM and SIGHUP
raise where the main thread is, a caught one is not lost (`take_lost`, `check`), and
`stopped` names the signal an error comes from; outside, nothing changes. Also which
command a process is, and its last line written last."""

import signal
import subprocess
import sys

import pytest
from helpers import ROOT

from jaxmon._base import signals


@pytest.fixture
def stage():
    """This module's stage, as it was, after the test (a signal left pending must not
    leak into another test)."""
    yield signals._stage
    signals._stage.pending = signals._stage.raised = None


def test_outside_handling_nothing_changes_and_stopped_names_the_error(stage):
    assert stage.name == "off" and not signals.in_the_command()
    assert signals.stopped(KeyboardInterrupt()) == signal.SIGINT
    assert signals.stopped(signals.Terminated(signum=signal.SIGHUP)) == signal.SIGHUP
    assert signals.stopped(ValueError("not a signal")) is None
    assert not signals.take_lost(signal.SIGINT)
    signals.check()  # nothing pending: nothing raised
    assert stage.name == "off"


@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, signals.Terminated), (signal.SIGHUP, signals.Terminated),
                                            (signal.SIGINT, KeyboardInterrupt)], ids=["TERM", "HUP", "INT"])
def test_in_handling_a_signal_raises_in_the_main_thread_and_the_handlers_come_back(stage, signum, raised):
    before = {s: signal.getsignal(s) for s in signals.EXIT_CODES}
    with signals.handling():
        with pytest.raises(raised) as error:
            signal.raise_signal(signum)
        assert getattr(error.value, "signum", signal.SIGINT) == signum
        assert stage.pending == signum and not signals.in_the_command()  # a test, not the command
        assert not signals.take_lost(signal.SIGUSR1)
        assert signals.take_lost(signum)  # a session that takes the signal over acknowledges it
        assert not signals.take_lost(signum) and stage.pending is None
    assert {s: signal.getsignal(s) for s in signals.EXIT_CODES} == before
    assert stage.name == "off"


def test_a_signal_a_library_caught_is_raised_again_by_check_and_stopped_ends_the_handling(stage):
    with signals.handling():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # a library swallowed it
        with pytest.raises(KeyboardInterrupt):
            signals.check()
        assert signals.stopped(RuntimeError("wrapped by a library")) == signal.SIGINT  # the pending signal's
        assert stage.name == "ending"
        signal.raise_signal(signal.SIGTERM)  # the last line is on its way: ignored
    assert stage.name == "off"


def test_loading_outside_the_command_changes_nothing(stage):
    with signals.handling():
        handler = signal.getsignal(signal.SIGTERM)
        with signals.loading():
            assert signal.getsignal(signal.SIGTERM) is handler and stage.name == "main"


@pytest.mark.parametrize("argv, module", [
    (["python", "-m", "jaxmon", "train"], "jaxmon"),
    (["python", "-X", "dev", "-u", "-mjaxmon"], "jaxmon"),
    (["python", "-W", "ignore", "-m", "other.tool"], "other.tool"),
    (["python", "-c", "import jaxmon"], None),
    (["python", "script.py", "-m", "jaxmon"], None),
    (["python", "-m"], None),
], ids=["m", "mjaxmon", "other", "c", "script", "bare"])
def test_the_module_a_python_command_runs_with_m(monkeypatch, argv, module):
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert signals._module_run_by_m() == module


@pytest.mark.parametrize("argv, name", [
    (["jaxmon", "train", "--config", "c.py"], "jaxmon train"),
    (["jaxmon", "--verbose", "inspect", "runs/a"], "jaxmon inspect"),
    (["jaxmon", "--help"], "jaxmon"),
    (["jaxmon", "frobnicate"], "jaxmon"),
], ids=["train", "inspect", "help", "unknown"])
def test_the_commands_name_in_its_last_line(monkeypatch, argv, name):
    monkeypatch.setattr(sys, "argv", argv)
    assert signals._command() == name


def test_the_last_line_comes_after_everything_else_written_to_stderr():
    program = ("import sys\n"
               "from jaxmon._base.signals import write_last_line\n"
               "sys.stderr.write('before\\n')\n"
               "write_last_line('the last line\\n')\n"
               "sys.stderr.write('after\\n'); sys.stderr.flush()\n")
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "before\nthe last line\n"


def test_two_threads_last_lines_both_land_whole_after_everything_else():
    program = ("import sys, threading\n"
               "from jaxmon._base.signals import write_last_line\n"
               "sys.stderr.write('before\\n')\n"
               "threads = [threading.Thread(target=write_last_line, args=(f'line {i}\\n',)) for i in range(2)]\n"
               "[thread.start() for thread in threads]; [thread.join() for thread in threads]\n"
               "sys.stderr.write('after\\n'); sys.stderr.flush()\n")
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stderr in ("before\nline 0\nline 1\n", "before\nline 1\nline 0\n"), result.stderr
