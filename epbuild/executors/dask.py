"""Run actions on a Dask distributed cluster: a compile farm without a home-made scheduler.

Each action is one Dask task. The task runs the same fresh ``python -m epbuild.executors.worker``
subprocess as the local executor, in a private temporary directory on the Dask worker that
holds the action's inputs at their workspace-relative paths (so the EP sees the same model
path strings and writes byte-identical outputs). Inputs travel with the task, each checked
against the digest the coordinator's key was computed from; the staged outputs travel back
with their digests, which the coordinator checks again before it writes them into its own
staging directory. From there the build goes on exactly as with the local executor: the
coordinator alone verifies, commits and records state.

A Dask worker that dies mid-action makes the scheduler run the task elsewhere (Dask's
``allowed-failures``, 3 by default); past that the action fails, with nothing committed.
A cluster without workers fails the build (at the start) or its actions (once the last
worker is gone) after ``worker_wait`` seconds (two minutes: long enough for an adaptive
cluster to start one), instead of queueing them forever; a lost scheduler fails the actions
it held, named as such.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import replace
from epbuild._names import LOG_NAME, RESULT_NAME
from epbuild.errors import UserError
from epbuild.executors.local import WORKER_BOOT, WorkerOutcome, outcome_of, send_job
from epbuild.fs import is_safe_reference

if TYPE_CHECKING:
    from distributed import Client, Future

    from epbuild.executors.job import Job

SCATTER_OVER = 8 << 20
"""Inputs larger than this are scattered to the workers once instead of riding in the task."""
MEMORY_RESOURCE = "memory"
"""A worker started with ``--resources memory=BYTES`` gets work by predicted peak memory."""

POLL = 1.0
"""Seconds between the checks a waiting action makes that the cluster still has workers."""

# Worker-side registry of running compile subprocesses, so ``cancel`` can stop them.
_PROCS: dict[str, subprocess.Popen[bytes]] = {}
_PROCS_LOCK = threading.Lock()


class InputChanged(Exception):
    """An input's bytes do not match the digest the action's key was computed from."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def remote_run(job: Job, files: dict[str, tuple[str, bytes]]) -> dict[str, Any]:
    """Runs on a Dask worker: lay out the inputs, run one worker subprocess, return outputs."""
    tmp = tempfile.mkdtemp(prefix="epbuild-dask-")
    try:
        for rel, (digest, data) in files.items():
            if not is_safe_reference(rel):
                raise ValueError(f"refusing input path {rel!r}")
            if _sha256(data) != digest:
                raise InputChanged(f"{rel}: bytes received do not match digest {digest[:12]}")
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        staging = os.path.join(tmp, job.staging)
        os.makedirs(staging)
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_BOOT],
            cwd=tmp,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with _PROCS_LOCK:
            _PROCS[job.token] = proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            send_job(proc, job)
            log = proc.stdout.read()
            code = proc.wait()
        finally:
            with _PROCS_LOCK:
                _PROCS.pop(job.token, None)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()
        outputs: dict[str, tuple[str, bytes]] = {}
        result: str | None = None
        for name in sorted(os.listdir(staging)):
            full = os.path.join(staging, name)
            if name == RESULT_NAME:
                with open(full, encoding="utf-8") as f:
                    result = f.read()
            elif name != LOG_NAME and os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    data = f.read()
                outputs[name] = (_sha256(data), data)
        return {"code": code, "result": result, "log": log[-65536:], "outputs": outputs}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_tokens(tokens: list[str]) -> int:
    """Runs on each Dask worker: kill the compile subprocesses of the given jobs."""
    killed = 0
    with _PROCS_LOCK:
        for token in tokens:
            proc = _PROCS.get(token)
            if proc is not None and proc.poll() is None:
                proc.kill()
                killed += 1
    return killed


class DaskExecutor:
    """Runs each job as a Dask task on a cluster (``Executor`` protocol)."""

    def __init__(
        self,
        root: str,
        scheduler: str | Client,
        *,
        connect_timeout: float = 20,
        worker_wait: float = 120,
    ) -> None:
        try:
            import distributed  # noqa: F401
        except ImportError:
            raise UserError(
                "the dask executor needs Dask distributed, which is not installed",
                hint="pip install 'epbuild[dask]'",
            ) from None
        self.root = root
        self._own = isinstance(scheduler, str)
        self.grace = worker_wait
        """Seconds the cluster may be without workers before what waits for one fails."""
        if isinstance(scheduler, str):
            from epbuild.executors.address import connect

            self.address = scheduler
            self.client = connect(scheduler, connect_timeout)
            # Its failures are this executor's to report, in one line each: not the client's
            # log records (a lost scheduler logs the client's reconnect traceback).
            logging.getLogger("distributed.client").addFilter(_quiet)
        else:
            rpc = scheduler.scheduler
            self.address = str(rpc.address) if rpc is not None else "its address"
            self.client = scheduler
        self._lock = threading.Lock()
        self._running: dict[str, Future[Any]] = {}
        self._scattered: dict[str, Future[Any]] = {}
        try:
            self.client.wait_for_workers(1, timeout=worker_wait)
        except Exception as exc:
            self.close()
            if not isinstance(exc, TimeoutError):
                raise
            raise UserError(
                f"the Dask scheduler at {self.address} has no workers "
                f"(none joined within {worker_wait:g} s)",
                hint=f"start one on each compile machine: dask worker {self.address}",
            ) from None

    def _workers(self) -> dict[str, Any]:
        workers: dict[str, Any] = self.client.scheduler_info(n_workers=-1).get("workers", {})
        return workers

    def slots(self) -> int:
        """Compiles the cluster runs at once (its workers' threads)."""
        return max(1, sum(int(w.get("nthreads", 1)) for w in self._workers().values()))

    def _resources(self, peak: int) -> dict[str, float] | None:
        """Map a predicted peak onto worker resources, when every worker declares memory."""
        caps = [w.get("resources", {}).get(MEMORY_RESOURCE) for w in self._workers().values()]
        if not caps or any(c is None for c in caps) or peak <= 0:
            return None
        return {MEMORY_RESOURCE: float(min(peak, max(caps)))}  # too big for any: the biggest

    def _inputs(self, job: Job) -> dict[str, Any]:
        """The job's inputs as task arguments: small ones inline, big ones scattered once."""
        files: dict[str, Any] = {}
        for rel, digest in sorted(job.inputs.items()):
            with self._lock:
                if digest in self._scattered:
                    files[rel] = self._scattered[digest]
                    continue
            with open(os.path.join(self.root, rel), "rb") as f:
                data = f.read()
            if _sha256(data) != digest:
                raise InputChanged(f"{rel} changed after it was hashed")
            if len(data) > SCATTER_OVER:
                # Replicated on every worker: a killed worker does not lose it.
                future = self.client.scatter(  # type: ignore[no-untyped-call]
                    [(digest, data)], broadcast=True, hash=False
                )[0]
                with self._lock:
                    self._scattered[digest] = future
                files[rel] = future
            else:
                files[rel] = (digest, data)
        return files

    def run(self, job: Job) -> WorkerOutcome:
        """Run one job on the cluster; its outputs land in the local staging directory."""
        from distributed import KilledWorker

        if job.boot:
            return WorkerOutcome(
                False,
                error=f"action {job.action_id!r} runs in its provider's toolchain, and the Dask "
                "executor runs jobs only in the farm workers' own environment",
                hint="build this provider with the local executor (epbuild build --executor "
                "local), or install its packages on the farm and drop its toolchain",
            )
        staging = os.path.join(self.root, job.staging)
        token = f"epbuild-{uuid.uuid4().hex}"
        job = replace(job, token=token)
        try:
            files = self._inputs(job)
            future = self.client.submit(
                remote_run,
                job,
                files,
                key=token,
                pure=False,
                resources=self._resources(job.predicted_peak),
            )
            with self._lock:
                self._running[token] = future
            reply: dict[str, Any] = self._result(future)
        except _NoWorkers as exc:
            self.client.cancel([future], force=True)  # type: ignore[no-untyped-call]
            return WorkerOutcome(
                False,
                error=f"the Dask scheduler at {self.address} has had no workers for "
                f"{exc.args[0]:g} s, so nothing ran this action",
                hint=f"start workers (dask worker {self.address}), then run the build again",
            )
        except KilledWorker as exc:
            return WorkerOutcome(
                False,
                error=f"the Dask workers running this action died repeatedly ({exc})",
                hint="check the workers' memory limits and logs; nothing was committed",
            )
        except InputChanged as exc:
            return WorkerOutcome(False, error=str(exc), hint="run the build again")
        except Exception as exc:  # a cancelled future or a Dask-side failure
            lost = getattr(exc, "reason", None) == "scheduler-connection-lost"
            if lost or self.client.status != "running":
                return WorkerOutcome(
                    False,
                    error=f"lost the connection to the Dask scheduler at {self.address}; "
                    "nothing of this action was committed",
                    hint="check that the scheduler is running and reachable, then run the "
                    "build again",
                )
            return WorkerOutcome(False, error=f"Dask: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._running.pop(token, None)
        return self._land(staging, reply)

    def _result(self, future: Future[Any]) -> Any:
        """The future's result; raises ``_NoWorkers`` once the cluster has had no worker for
        ``grace`` seconds (the task would wait for one forever)."""
        since: float | None = None
        while True:
            try:
                return future.result(timeout=POLL)
            except TimeoutError:
                if future.done():  # type: ignore[no-untyped-call]
                    raise
            try:  # (a lost scheduler is for the future to say)
                idle = self.client.status == "running" and not self._workers()
            except Exception:
                idle = False
            now = time.monotonic()
            since = (since or now) if idle else None
            if since is not None and now - since >= self.grace:
                raise _NoWorkers(self.grace)

    def _land(self, staging: str, reply: dict[str, Any]) -> WorkerOutcome:
        """Write the returned outputs into the staging directory, checking each digest."""
        log_path = os.path.join(staging, LOG_NAME)
        with open(log_path, "wb") as f:
            f.write(reply["log"])
        for name, (digest, data) in reply["outputs"].items():
            if "/" in name or name.startswith(".") or name in (RESULT_NAME, LOG_NAME):
                return WorkerOutcome(False, error=f"the worker returned a bad file name {name!r}")
            if _sha256(data) != digest:
                return WorkerOutcome(False, error=f"{name}: corrupted in transfer (digest)")
            with open(os.path.join(staging, name), "wb") as f:
                f.write(data)
        code = int(reply["code"])
        try:
            result = json.loads(reply["result"]) if reply["result"] is not None else None
        except ValueError:
            result = None
        if isinstance(result, dict):
            with open(os.path.join(staging, RESULT_NAME), "w", encoding="utf-8") as f:
                json.dump(result, f)
        return outcome_of(result, code, log_path)

    def cancel(self) -> None:
        """Cancel running tasks and kill their compile subprocesses."""
        with self._lock:
            tokens = list(self._running)
            futures = list(self._running.values())
        if futures:
            try:
                self.client.run(_kill_tokens, tokens)
            except Exception:
                pass  # best effort: a worker may be gone already
            self.client.cancel(futures, force=True)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Release scattered inputs; disconnect from a scheduler we connected to."""
        with self._lock:
            scattered = list(self._scattered.values())
            self._scattered.clear()
        if scattered:
            self.client.cancel(scattered)  # type: ignore[no-untyped-call]
        if self._own:
            self.client.close()  # type: ignore[no-untyped-call]
            logging.getLogger("distributed.client").removeFilter(_quiet)


class _NoWorkers(Exception):
    """The cluster has had no workers for ``args[0]`` seconds."""


def _quiet(record: logging.LogRecord) -> bool:
    """A logging filter that drops every record."""
    return False
