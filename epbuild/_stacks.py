"""Python stacks on demand, for the test suite's failure reports.

When ``EPBUILD_TEST_STACKS`` names a directory, each epbuild process (the CLI and every
worker) registers ``faulthandler`` on SIGUSR1, writing every thread's stack to
``DIR/PID.txt``. A test whose wait expires sends SIGUSR1 and shows the dump (tests/waits.py).
Unset in normal use: then nothing is registered and nothing is imported.
"""

from __future__ import annotations

import os

_VAR = "EPBUILD_TEST_STACKS"
_held: list[int] = []  # the descriptor faulthandler writes to (a bare fd: no file object
# to be finalised, so nothing warns "unclosed file" at exit)


def register() -> None:
    """Dump this process's stacks on SIGUSR1 when ``EPBUILD_TEST_STACKS`` is set."""
    directory = os.environ.get(_VAR)
    if not directory or _held:
        return
    import faulthandler
    import signal

    path = os.path.join(directory, f"{os.getpid()}.txt")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return
    _held.append(fd)
    faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True)
