"""Native lines on standard output: a C++ `std::cout` line that starts with `[Gloo] ` is
dropped, every other line (native or Python's) reaches the terminal in full, what is
written just before exit included."""

import subprocess
import sys
import textwrap

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
