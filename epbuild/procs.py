"""Helper processes (a toolchain's interpreter asked a question, an installer) run in their
own process group, and the whole group is ended when the wait for them ends: on a timeout,
an interrupt, or after the leader exits (a grandchild it left behind does not outlive it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import IO, Any


def run_group(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    stdout: int | IO[Any] | None = subprocess.PIPE,
    stderr: int | IO[Any] | None = subprocess.PIPE,
    pass_fds: Sequence[int] = (),
) -> subprocess.CompletedProcess[bytes]:
    """``subprocess.run`` in a new session; raises ``subprocess.TimeoutExpired`` (after
    ending the group) when ``timeout`` passes. ``pass_fds``: descriptors the helper keeps
    (a lock it must hold for as long as it runs, even if this process dies)."""
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        end_group(proc)
        raise
    end_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def end_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the process group ``proc`` leads (whatever is left of it) and reap ``proc``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.communicate(timeout=5)
