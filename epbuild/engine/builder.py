"""Running a build's stale actions: the per-action builder and the one scheduling loop."""

from __future__ import annotations

import os
import posixpath
import time
from typing import TYPE_CHECKING, Any

from epbuild._names import model_stem
from epbuild.engine.staging import check_staged, commit, hash_staged, make_staging
from epbuild.errors import EpbuildError, Interrupted
from epbuild.fs import remove_tree
from epbuild.planning.actions import Action
from epbuild.planning.keys import ActionKey
from epbuild.planning.staleness import ActionPlan, plan_action
from epbuild.providers import get_provider
from epbuild.results import ActionResult, Outcome, Reporter, action_result
from epbuild.state import locks
from epbuild.state.journal import ActionRecord, OutputRecord, State
from epbuild.state.statcache import Entry
from epbuild.state.workspace import Workspace

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache
    from epbuild.engine.memory import MemoryPlan
    from epbuild.engine.trace import Tracer
    from epbuild.executors.local import Executor


def open_action_cache(
    ws: Workspace, directory: str | os.PathLike[str], option: str | bool | None, push: bool = False
) -> ActionCache | None:
    from epbuild.cache.location import open_cache

    return open_cache(
        option, base=os.path.abspath(directory), manifest_value=ws.manifest.workspace.cache,
        manifest_root=ws.root, push=push,
    )  # fmt: skip


def save_stats(ws: Workspace) -> None:
    """Persist new stat-cache entries (under the state lock)."""
    if not ws.stats.dirty or not os.path.isdir(ws.state_dir):
        return
    with locks.hold(ws.state_lock, "epbuild (saving the stat cache)"):
        ws.stats.save()


class Builder:
    """Runs the stale actions of one build."""

    cache: ActionCache | None = None
    """Restores actions before compiling them and stores them after (None: no cache)."""
    cache_only: bool = False
    """Fail an action that the cache cannot restore instead of compiling it."""

    def __init__(
        self,
        ws: Workspace,
        *,
        jobs: int,
        keep_going: bool,
        reporter: Reporter,
        lock_timeout: float | None,
        executor: Executor | None = None,
        tracer: Tracer | None = None,
        memory: MemoryPlan | None = None,
    ) -> None:
        from epbuild.engine.memory import MemoryPlan
        from epbuild.engine.trace import Tracer
        from epbuild.executors.local import LocalExecutor

        self.ws = ws
        self.jobs = jobs
        self.keep_going = keep_going
        self.reporter = reporter
        self.lock_timeout = lock_timeout
        self.executor: Executor = executor or LocalExecutor(ws.root, prewarm=True)
        self.tracer = tracer or Tracer()
        self.memory = memory or MemoryPlan(None, {})
        self.warned: set[str] = set()

    def run_one(self, plan: ActionPlan) -> ActionResult:
        action = plan.action
        if plan.error is not None:
            return action_result(
                action, Outcome.FAILED, reasons=plan.reasons, error=plan.error.message,
                hint=plan.error.hint,
            )  # fmt: skip
        waited = self.tracer.now()
        try:
            with locks.hold(
                self.ws.action_lock(action),
                f"epbuild build {action.id}",
                timeout=self.lock_timeout,
                on_wait=lambda msg: self.reporter.message(f"{action.id}: {msg}"),
            ):
                self.tracer.add("lock", waited, action.id)
                return self._locked(plan)
        except EpbuildError as exc:
            return action_result(action, Outcome.FAILED, reasons=plan.reasons, error=exc.message,
                           hint=exc.hint, exit_code=exc.exit_code)  # fmt: skip

    def _locked(self, plan: ActionPlan) -> ActionResult:
        ws, action, tracer = self.ws, plan.action, self.tracer
        with tracer.span("hash", action.id):
            state = ws.reload_state()
            again = plan_action(action, state, ws.keys, ws.stats, ws.root)
        if not again.stale:
            return action_result(action, Outcome.UP_TO_DATE, outputs=recorded_outputs(ws, action))
        assert again.key is not None
        key = again.key
        cache_note = None
        if self.cache is not None:
            with tracer.span("restore", action.id):
                restored, cache_note = self._restore(plan, key, state)
            if restored is not None:
                return restored
        if self.cache_only:
            return self._not_cached(plan, key, cache_note)
        self.reporter.action_started(action.id)
        staging = make_staging(ws.root, ws.manifest.workspace.out_dir, action.slug)
        try:
            job = self._job(action, staging)
            job["inputs"] = dict(key.inputs)  # for executors that ship inputs elsewhere
            job["predicted_peak"] = self.memory.peaks.get(action.id, 0)
            started = tracer.now()
            outcome = self.executor.run(job)
            tracer.add("compile", started, action.id, ok=outcome.ok,
                       peak_rss=outcome.result.get("peak_rss"))  # fmt: skip
            if not outcome.ok:
                return action_result(
                    action, Outcome.FAILED, reasons=plan.reasons,
                    error=outcome.error, hint=outcome.hint, log_tail=outcome.log_tail,
                )  # fmt: skip
            started = tracer.now()
            names = check_staged(ws.root, staging, action.ctx_names)
            outputs = hash_staged(ws.root, staging, action.out_dir, names)
            warnings = self._check_detail(action, outcome.result.get("detail", {}))
            changed = [
                rel for rel, digest in key.inputs.items()
                if ws.stats.digest(ws.root, rel).digest != digest
            ]  # fmt: skip
            tracer.add("verify", started, action.id)
            if changed:
                return action_result(
                    action, Outcome.FAILED, reasons=plan.reasons,
                    error=f"input {changed[0]} changed while it was being compiled; "
                    "the result was discarded",
                    hint="run the build again once the file is written",
                )  # fmt: skip
            started = tracer.now()
            record = ActionRecord(
                id=action.id,
                key=key.key,
                components=key.components,
                outputs=outputs,
                seconds=float(outcome.result.get("seconds", 0.0)),
                peak_rss=int(outcome.result.get("peak_rss", 0)),
                at=time.time(),
                detail=outcome.result.get("detail", {}),
            )
            old = list(state.records[action.id].outputs) if action.id in state.records else []
            with locks.hold(ws.state_lock, f"epbuild commit {action.id}"):
                ws.journal.begin(action.id, key.key)
            commit(ws.root, staging, action.out_dir, names, old)
            for rel, out in outputs.items():
                st = os.stat(os.path.join(ws.root, rel))
                ws.stats.remember(rel, Entry(st.st_ino, st.st_size, st.st_mtime_ns, out.digest))
            with locks.hold(ws.state_lock, f"epbuild commit {action.id}"):
                ws.journal.done(record)
            tracer.add("commit", started, action.id)
            warnings += self._store(action, record, cache_note)
            return action_result(
                action, Outcome.COMPILED, seconds=record.seconds, outputs=sorted(outputs),
                reasons=plan.reasons, warnings=warnings,
            )  # fmt: skip
        finally:
            remove_tree(os.path.join(ws.root, staging))

    def _restore(
        self, plan: ActionPlan, key: ActionKey, state: State
    ) -> tuple[ActionResult | None, str | None]:
        """Restore from the cache through the commit path; (None, why) when it cannot."""
        from epbuild.cache.actioncache import CacheDamagedError
        from epbuild.errors import VerificationError

        assert self.cache is not None
        ws, action, t0 = self.ws, plan.action, time.perf_counter()
        staging = make_staging(ws.root, ws.manifest.workspace.out_dir, action.slug)
        try:
            try:
                hit = self.cache.restore(key.key, os.path.join(ws.root, staging))
                if hit is None:
                    return None, None
                names = check_staged(ws.root, staging, action.ctx_names)
                if set(names) != set(hit.entry.outputs):
                    raise VerificationError("outputs do not match the entry")
            except (CacheDamagedError, VerificationError) as exc:
                if isinstance(exc, VerificationError):
                    self.cache.local.discard(key.key)
                note = f"cache entry of {action.id} not restored: {exc}"
                self.reporter.message(f"warning: {note}")
                return None, note
            except OSError as exc:
                note = f"cache unusable for {action.id}: {exc}"
                self.reporter.message(f"warning: {note}")
                return None, note
            e = hit.entry
            record = ActionRecord(
                id=action.id, key=key.key, components=key.components,
                outputs={posixpath.join(action.out_dir, n): OutputRecord(o.size, o.digest)
                         for n, o in e.outputs.items()},
                seconds=e.seconds, peak_rss=e.peak_rss, at=time.time(), detail=e.detail,
                restored=True,
            )  # fmt: skip
            old = list(state.records[action.id].outputs) if action.id in state.records else []
            # One state-lock hold for begin → commit (renames only) → done; the done record
            # is made durable by build()'s final journal sync: lost, it costs a re-restore.
            with locks.hold(ws.state_lock, f"epbuild restore {action.id}"):
                ws.journal.begin(action.id, key.key)
                commit(ws.root, staging, action.out_dir, names, old)
                for rel, out in record.outputs.items():
                    st = os.stat(os.path.join(ws.root, rel))
                    ws.stats.remember(rel, Entry(st.st_ino, st.st_size, st.st_mtime_ns, out.digest))
                ws.journal.done(record, sync=False)
            return action_result(
                action, Outcome.RESTORED, seconds=time.perf_counter() - t0,
                outputs=sorted(record.outputs), reasons=plan.reasons,
            ), None  # fmt: skip
        finally:
            remove_tree(os.path.join(ws.root, staging))

    def _not_cached(self, plan: ActionPlan, key: ActionKey, note: str | None) -> ActionResult:
        """The --cache-only failure of an action the cache could not restore."""
        why = note or (
            self.cache.explain_miss(plan.action.id, key.components)
            if self.cache is not None else "the cache is off"
        )  # fmt: skip
        return action_result(
            plan.action, Outcome.FAILED, reasons=plan.reasons, error=f"not in the cache: {why}",
            hint="build without --cache-only where the toolchain is installed, and push or "
            "export the cache",
        )  # fmt: skip

    def _store(self, action: Action, record: ActionRecord, note: str | None) -> list[str]:
        """Put a compiled action into the cache; returns warnings (never fails the build)."""
        warnings = [note] if note else []
        if self.cache is None:
            return warnings
        from epbuild.cache.store import CachedOutput

        try:
            self.cache.save(
                key=record.key, action_id=action.id, components=record.components,
                src_dir=os.path.join(self.ws.root, action.out_dir),
                outputs={posixpath.basename(p): CachedOutput(o.size, o.digest)
                         for p, o in record.outputs.items()},
                seconds=record.seconds, peak_rss=record.peak_rss, detail=record.detail,
            )  # fmt: skip
        except Exception as exc:  # a cache that cannot be written must not fail a build
            note = f"{action.id} not stored in the cache {self.cache.describe()}: {exc}"
            self.reporter.message(f"warning: {note}")
            warnings.append(note)
        return warnings

    def _job(self, action: Action, staging: str) -> dict[str, Any]:
        g, p = action.group, action.provider
        names = None
        if g.external_initializers:
            names = [
                g.external_initializers if len(action.models) == 1 and not g.share_weights
                and len(g.models) == 1 else f"{model_stem(m)}_{g.external_initializers}"
                for m in action.models
            ]  # fmt: skip
        return {
            "provider": p.to_json(),
            "models": list(action.models),
            "staging": staging,
            "share_weights": g.share_weights,
            "embed_mode": g.embed_mode,
            "node_name_prefix": g.node_name_prefix,
            "external_initializers": g.external_initializers,
            "external_initializers_names": names,
            "load": g.load,
        }  # fmt: skip

    def _check_detail(self, action: Action, detail: dict[str, Any]) -> list[str]:
        """The worker's report against the rules: an error fails the action; a warning is
        said once per build and returned."""
        from epbuild.errors import VerificationError
        from epbuild.onnx.context import Severity, report_problems

        adapter = get_provider(action.provider.ep)
        prefix = action.group.node_name_prefix
        warnings: list[str] = []
        for model, report in detail.get("models", {}).items():
            for p in report_problems(model, report, adapter, action.provider, prefix):
                if p.severity is Severity.ERROR:
                    raise VerificationError(p.line())
                if p.message not in self.warned:
                    self.warned.add(p.message)
                    self.reporter.message(f"warning: {p.message}")
                    warnings.append(p.message)
        return warnings


def recorded_outputs(ws: Workspace, action: Action) -> list[str]:
    rec = ws.state.records.get(action.id)
    return sorted(rec.outputs) if rec else []


def executor_for(
    ws: Workspace,
    stale: list[ActionPlan],
    executor: str | Executor | None,
    scheduler: str | None,
    jobs: int | None,
    memory_budget: int | None,
) -> tuple[Executor, int, MemoryPlan]:
    """The executor, slot count and memory plan of a build."""
    from epbuild.engine.memory import MemoryPlan, default_budget, predict_peak
    from epbuild.errors import UserError
    from epbuild.executors.local import LocalExecutor

    peaks = {p.action.id: predict_peak(p, ws.state, ws.stats, ws.root) for p in stale}
    kind = executor if executor is not None else ws.manifest.workspace.executor
    if isinstance(kind, str) and kind == "dask":
        from epbuild.executors.dask import DaskExecutor

        address = scheduler or ws.manifest.workspace.scheduler
        if not address:
            raise UserError(
                "the dask executor needs a scheduler address",
                hint="pass --scheduler tcp://HOST:PORT or set scheduler in [workspace]",
            )
        dask = DaskExecutor(ws.root, address)
        # The farm's workers hold the memory: map predictions onto their resources instead.
        return dask, max(1, jobs or dask.slots()), MemoryPlan(None, peaks)
    if isinstance(kind, str):
        if kind != "local":
            raise UserError(f"unknown executor {kind!r}", hint="use local or dask")
        run_on: Executor = LocalExecutor(ws.root, prewarm=True)
    else:
        run_on = kind
    budget = memory_budget or ws.manifest.workspace.memory_budget or default_budget()
    return run_on, max(1, jobs or ws.manifest.workspace.jobs), MemoryPlan(budget, peaks)


def schedule(builder: Builder, stale: list[ActionPlan]) -> dict[str, ActionResult]:
    """One loop: start ready actions up to -j while their predicted memory fits the budget,
    wait for the first to finish, repeat."""
    from collections import deque
    from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

    results: dict[str, ActionResult] = {}
    pending = deque(stale)
    running: dict[Future[ActionResult], ActionPlan] = {}
    stop = False
    pool = ThreadPoolExecutor(max_workers=builder.jobs, thread_name_prefix="epbuild-slot")
    try:
        while pending or running:
            while pending and len(running) < builder.jobs and not stop:
                taken = builder.memory.take(pending, idle=not running)
                if taken is None:
                    break
                running[pool.submit(builder.run_one, taken)] = taken
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                plan = running.pop(fut)
                builder.memory.release(plan)
                res = fut.result()
                results[plan.action.id] = res
                builder.reporter.action_finished(res)
                if res.outcome is Outcome.FAILED and not builder.keep_going:
                    stop = True
    except KeyboardInterrupt:
        builder.executor.cancel()
        wait(running)
        pool.shutdown(wait=True)
        raise Interrupted("interrupted; workers stopped, nothing half-written was kept") from None
    pool.shutdown(wait=True)
    for plan in pending:
        results[plan.action.id] = action_result(
            plan.action, Outcome.SKIPPED, reasons=plan.reasons,
            error="not started because an earlier action failed (use -k to keep going)",
        )  # fmt: skip
    return results
