"""Python stacks on demand, for the test suite's failure reports.

When ``EPBUILD_TEST_STACKS`` names a directory, each epbuild process (the CLI and every
worker) registers ``faulthandler`` on SIGUSR1, writing every thread's stack to
``DIR/PID.txt``. A test whose wait expires sends SIGUSR1 and shows the dump (tests/waits.py).
Unset in normal use: then nothing is registered and nothing is imported.
"""

from __future__ import annotations

import os
from typing import IO

_VAR = "EPBUILD_TEST_STACKS"
_held: list[IO[str]] = []  # faulthandler writes to the file's descriptor: keep it open


def register() -> None:
    """Dump this process's stacks on SIGUSR1 when ``EPBUILD_TEST_STACKS`` is set."""
    directory = os.environ.get(_VAR)
    if not directory or _held:
        return
    import faulthandler
    import signal

    try:
        f = open(os.path.join(directory, f"{os.getpid()}.txt"), "w", encoding="utf-8")  # noqa: SIM115
    except OSError:
        return
    _held.append(f)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
