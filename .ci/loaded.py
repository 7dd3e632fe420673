"""Runs a command (`make test-loaded`: the test suite) with two CPU-bound processes beside
it, as a busy machine runs it, and stops them however the command ends.

Usage: python .ci/loaded.py COMMAND [ARG ...]; exits with the command's exit code.

The busy processes and the command each run in a session of their own: Ctrl-C on the
terminal reaches this process alone, which hands it (and SIGTERM) to the command once,
then stops the busy processes when the command has ended.
"""

import signal
import subprocess
import sys

HOGS = 2


def main(command: list[str]) -> int:
    if not command:
        sys.exit(__doc__)
    started = []

    def hand_on(signum, frame):
        for process in started:
            process.send_signal(signum)

    # Before anything starts: a SIGINT ignored here (a shell's background job) is not ignored there.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, hand_on)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(HOGS)]
    try:
        started.append(subprocess.Popen(command, start_new_session=True))
        code = started[0].wait()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return 128 - code if code < 0 else code  # killed by a signal: as a shell says it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
