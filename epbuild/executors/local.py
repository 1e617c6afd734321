"""Executors run one action's job in a fresh worker process and report how it ended.

``LocalExecutor`` starts ``python -m epbuild.executors.worker`` subprocesses. To keep start-up
cheap it keeps one spare worker warm per slot (already past ``import onnxruntime``, waiting for its
job): still a fresh process per action, but its start-up overlaps the previous compile.
``run_inline`` runs an inline kind's job in the building process instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Protocol

from epbuild._dataclass import dataclass, field
from epbuild._names import LOG_NAME, RESULT_NAME
from epbuild.executors.worker import COMPILING, result_of

if TYPE_CHECKING:
    import subprocess

    from epbuild.executors.job import Job


@dataclass
class WorkerOutcome:
    """How a worker ended."""

    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    hint: str | None = None
    log_tail: list[str] = field(default_factory=list)
    killed: bool = False
    """SIGKILL ended it: the kernel's answer to running out of memory, most often."""
    peak_rss: int = 0
    """Its peak resident memory, as the kernel accounted it (0: not known)."""
    compiling: str | None = None
    """The model its log says it was compiling last, when it failed."""


class Executor(Protocol):
    """Runs jobs; ``cancel`` stops everything running."""

    def run(self, job: Job) -> WorkerOutcome:
        """Run one job to completion (blocking); its outputs land in ``job.staging``."""
        ...

    def cancel(self) -> None:
        """Kill all running workers (Ctrl-C)."""
        ...

    def close(self) -> None:
        """Release spare workers (called by whoever created the executor)."""
        ...


# Started from the workspace root, but never import from it: a folder there named like a
# module (even "epbuild") must not shadow the installed package.
def own_command(module: str) -> list[str]:
    """The command that runs ``module``'s ``main()`` in epbuild's own environment, with the
    working directory (a workspace: a folder named ``numpy`` in it would shadow the real
    package) taken off the import path."""
    code = f"import sys; del sys.path[0]; from {module} import main; main()"
    return [sys.executable, "-c", code]


WORKER_BOOT = own_command("epbuild.executors.worker")[2]


def _tail(path: str, lines: int = 12) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()][-lines:]


def _describe_exit(code: int, log_path: str | None = None) -> str:
    """How a worker ended without a result, naming the model it was compiling (the last
    ``epbuild: compiling`` line of its log) when its log says."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = f"the worker was killed by {name}"
    else:
        what = f"the worker exited with status {code}"
    model = _compiling(log_path) if log_path else None
    return f"{what} while compiling {model}" if model else what


def _compiling(log_path: str) -> str | None:
    """The model a worker's log says it was compiling last (the worker writes the line)."""
    try:
        with open(log_path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    found = [ln[len(COMPILING) :].strip() for ln in lines if ln.startswith(COMPILING)]
    return found[-1] if found else None


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill (if still running), wait for and close the pipes of a worker."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


def _wait(proc: subprocess.Popen[bytes]) -> tuple[int, int]:
    """Wait for a worker to end: its exit status (as ``Popen`` gives it: -N for signal N)
    and the peak resident memory the kernel accounted to it (0 where unknown), so that a
    worker killed for memory can be said to have reached it."""
    if not hasattr(os, "wait4"):
        return proc.wait(), 0
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:  # reaped meanwhile (cancel's poll): Popen has its status
        return proc.wait(), 0
    proc.returncode = os.waitstatus_to_exitcode(status)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes there, kB on Linux
    return proc.returncode, usage.ru_maxrss * scale


def send_job(proc: subprocess.Popen[bytes], job: Job) -> None:
    """Hand a worker its job line; its stdin then stays open until the coordinator goes."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(job.to_json()).encode() + b"\n")
        proc.stdin.flush()
    except OSError:
        pass  # the worker died on start; its exit status tells why


def outcome_of(result: Any, code: int, log_path: str) -> WorkerOutcome:
    """How a worker ended, from its result document (None if it wrote none) and exit code."""
    if not isinstance(result, dict):
        from epbuild.executors.hostinfo import write_trouble

        trouble = write_trouble(os.path.dirname(log_path))  # a full disk explains it
        if trouble is not None:
            return WorkerOutcome(False, error=trouble[0], hint=trouble[1])
        error = _describe_exit(code, log_path)
        killed = code == -signal.SIGKILL
        return WorkerOutcome(
            False,
            error=error,
            log_tail=_tail(log_path),
            killed=killed,
            compiling=_compiling(log_path),
        )
    if not result.get("ok"):
        return WorkerOutcome(
            False,
            result,
            error=result.get("error", _describe_exit(code)),
            hint=result.get("hint"),
            log_tail=_tail(log_path) if "traceback" in result else [],
            compiling=_compiling(log_path),
        )
    return WorkerOutcome(True, result)


def run_inline(job: Job, root: str) -> WorkerOutcome:
    """Run a job in this process (an inline kind's, in the building process: no
    onnxruntime here)."""
    return outcome_of(result_of(job, root), 0, os.path.join(root, job.staging, "none"))


class LocalExecutor:
    """Fresh subprocess per action on this machine."""

    def __init__(self, root: str, *, prewarm: bool = True, jobs: int | None = None) -> None:
        self.root = root
        self.prewarm = prewarm
        self._upcoming = jobs
        """Jobs still to come (None: unknown, as in a watch session): a spare is started only
        for one of them. A spare nobody takes costs a whole ``import onnxruntime`` of CPU,
        taken from the compiles beside it."""
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[bytes]] = set()
        self._spares: list[tuple[tuple[str, ...], subprocess.Popen[bytes]]] = []
        """Warm workers, each with the command it was started with (a toolchain's or ours)."""
        self._cancelled = False

    def _spawn(self, boot: tuple[str, ...]) -> subprocess.Popen[bytes]:
        import subprocess  # here: a build that only restores never starts a worker

        env = dict(os.environ)
        return subprocess.Popen(
            list(boot) or [sys.executable, "-c", WORKER_BOOT],
            cwd=self.root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the coordinator, which stops workers
        )

    def _take(self, boot: tuple[str, ...]) -> subprocess.Popen[bytes] | None:
        """A warm worker started with ``boot`` (else a new one); leaves a spare of the same
        kind behind for the next job, if one is still to come. None once cancelled: a job whose
        thread reaches here after Ctrl-C must not start a compile that the interrupted build
        then waits for."""
        with self._lock:
            if self._cancelled:
                return None
            proc = None
            for item in [sp for sp in self._spares if sp[0] == boot]:
                self._spares.remove(item)
                if item[1].poll() is None:
                    proc = item[1]
                    break
                _reap(item[1])
            if proc is None:
                proc = self._spawn(boot)
            if self._upcoming is not None:
                self._upcoming = max(0, self._upcoming - 1)
            if self.prewarm and (self._upcoming is None or self._upcoming > len(self._spares)):
                self._spares.append((boot, self._spawn(boot)))
            self._running.add(proc)
            return proc

    def run(self, job: Job) -> WorkerOutcome:
        """Run one job in a fresh worker subprocess (a warm spare when there is one)."""
        staging = os.path.join(self.root, job.staging)
        log_path = os.path.join(staging, LOG_NAME)
        proc = self._take(job.boot)
        if proc is None:
            return WorkerOutcome(False, error="interrupted before its worker started")
        assert proc.stdin is not None and proc.stdout is not None
        peak = 0
        try:
            send_job(proc, job)
            _drain(proc.stdout.fileno(), log_path)
            code, peak = _wait(proc)
        finally:
            _reap(proc)
            with self._lock:
                self._running.discard(proc)
        try:
            with open(os.path.join(staging, RESULT_NAME), encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = None
        outcome = outcome_of(result, code, log_path)
        outcome.peak_rss = peak
        return outcome

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for proc in self._running:
                if proc.poll() is None:
                    proc.kill()
            for _, proc in self._spares:
                _reap(proc)
            self._spares.clear()

    def close(self) -> None:
        with self._lock:
            for _, proc in self._spares:
                _reap(proc)
            self._spares.clear()


def _drain(fd: int, log_path: str) -> None:
    """Copy the worker's output into its log (unbuffered: the log of a long compile can be
    followed as it runs) until the worker closes it. A log that cannot take more (a full
    disk) is left as it is and the output still read to the end: the worker must not block
    on a full pipe, and its own result says what the disk did to the job."""
    with open(log_path, "wb", buffering=0) as log:
        full = False
        while chunk := os.read(fd, 65536):
            if not full:
                try:
                    log.write(chunk)
                except OSError:
                    full = True
