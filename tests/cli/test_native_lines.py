"""Native lines on standard output: a C++ `std::cout` line that starts with `[Gloo] ` is
dropped, every other line (native or Python's) reaches the terminal in full, what is
written just before exit included."""

import subprocess
import sys
import textwrap
import time

from jaxmon._cli import native_lines

SCRIPT = textwrap.dedent("""
    import os
    from jaxmon._cli.native_lines import drop_native_lines

    drop_native_lines()
    print("python before", flush=True)
    for text in (b"[Gloo] Rank 0 is connected to 1 peer ranks.\\n", b"native kept\\n", b"[Gloo] again\\n"):
        os.write(1, text)  # as C++ writes: to descriptor 1, not through sys.stdout
    print("python after", flush=True)
    os.write(1, b"native at exit, no newline")
""")


def test_gloo_lines_are_dropped_and_every_other_line_arrives_before_exit():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "[Gloo]" not in done.stdout
    assert sorted(lines) == sorted(["python before", "native kept", "python after", "native at exit, no newline"])
    assert lines.index("python before") < lines.index("python after")



def test_a_child_that_inherited_stdout_does_not_hold_the_exit_and_the_last_lines_arrive(tmp_path):
    """multiprocessing's resource tracker (grain's shared memory starts one) inherits
    descriptor 1, the pipe, and keeps it open until it ends: the exit does not wait for
    the pipe's end (it waited DRAIN_SECS), only for what is in it."""
    script = SCRIPT + textwrap.dedent("""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10)"])  # holds the pipe 10 s
        print("python last", flush=True)
        os.write(1, b"\\nnative last, no newline")
    """)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files: the sleeping child holds no pipe of ours
        started = time.monotonic()
        process = subprocess.Popen([sys.executable, "-c", script], stdout=stdout, stderr=stderr)
        code = process.wait(timeout=60)
        took = time.monotonic() - started
    assert code == 0, err.read_text()
    assert took < native_lines.DRAIN_SECS, took
    lines = out.read_text().splitlines()
    assert "[Gloo]" not in out.read_text()
    assert sorted(lines) == sorted(["python before", "native kept", "python after", "native at exit, no newline",
                                    "python last", "native last, no newline"]), lines
