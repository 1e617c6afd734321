"""The library API: ``build``, ``status`` and ``clean``. The CLI is a thin layer over it."""

from __future__ import annotations

import enum
import os
import posixpath
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import locks
from .commit import (
    check_removable,
    check_staged,
    clean_stale_staging,
    commit,
    hash_staged,
    make_staging,
)
from .errors import EpbuildError, Interrupted
from .fsutil import remove_tree
from .graph import Action
from .keys import ActionKey
from .plan import ActionPlan, make_plan, plan_action
from .providers import get_provider
from .statcache import Entry
from .state import ActionRecord, OutputRecord, State
from .workspace import Workspace, open_workspace

if TYPE_CHECKING:
    from .cache.actioncache import ActionCache

if TYPE_CHECKING:
    from .executor import Executor
    from .manifest import Manifest
    from .memory import MemoryPlan
    from .trace import Tracer


class Outcome(enum.Enum):
    """How an action ended in a build (or would, in a dry run)."""

    COMPILED = "compiled"
    RESTORED = "restored"
    UP_TO_DATE = "up_to_date"
    FAILED = "failed"
    SKIPPED = "skipped"
    WOULD_BUILD = "would_build"


@dataclass
class ActionResult:
    """One action's result."""

    id: str
    group: str
    provider: str
    outcome: Outcome
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    error: str | None = None
    hint: str | None = None
    log_tail: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    exit_code: int = 1
    """The exit code a failure of this action maps to (3: a lock wait timed out)."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        data: dict[str, Any] = {
            "id": self.id,
            "group": self.group,
            "provider": self.provider,
            "outcome": self.outcome.value,
            "seconds": round(self.seconds, 3),
            "outputs": self.outputs,
            "reasons": self.reasons,
        }
        if self.error:
            data["error"] = self.error
            if self.hint:
                data["hint"] = self.hint
            if self.log_tail:
                data["log_tail"] = self.log_tail
        if self.warnings:
            data["warnings"] = self.warnings
        return data


@dataclass
class BuildResult:
    """What a build did."""

    actions: list[ActionResult]
    seconds: float
    warnings: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        """How many actions ended with ``outcome``."""
        return sum(1 for a in self.actions if a.outcome is outcome)

    @property
    def ok(self) -> bool:
        """No action failed."""
        return self.count(Outcome.FAILED) == 0

    @property
    def exit_code(self) -> int:
        """0 on success, 3 if a lock wait timed out, else 1."""
        codes = {a.exit_code for a in self.actions if a.outcome is Outcome.FAILED}
        return 0 if not codes else 3 if 3 in codes else 1

    def summary(self) -> dict[str, Any]:
        """Counts per outcome plus the wall time."""
        data: dict[str, Any] = {o.value: self.count(o) for o in Outcome}
        data["total"] = len(self.actions)
        data["seconds"] = round(self.seconds, 3)
        return data

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "summary": self.summary(),
            "actions": [a.to_json() for a in self.actions],
            "warnings": self.warnings,
        }


class Reporter:
    """Receives progress events; the CLI renders them. The default ignores them."""

    def start(self, total: int, stale: int) -> None:
        """The build is about to run ``stale`` of ``total`` actions."""

    def action_started(self, action_id: str) -> None:
        """An action began compiling."""

    def action_finished(self, result: ActionResult) -> None:
        """An action ended."""

    def message(self, text: str) -> None:
        """A one-off note (waiting on a lock, a warning)."""


def _result(action: Action, outcome: Outcome, **kw: Any) -> ActionResult:
    return ActionResult(action.id, action.group.name, action.provider.name, outcome, **kw)


def status(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    cache: str | bool | None = None,
) -> list[ActionPlan]:
    """Every selected action as up to date or stale, with reasons. Takes no lock.

    A stale action's reasons end with what the cache says: restorable, or why not (the
    key components that differ from the newest cache entry of the same action id).
    """
    ws = open_workspace(directory, manifest, selectors)
    plans = make_plan(ws.actions, ws.state, ws.keys, ws.stats, ws.root)
    if any(p.stale and p.key for p in plans):
        cached = _open_cache(ws, directory, cache)
        if cached is not None:
            from .cache.explain import explain_plans

            explain_plans(cached, plans)
    _save_stats(ws)
    return plans


def _open_cache(
    ws: Workspace, directory: str | os.PathLike[str], option: str | bool | None, push: bool = False
) -> ActionCache | None:
    from .cache.location import open_cache

    return open_cache(
        option, base=os.path.abspath(directory), manifest_value=ws.manifest.workspace.cache,
        manifest_root=ws.root, push=push,
    )  # fmt: skip


def _save_stats(ws: Workspace) -> None:
    if not ws.stats.dirty or not os.path.isdir(ws.state_dir):
        return
    with locks.hold(ws.state_lock, "epbuild (saving the stat cache)"):
        ws.stats.save()


class _Builder:
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
        from .executor import LocalExecutor
        from .memory import MemoryPlan
        from .trace import Tracer

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
            return _result(
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
            return _result(action, Outcome.FAILED, reasons=plan.reasons, error=exc.message,
                           hint=exc.hint, exit_code=exc.exit_code)  # fmt: skip

    def _locked(self, plan: ActionPlan) -> ActionResult:
        ws, action, tracer = self.ws, plan.action, self.tracer
        with tracer.span("hash", action.id):
            state = ws.reload_state()
            again = plan_action(action, state, ws.keys, ws.stats, ws.root)
        if not again.stale:
            return _result(action, Outcome.UP_TO_DATE, outputs=_outputs(ws, action))
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
                return _result(
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
                return _result(
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
            return _result(
                action, Outcome.COMPILED, seconds=record.seconds, outputs=sorted(outputs),
                reasons=plan.reasons, warnings=warnings,
            )  # fmt: skip
        finally:
            remove_tree(os.path.join(ws.root, staging))

    def _restore(
        self, plan: ActionPlan, key: ActionKey, state: State
    ) -> tuple[ActionResult | None, str | None]:
        """Restore from the cache through the commit path; (None, why) when it cannot."""
        from .cache.actioncache import CacheDamagedError
        from .errors import VerificationError

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
            return _result(
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
        return _result(
            plan.action, Outcome.FAILED, reasons=plan.reasons, error=f"not in the cache: {why}",
            hint="build without --cache-only where the toolchain is installed, and push or "
            "export the cache",
        )  # fmt: skip

    def _store(self, action: Action, record: ActionRecord, note: str | None) -> list[str]:
        """Put a compiled action into the cache; returns warnings (never fails the build)."""
        warnings = [note] if note else []
        if self.cache is None:
            return warnings
        from .cache.store import CachedOutput

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
            from .manifest import model_stem

            names = [
                g.external_initializers if len(action.models) == 1 and not g.share_weights
                and len(g.models) == 1 else f"{model_stem(m)}_{g.external_initializers}"
                for m in action.models
            ]  # fmt: skip
        return {
            "provider": {
                "name": p.name, "ep": p.ep, "options": dict(p.options),
                "session_options": dict(p.session_options), "settings": dict(p.settings),
            },
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
        from .errors import VerificationError

        adapter = get_provider(action.provider.ep)
        warnings: list[str] = []
        for model, info in detail.get("models", {}).items():
            compat = info.get("compatibility")
            if compat:
                problem = adapter.check_compatibility(action.provider, compat)
                if problem:
                    raise VerificationError(f"{model}: {problem}")
            prefix = action.group.node_name_prefix
            if prefix and not all(n.startswith(prefix) for n in info.get("node_names", [])):
                versions = adapter.versions(action.provider)
                note = (
                    f"the {action.provider.ep} EP "
                    f"({', '.join(f'{k} {v}' for k, v in versions.items())})"
                    " ignores node_name_prefix; EPContext node names were not prefixed"
                )
                if note not in self.warned:
                    self.warned.add(note)
                    self.reporter.message(f"warning: {note}")
                    warnings.append(note)
        return warnings


def _outputs(ws: Workspace, action: Action) -> list[str]:
    rec = ws.state.records.get(action.id)
    return sorted(rec.outputs) if rec else []


def build(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    jobs: int | None = None,
    keep_going: bool = False,
    dry_run: bool = False,
    reporter: Reporter | None = None,
    lock_timeout: float | None = None,
    cache: str | bool | None = None,
    cache_only: bool = False,
    cache_push: bool = False,
    memory_budget: int | None = None,
    trace: str | os.PathLike[str] | None = None,
    executor: str | Executor | None = None,
    scheduler: str | None = None,
    loaded: Manifest | None = None,
) -> BuildResult:
    """Bring the selected actions up to date; returns what happened to each.

    ``memory_budget`` (bytes) caps the summed predicted peaks of concurrent local compiles
    (default: manifest, else a safe share of RAM); ``trace`` writes the timeline as Chrome
    trace-event JSON; ``executor`` is ``"local"``, ``"dask"`` (with ``scheduler``, a Dask
    scheduler address) or an ``Executor`` object. ``loaded`` builds with an already-loaded
    manifest instead of re-reading the file (watch keeps its last good one).
    """
    from .trace import TRACE_NAME, Tracer

    t0 = time.perf_counter()
    tracer = Tracer()
    reporter = reporter or Reporter()
    with tracer.span("plan"):
        ws = open_workspace(directory, manifest, selectors, loaded=loaded)
        warnings = list(ws.state.warnings)
        for w in warnings:
            reporter.message(f"warning: {w}")
        plans = make_plan(ws.actions, ws.state, ws.keys, ws.stats, ws.root)
    stale = [p for p in plans if p.stale]
    results: dict[str, ActionResult] = {
        p.action.id: _result(p.action, Outcome.UP_TO_DATE, outputs=_outputs(ws, p.action))
        for p in plans
        if not p.stale
    }
    if dry_run or not stale:
        for p in stale:
            results[p.action.id] = _result(p.action, Outcome.WOULD_BUILD, reasons=p.reasons)
        if not dry_run:
            _save_stats(ws)
        if trace is not None:
            tracer.write(trace)
        done = BuildResult([results[p.action.id] for p in plans], time.perf_counter() - t0,
                           warnings)  # fmt: skip
        if not dry_run and not stale and not warnings and trace is None:
            _record_noop(ws, plans, selectors, done)
        return done
    run_on, jobs, memory = _executor_for(ws, stale, executor, scheduler, jobs, memory_budget)
    os.makedirs(ws.state_dir, exist_ok=True)
    with locks.hold(ws.state_lock, "epbuild build (startup)", timeout=lock_timeout):
        clean_stale_staging(ws.root, ws.manifest.workspace.out_dir)
        if ws.state.warnings:
            ws.journal.compact_if_needed(ws.reload_state())
    reporter.start(len(plans), len(stale))
    builder = _Builder(
        ws,
        jobs=jobs,
        keep_going=keep_going,
        reporter=reporter,
        lock_timeout=lock_timeout,
        executor=run_on,
        tracer=tracer,
        memory=memory,
    )
    # cache: a directory or URL, False for none, None for the configured one; cache_only
    # fails what the cache cannot restore; cache_push also writes compiles to a remote cache.
    builder.cache = _open_cache(ws, directory, cache, cache_push)
    builder.cache_only = cache_only
    builder.keep_going = keep_going or cache_only  # list everything that is missing
    try:
        results.update(_schedule(builder, stale))
    finally:
        builder.executor.close()
        _save_stats(ws)
        with locks.hold(ws.state_lock, "epbuild build (finish)"):
            ws.journal.sync()  # restores' done records
            ws.journal.compact_if_needed(ws.reload_state())
        tracer.write(os.path.join(ws.state_dir, TRACE_NAME))
        if trace is not None:
            tracer.write(trace)
    return BuildResult([results[p.action.id] for p in plans], time.perf_counter() - t0, warnings)


def _record_noop(
    ws: Workspace, plans: list[ActionPlan], selectors: list[str] | tuple[str, ...],
    result: BuildResult,
) -> None:  # fmt: skip
    """Let the next no-op build answer from stats alone (see ``noop``)."""
    from .noop import write_fingerprint

    try:
        write_fingerprint(ws, plans, selectors, result.to_json())
    except (OSError, EpbuildError):
        pass  # only an optimisation: the full path stays correct without it


def _executor_for(
    ws: Workspace,
    stale: list[ActionPlan],
    executor: str | Executor | None,
    scheduler: str | None,
    jobs: int | None,
    memory_budget: int | None,
) -> tuple[Executor, int, MemoryPlan]:
    """The executor, slot count and memory plan of a build."""
    from .errors import UserError
    from .executor import LocalExecutor
    from .memory import MemoryPlan, default_budget, predict_peak

    peaks = {p.action.id: predict_peak(p, ws.state, ws.stats, ws.root) for p in stale}
    kind = executor if executor is not None else ws.manifest.workspace.executor
    if isinstance(kind, str) and kind == "dask":
        from .dask_executor import DaskExecutor

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


def _schedule(builder: _Builder, stale: list[ActionPlan]) -> dict[str, ActionResult]:
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
        results[plan.action.id] = _result(
            plan.action, Outcome.SKIPPED, reasons=plan.reasons,
            error="not started because an earlier action failed (use -k to keep going)",
        )  # fmt: skip
    return results


def orphaned_actions(ws: Workspace) -> list[str]:
    """Recorded actions the manifest no longer has (their outputs are still on disk)."""
    from .graph import make_actions

    current = {a.id for a in make_actions(ws.manifest)}
    return sorted(i for i in ws.state.records if i not in current)


def orphaned(
    directory: str | os.PathLike[str] = ".", manifest: str | os.PathLike[str] | None = None
) -> list[str]:
    """Ids of built actions the manifest no longer has; ``clean`` removes their outputs."""
    return orphaned_actions(open_workspace(directory, manifest))


def clean(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """Remove the selected actions' outputs and records; returns the removed paths."""
    ws = open_workspace(directory, manifest, selectors)
    removed: list[str] = []
    if not os.path.isdir(ws.state_dir):
        return removed
    with locks.hold(ws.state_lock, "epbuild clean"):
        state = ws.reload_state()
        ids = [a.id for a in ws.actions]
        if not selectors:  # also what earlier manifests built and this one no longer has
            ids += orphaned_actions(ws)
        for action_id in ids:  # refuse before deleting anything
            rec = state.records.get(action_id)
            outputs = list(rec.outputs) if rec else []
            check_removable(ws.root, ws.manifest.workspace.out_dir, outputs)
        for action_id in ids:
            rec = state.records.get(action_id)
            paths = list(rec.outputs) if rec else []
            for rel in paths:
                full = os.path.join(ws.root, rel)
                if os.path.lexists(full):
                    os.unlink(full)
                    removed.append(rel)
            if rec or action_id in state.interrupted:
                ws.journal.forget(action_id)
        clean_stale_staging(ws.root, ws.manifest.workspace.out_dir)
    top = os.path.join(ws.root, ws.manifest.workspace.out_dir)
    for rel in removed:  # drop directories we emptied, never above out_dir
        d = os.path.dirname(os.path.join(ws.root, rel))
        while (d.startswith(top + os.sep) and os.path.isdir(d) and not os.path.islink(d)
               and not os.listdir(d)):  # fmt: skip
            os.rmdir(d)
            d = os.path.dirname(d)
    return removed
