"""Waiting in tests: for an event, never for a duration.

Every wait in the tests goes through here. A wait names the event it waits for and gets a
generous deadline, multiplied by ``EPBUILD_TEST_TIMEOUT_SCALE`` (default 1: raise it on a
slow or crowded machine). When the deadline passes, the failure says what was awaited and
what the process was doing: its state and command line, its children, the Python stack of
each epbuild process among them (``faulthandler``, see ``epbuild._stacks``) and its last
output. Asserting that something does *not* happen (``Watcher.quiet``) is the one place a
test waits a fixed time: no event marks an absence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SCALE_VAR = "EPBUILD_TEST_TIMEOUT_SCALE"
STACKS_VAR = "EPBUILD_TEST_STACKS"  # read by epbuild._stacks in epbuild's own processes
DEFAULT_TIMEOUT = 120.0
"""Seconds (before scaling) a wait gives an event; far above what the work takes when the
machine is quiet, so that only a real hang reaches it."""


def scale() -> float:
    """The factor every deadline in the tests is multiplied by."""
    raw = os.environ.get(SCALE_VAR, "1")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_VAR}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{SCALE_VAR}={raw!r} must be positive")
    return value


def scaled(seconds: float) -> float:
    """``seconds`` times the scale: pass this wherever a library call takes a timeout."""
    return seconds * scale()


class WaitExpired(AssertionError):
    """A wait's deadline passed before its event happened."""


def wait_for(
    condition: Callable[[], T],
    what: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    proc: subprocess.Popen[Any] | int | None = None,
    output: Callable[[], str] | None = None,
    interval: float = 0.02,
) -> T:
    """Call ``condition`` until it returns something truthy, and return that.

    ``what`` names the event (``"a worker sits in the slow compile"``). ``proc`` is the
    process doing the work (a ``Popen`` or a pid): if it exits first, the wait fails at once
    instead of at the deadline, and an expired wait describes it. ``output`` returns what
    it printed so far (when the test reads its pipes itself)."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
            value = condition()  # the event and the exit may both have happened meanwhile
            if value:
                return value
            raise WaitExpired(
                f"gave up waiting for {what}: the process exited first\n"
                + describe(proc, output=output)
            )
        if time.monotonic() >= deadline:
            raise WaitExpired(
                f"timed out after {limit:.0f} s waiting for {what}\n"
                + describe(proc, output=output)
            )
        time.sleep(interval)


def communicate(
    proc: subprocess.Popen[Any], what: str, *, timeout: float = DEFAULT_TIMEOUT
) -> tuple[Any, Any]:
    """``proc.communicate()`` with a scaled deadline that, when it passes, fails naming
    ``what`` and describing the process (which is then killed)."""
    try:
        out, err = proc.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        report = describe(proc)  # while it still runs: children and stacks
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise WaitExpired(
            f"timed out after {scaled(timeout):.0f} s waiting for {what}\n{report}"
            + _tail("stdout", _text(out))
            + _tail("stderr", _text(err))
        ) from None
    return out, err


def run(
    args: Sequence[str], what: str, *, timeout: float = DEFAULT_TIMEOUT, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True)`` through ``communicate``."""
    with subprocess.Popen(
        list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    ) as proc:
        out, err = communicate(proc, what, timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def describe(
    proc: subprocess.Popen[Any] | int | None, *, output: Callable[[], str] | None = None
) -> str:
    """What ``proc`` is doing: its state, its children, Python stacks, its last output."""
    lines: list[str] = []
    if proc is not None:
        pid = proc if isinstance(proc, int) else proc.pid
        procs = _tree(pid)
        for depth, p in procs:
            lines.append("  " * (depth + 1) + _one(p))
        if not procs:
            code = proc.poll() if isinstance(proc, subprocess.Popen) else None
            lines.append(f"  process {pid}: gone (exit status {code})")
        stacks = _stacks([p for _, p in procs])
        if stacks:
            lines.append("Python stacks (faulthandler):")
            lines.append(stacks)
    if output is not None:
        lines.append(_tail("output", output()).rstrip("\n"))
    return "\n".join(lines) + "\n"


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants."""
    import psutil

    for _, p in reversed(_tree(pid)):
        try:
            p.kill()
        except psutil.Error:
            pass


def _tree(pid: int) -> list[tuple[int, Any]]:
    """(depth, psutil.Process) of ``pid`` and its descendants, parents first."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    out: list[tuple[int, Any]] = []

    def walk(p: Any, depth: int) -> None:
        out.append((depth, p))
        try:
            kids = p.children()
        except psutil.Error:
            return
        for kid in kids:
            walk(kid, depth + 1)

    walk(root, 0)
    return out


def _one(p: Any) -> str:
    import psutil

    try:
        with p.oneshot():
            cmd = " ".join(p.cmdline())
            return f"pid {p.pid} [{p.status()}, cpu {sum(p.cpu_times()[:2]):.1f} s]: {cmd[:300]}"
    except psutil.Error as exc:
        return f"pid {p.pid}: {type(exc).__name__}"


def _stacks(procs: list[Any]) -> str:
    """Ask each epbuild process for its Python stacks (SIGUSR1 → faulthandler, registered
    when ``EPBUILD_TEST_STACKS`` names a directory) and collect the dumps."""
    directory = os.environ.get(STACKS_VAR)
    if not directory:
        return ""
    asked: list[Path] = []
    for p in procs:
        dump = Path(directory) / f"{p.pid}.txt"
        if not dump.exists():  # not one of ours, or not yet registered: SIGUSR1 would kill it
            continue
        size = dump.stat().st_size
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            continue
        asked.append(dump)
        end = time.monotonic() + 5
        while dump.stat().st_size == size and time.monotonic() < end:
            time.sleep(0.05)
    return "\n".join(f"-- {d.stem}:\n{d.read_text(errors='replace').rstrip()}" for d in asked)


def _text(data: str | bytes | None) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data or ""


def _tail(name: str, text: str | None, lines: int = 40) -> str:
    kept = (text or "").splitlines()[-lines:]
    return f"last {name}:\n" + "".join(f"  | {ln}\n" for ln in kept) if kept else f"no {name}\n"
