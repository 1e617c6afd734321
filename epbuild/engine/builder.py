"""Running one build's stale actions: restore or run each, verify, commit, record."""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import threading
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import replace
from epbuild._names import PROGRESS_NAME, left_id
from epbuild._version import __version__
from epbuild.cache.actioncache import CacheDamagedError
from epbuild.docsite import page_url
from epbuild.engine.staging import WRITE_HINT, commit_journaled, hash_staged, make_staging
from epbuild.errors import EpbuildError, StorageError, VerificationError
from epbuild.executors.outofmemory import MemorySettings, explain, killed_cause, strip_model
from epbuild.fs import inside, os_error_text, remove_tree
from epbuild.kinds.contract import GraphAction, Kind, RunContext, kind_of, stored_by_link
from epbuild.onnx.context import machine_paths
from epbuild.planning.keys import ActionKey
from epbuild.planning.moves import moved_from
from epbuild.planning.staleness import ActionPlan, plan_action
from epbuild.planning.workspace import Workspace, recorded_outputs
from epbuild.results import ActionResult, Outcome, Reporter, action_result
from epbuild.state import locks
from epbuild.state.journal import ActionRecord, OutputRecord, State, done_line
from epbuild.state.statcache import Entry

if TYPE_CHECKING:
    from collections.abc import Callable

    from epbuild.cache.actioncache import ActionCache
    from epbuild.engine.memory import MemoryPlan
    from epbuild.engine.scheduler import Execution
    from epbuild.engine.trace import Tracer
    from epbuild.executors.job import Job
    from epbuild.executors.local import Executor, WorkerOutcome
    from epbuild.onnx.context import MachinePaths


_CANNOT_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
"""What a restore meets only where it writes: the workspace is full or read-only."""


def _leave_behind(ws: Workspace, action: GraphAction, previous: ActionRecord) -> list[str]:
    """Before ``action`` is committed in its new place: keep the outputs its record lists
    elsewhere (``[workspace]`` moved them) under a record of their own, an orphan that
    ``clean --orphaned`` removes; returns the recorded outputs that are in the new place
    (those the commit replaces). Caller holds the state lock."""
    kept = [rel for rel in previous.outputs if rel.startswith(action.out_dir + "/")]
    left = {rel: o for rel, o in previous.outputs.items() if rel not in kept}
    if any(os.path.lexists(os.path.join(ws.root, rel)) for rel in left):
        folder = moved_from(action.out_dir, left)
        assert folder is not None
        ws.journal.done(replace(previous, id=left_id(action.id, folder), outputs=left), sync=False)
    return kept


class Builder:
    """Runs the stale actions of one build, one ``run_one`` per action (``schedule`` calls it)."""

    def __init__(
        self,
        ws: Workspace,
        run: Execution,
        *,
        keep_going: bool,
        reporter: Reporter,
        lock_timeout: float | None,
        tracer: Tracer,
        cache: ActionCache | None = None,
        cache_only: bool = False,
    ) -> None:
        self.ws = ws
        self.jobs = run.jobs
        """Actions run at once."""
        self.executor: Executor = run.executor
        """Runs the jobs; it belongs to the caller, who closes it."""
        self.memory: MemoryPlan = run.memory
        self.keep_going = keep_going
        """Start the remaining actions after one failed."""
        self.reporter = reporter
        self.lock_timeout = lock_timeout
        self.tracer = tracer
        self.cache = cache
        """Restores actions before compiling them and stores them after (None: no cache)."""
        self.cache_only = cache_only
        """Fail an action that the cache cannot restore instead of compiling it."""
        self.restores_only = cache_only
        """No action starts a worker (the scheduler may run a lone one in its own thread)."""
        self._machine: MachinePaths | None = None
        """The build machine's paths (`_machine_paths`), computed at the first commit."""
        self.warned: set[str] = set()
        self._warn_lock = threading.Lock()

    def run_one(self, plan: ActionPlan) -> ActionResult:
        """Bring one action up to date under its lock; any failure comes back as a result."""
        action = plan.action
        if plan.error is not None and not action.deps:  # with deps: planned again below
            error = plan.error
            return _failed(plan, error.message, error.hint, exit_code=error.exit_code)
        waited = self.tracer.now()
        try:
            with locks.hold(
                self.ws.action_lock(action),
                f"epbuild build {action.id}",
                timeout=self.lock_timeout,
                on_wait=lambda msg: self.reporter.message(f"{action.id}: {msg}"),
                within=self.ws.state_dir,
            ):
                self.tracer.add("lock", waited, action.id)
                return self._locked(plan)
        except EpbuildError as exc:
            return _failed(plan, exc.message, exc.hint, exit_code=exc.exit_code)
        except OSError as exc:  # a full disk, a vanished file: fails this action, not the build
            text = os_error_text(exc, self.ws.root)
            if exc.filename is None:  # written through an open file: say where it wrote
                text = f"{text}: writing the outputs of {action.id} in {action.out_dir}"
            return _failed(plan, text, WRITE_HINT)
        except Exception as exc:
            return _failed(plan, f"{type(exc).__name__}: {exc}")

    def run_inline(self, plan: ActionPlan) -> ActionResult:
        """``run_one`` in the calling thread (the scheduler's), its spans in a slot's lane."""
        with self.tracer.slot():
            return self.run_one(plan)

    def _locked(self, plan: ActionPlan) -> ActionResult:
        """Under the action lock: re-check staleness, then restore, else run — under
        the cache's lock on the key when the cache is a directory, so that builds sharing
        it (several CI jobs, a cache on NFS) compile each key once and the others restore."""
        ws, action = self.ws, plan.action
        for _ in range(_MAX_REPLANS):
            again, state = self._replan(plan)
            if again.error is not None:
                error = again.error
                return _failed(plan, error.message, error.hint, exit_code=error.exit_code)
            if not again.stale:
                return action_result(
                    action, Outcome.UP_TO_DATE, outputs=recorded_outputs(ws, action)
                )
            assert again.key is not None
            lock = self.cache.key_lock(again.key.key) if self.cache is not None else None
            if lock is None:
                return self._restore_or_run(plan, again.key, state)
            done = self._under_key_lock(plan, again.key, lock, state)
            if done is not None:
                return done
        return _failed(plan, f"{action.id}: its inputs keep changing", "build again later")

    def _under_key_lock(
        self, plan: ActionPlan, key: ActionKey, lock: str, state: State
    ) -> ActionResult | None:
        """Restore or run ``key`` holding the cache's lock on it; None when, after
        waiting for that lock, the action must be planned again (its key changed)."""
        action = plan.action
        waited: list[str] = []

        def on_wait(msg: str) -> None:
            waited.append(msg)
            self.reporter.message(f"{action.id}: the same key is being built elsewhere; {msg}")

        held = ExitStack()
        try:
            held.enter_context(
                locks.hold(
                    lock,
                    f"epbuild build {action.id} in {self.ws.root}",
                    timeout=self.lock_timeout,
                    on_wait=on_wait,
                    within=self.cache.local_backend.root if self.cache is not None else None,
                )
            )
        except OSError as exc:  # read-only, full, a link planted in it: it is an optimisation
            where = self.cache.describe() if self.cache is not None else "?"
            self._warn(
                f"the cache {where} cannot be locked ({os_error_text(exc, self.ws.root)}); "
                "builds sharing it may compile the same key twice"
            )
            return self._restore_or_run(plan, key, state)
        with held:
            if waited:  # the other build stored it meanwhile, or the inputs changed
                after, state = self._replan(plan)
                if after.key is None or after.key.key != key.key or not after.stale:
                    return None  # decide again, under the right key's lock
            return self._restore_or_run(plan, key, state)

    def _replan(self, plan: ActionPlan) -> tuple[ActionPlan, State]:
        """The action's plan against the latest state and its inputs as they are now: the
        digests memoised when the build was planned may be stale after any wait (for the
        action lock, the cache's key lock or the scheduler), so the inputs are stat'ed again
        and re-hashed where the stat cache no longer vouches for them."""
        ws = self.ws
        with self.tracer.span("hash", plan.action.id):
            state = ws.reload_state()
            again = plan_action(plan.action, state, ws.keys, ws.stats, ws.root, fresh=True)
        return again, state

    def _restore_or_run(self, plan: ActionPlan, key: ActionKey, state: State) -> ActionResult:
        """Restore ``key`` from the cache, else run its job (or fail: --cache-only)."""
        cache_note = None
        if self.cache is not None:
            with self.tracer.span("restore", plan.action.id):
                restored, cache_note = self._restore(plan, key, state)
            if restored is not None:
                return restored
            cache_note = cache_note or self._outage_warning()
        if self.cache_only:
            return self._not_cached(plan, key, cache_note)
        if self.cache is not None and cache_note is None:
            plan.reasons.append("not in the cache: " + self._miss(plan, key))
        return self._run(plan, key, state, cache_note)

    def _miss(self, plan: ActionPlan, key: ActionKey) -> str:
        """Why the cache has no entry for the key: the nearest entry of the same action id
        (another machine's, say) and what differs (``build --json`` reasons, as status)."""
        assert self.cache is not None
        try:
            return self.cache.explain_miss(plan.action.id, key.components)
        except Exception as exc:  # an unreachable remote must not fail the compile
            return f"cache unreadable ({self.cache.describe()}): {exc}"

    def _run(
        self, plan: ActionPlan, key: ActionKey, state: State, cache_note: str | None
    ) -> ActionResult:
        """Run the action's job in a fresh worker, verify what it staged, commit it, store it
        in the cache."""
        ws, action, tracer, kind = self.ws, plan.action, self.tracer, kind_of(plan.action)
        ctx = self._context(action)
        staging = self._staging(action)
        try:
            job, found_early = kind.job(action, key, staging, ctx)
            early_warnings = [self._warn(w) for w in self._new(found_early)]
            self.reporter.action_started(action.id)
            started = tracer.now()
            outcome = self._execute(job, kind)
            peak = outcome.result.get("peak_rss")
            tracer.add("compile", started, action.id, ok=outcome.ok, peak_rss=peak)
            if not outcome.ok and (outcome.killed or outcome.result.get("out_of_memory")):
                error, hint = self._out_of_memory(action, kind.name, outcome)
                return _failed(plan, error, hint, log_tail=outcome.log_tail)
            if not outcome.ok:
                code = outcome.result.get("exit_code", 1)  # a kind's runner: its error's
                return _failed(
                    plan, outcome.error, outcome.hint, log_tail=outcome.log_tail, exit_code=code
                )
            mismatch = version_mismatch(key.components.get("versions", {}), outcome.result)
            if mismatch is not None:
                return _failed(plan, mismatch, VERSIONS_HINT)
            started = tracer.now()
            names, found = kind.check(action, staging, ctx, outcome.result)
            record = self._run_record(action, key, staging, names, outcome)
            warnings = early_warnings + [self._warn(w) for w in self._new(found)]
            changed = [
                rel for rel, d in key.inputs.items() if ws.stats.digest(ws.root, rel).digest != d
            ]
            tracer.add("verify", started, action.id)
            if changed:
                return _failed(
                    plan,
                    f"input {changed[0]} changed while it was being compiled; "
                    "the result was discarded",
                    "run the build again once the file is written",
                )
            started = tracer.now()
            self._commit_journaled(action, staging, names, record, state, durable=True)
            tracer.add("commit", started, action.id)
            warnings += self._store(action, record, cache_note)
            return action_result(
                action,
                Outcome.RAN,
                seconds=record.seconds,
                outputs=sorted(record.outputs),
                reasons=plan.reasons,
                warnings=warnings,
            )
        finally:
            remove_tree(os.path.join(ws.root, staging))

    def _staging(self, action: GraphAction) -> str:
        """A fresh staging directory for the action (StorageError when none can be made)."""
        out_dir = self.ws.manifest.workspace.out_dir
        try:
            return make_staging(self.ws.root, out_dir, action.slug)
        except OSError as exc:
            raise StorageError(
                f"cannot create a staging directory in {out_dir}: "
                f"{os_error_text(exc, self.ws.root)}",
                hint=WRITE_HINT,
            ) from exc

    def _execute(self, job: Job, kind: Kind) -> WorkerOutcome:
        """Run a job: in a worker of the executor, or here for an ``inline`` kind; what it
        says of its progress goes to the reporter (``engine.progress``)."""
        if kind.inline:
            from epbuild.executors.local import run_inline

            return run_inline(job, self.ws.root)
        from epbuild.engine.progress import watching

        doing = kind.words.doing
        path = os.path.join(self.ws.root, job.staging, PROGRESS_NAME)

        def said(text: str) -> None:
            self.reporter.action_progress(job.action_id, f"{doing} {job.action_id}: {text}")

        with watching(path, said):
            return self.executor.run(job)

    def _out_of_memory(
        self, action: GraphAction, kind: str, outcome: WorkerOutcome
    ) -> tuple[str, str]:
        """What to say of a worker that ran out of memory (``executors.outofmemory``): an
        allocation refused inside it, or SIGKILL, what the kernel does when memory runs out;
        with the peak it reached, the budget, -j, and what to change."""
        result = outcome.result
        peak = max(outcome.peak_rss, int(result.get("peak_rss") or 0))
        what = outcome.compiling or action.id
        if outcome.killed:
            cause = killed_cause(outcome.error, peak)
        else:
            cause = strip_model(outcome.error or "", outcome.compiling)
        llm = getattr(getattr(action, "group", None), "llm", None)  # an LLM's compile
        plan = MemorySettings(self.jobs, self.memory.budget, self.memory.peaks.get(action.id, 0))
        return explain(
            doing="compiling" if kind == "compile" else f"in {kind} of",
            what=what,
            peak=peak,
            cause=cause,
            plan=plan,
            llm=llm.name if llm is not None else None,
            limit=int(result.get("memory_limit") or 0),
        )

    def _context(self, action: GraphAction) -> RunContext:
        """What the action's kind needs to make its job and check its outputs."""
        if self._machine is None:
            self._machine = machine_paths(self.ws.root)
        peak = self.memory.peaks.get(action.id, 0)
        return RunContext(self.ws.root, self.ws.keys, self._machine, peak)

    def _run_record(
        self,
        action: GraphAction,
        key: ActionKey,
        staging: str,
        names: list[str],
        outcome: WorkerOutcome,
    ) -> ActionRecord:
        """The journal record of a job whose staged outputs passed its kind's check."""
        result = outcome.result
        return ActionRecord(
            id=action.id,
            key=key.key,
            components=key.components,
            outputs=hash_staged(
                self.ws.root, staging, action.out_dir, names, self._kept(action.out_dir)
            ),
            seconds=float(result.get("seconds", 0.0)),
            peak_rss=int(result.get("peak_rss", 0)),
            at=time.time(),
            detail=result.get("detail", {}),
        )

    def _commit_journaled(
        self,
        action: GraphAction,
        staging: str,
        names: list[str],
        record: ActionRecord,
        state: State,
        *,
        durable: bool,
    ) -> None:
        """Put staged outputs in place so that the journal never says ``done`` for outputs that
        are not there: ``begin`` → renames → stat-cache entries → ``done``, all under one
        state-lock hold (the renames are cheap). ``durable=False`` leaves the done record's
        fsync to build()'s final journal sync: for restores, where losing it costs a
        re-restore; a compile's record is made durable at once."""
        ws = self.ws
        previous = state.records.get(action.id)
        old = list(previous.outputs) if previous is not None else []
        stats = ws.stats

        def remember(rel: str, st: os.stat_result, digest: str) -> None:
            stats.remember(rel, Entry(st.st_ino, st.st_size, st.st_mtime_ns, digest))

        with locks.hold(ws.state_lock, f"epbuild commit {action.id}", timeout=self.lock_timeout):
            if previous is not None and moved_from(action.out_dir, old) is not None:
                old = _leave_behind(ws, action, previous)
            back = state.records.get(left_id(action.id, action.out_dir))
            if back is not None:  # back where it was: what it left there is its own again
                old += [rel for rel in back.outputs if rel not in old]
            commit_journaled(
                ws.root,
                ws.journal.path,
                (staging, action.out_dir, names),
                old,
                done_line(record),
                remember,
                durable=durable,
                unchanged=self._in_place(action.out_dir, names, record),
            )
            if back is not None:
                ws.journal.forget(back.id)

    def _kept(self, out_dir: str) -> Callable[[str, os.stat_result], OutputRecord | None]:
        """The record of a staged output that is a hard link to the output in place in
        ``out_dir`` (a job that kept a file it would have written the same: the LLM
        preparation keeps the data files of the parts an edit did not touch), from the stat
        cache, unread; None for any other."""

        def kept(name: str, staged: os.stat_result) -> OutputRecord | None:
            rel = posixpath.join(out_dir, name)
            try:
                placed = os.lstat(os.path.join(self.ws.root, rel))
            except OSError:
                return None
            same = (placed.st_dev, placed.st_ino) == (staged.st_dev, staged.st_ino)
            entry = (
                self.ws.stats.lookup(rel, placed) if same and stat.S_ISREG(placed.st_mode) else None
            )
            return None if entry is None else OutputRecord(entry.size, entry.digest)

        return kept

    def _in_place(self, out_dir: str, names: list[str], record: ActionRecord) -> list[str]:
        """The staged outputs whose bytes are already at their place (a regular file the
        stat cache vouches for, unread, with the digest ``record`` gives): a commit leaves
        them there, as Ninja's ``restat`` does, so that a run that writes the same bytes
        again (a preparation of every part after an edit of one) neither replaces nor
        flushes them, and whatever reads them sees them unchanged."""
        return [name for name in names if self._vouched(out_dir, name, record) is not None]

    def _vouched(self, out_dir: str, name: str, record: ActionRecord) -> Entry | None:
        """The stat-cache entry that vouches, without reading the file, that the output
        ``name`` in ``out_dir`` is a regular file holding the digest ``record`` gives it;
        None where none does."""
        rel = posixpath.join(out_dir, name)
        try:
            st = os.lstat(os.path.join(self.ws.root, rel))
        except OSError:
            return None
        entry = self.ws.stats.lookup(rel, st) if stat.S_ISREG(st.st_mode) else None
        if entry is None or entry.digest != record.outputs[rel].digest:
            return None
        return entry

    def _restore(
        self, plan: ActionPlan, key: ActionKey, state: State
    ) -> tuple[ActionResult | None, str | None]:
        """Restore from the cache through the commit path; (None, why) when it cannot."""
        ws, action, t0 = self.ws, plan.action, time.perf_counter()
        staging = self._staging(action)
        try:
            record, names, note = self._fetch(action, key, staging)
            if record is None:
                return None, note
            self._commit_journaled(action, staging, names, record, state, durable=False)
            restored = action_result(
                action,
                Outcome.RESTORED,
                seconds=time.perf_counter() - t0,
                outputs=sorted(record.outputs),
                reasons=plan.reasons,
            )
            return restored, None
        finally:
            remove_tree(os.path.join(ws.root, staging))

    def _fetch(
        self, action: GraphAction, key: ActionKey, staging: str
    ) -> tuple[ActionRecord | None, list[str], str | None]:
        """Restore ``key`` into ``staging`` and check it: (record, names, None), or
        (None, [], why) on a miss (why: None) or an entry that cannot be used."""
        assert self.cache is not None
        try:
            hit = self.cache.restore(key.key, os.path.join(self.ws.root, staging))
            if hit is None:
                return None, [], None
            names, _ = kind_of(action).check(action, staging, self._context(action), None)
            if set(names) != set(hit.entry.outputs):
                raise VerificationError("outputs do not match the entry")
        except (CacheDamagedError, VerificationError) as exc:
            if isinstance(exc, VerificationError):
                self.cache.discard(key.key)
            return None, [], self._warn(f"cache entry of {action.id} not restored: {exc}")
        except OSError as exc:
            if exc.errno in _CANNOT_WRITE:  # the workspace's disk, not the cache, is to blame
                raise StorageError(
                    f"cannot restore {action.id} into {action.out_dir}: "
                    f"{os_error_text(exc, self.ws.root)}",
                    hint=WRITE_HINT,
                ) from exc
            return None, [], self._warn(f"cache unusable for {action.id}: {os_error_text(exc)}")
        placed = hit.entry.placed(action.out_dir)
        # Recorded under this action's id: an entry is found by key alone, and another
        # workspace (or this one before a group or provider was renamed) stored it under
        # its own.
        record = replace(
            placed, id=action.id, components=key.components, at=time.time(), restored=True
        )
        return record, names, None

    def _new(self, warnings: list[str]) -> list[str]:
        """Those of ``warnings`` not said yet in this build (each is said once)."""
        with self._warn_lock:
            found = [w for w in dict.fromkeys(warnings) if w not in self.warned]
            self.warned.update(found)
        return found

    def _warn(self, note: str) -> str:
        """Report a warning; returns it."""
        self.reporter.message(f"warning: {note}")
        return note

    def _outage_warning(self) -> str | None:
        """The one warning of a build whose remote cache tier went down (None: said
        already, or no outage)."""
        outage = self.cache.outage if self.cache is not None else None
        if outage is None:
            return None
        going_on = "" if self.cache_only else ", going on without it"
        line = f"the remote cache is unavailable{going_on}: {outage}"
        with self._warn_lock:
            if line in self.warned:
                return None
            self.warned.add(line)
        return self._warn(line)

    def _not_cached(self, plan: ActionPlan, key: ActionKey, note: str | None) -> ActionResult:
        """The --cache-only failure of an action the cache could not restore."""
        if note is not None:
            why = note
        elif self.cache is not None:
            why = self.cache.explain_miss(plan.action.id, key.components)
        else:
            why = "the cache is off"
        return _failed(
            plan,
            f"not in the cache: {why}",
            "build without --cache-only where the toolchain is installed, and push or export "
            f"the cache (see {page_url('troubleshooting.md', 'cache-misses-across-machines')})",
        )

    def _store(self, action: GraphAction, record: ActionRecord, note: str | None) -> list[str]:
        """Put an action that ran into the cache; returns warnings (never fails the build)."""
        warnings = [note] if note else []
        if self.cache is None:
            return warnings
        out_dir = os.path.join(self.ws.root, action.out_dir)
        vouched = None
        if stored_by_link(kind_of(action)) and inside(out_dir, self.ws.state_dir):

            def vouched(name: str) -> tuple[int, int, int] | None:
                entry = self._vouched(action.out_dir, name, record)
                return None if entry is None else (entry.ino, entry.size, entry.mtime_ns)

        try:
            warnings += [self._warn(line) for line in self.cache.save(record, out_dir, vouched)]
        except Exception as exc:  # a cache that cannot be written must not fail a build
            where = self.cache.describe()
            why = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
            warnings.append(self._warn(f"{action.id} not stored in the cache {where}: {why}"))
        outage = self._outage_warning()  # --cache-push to a remote that went down
        return warnings + ([outage] if outage else [])


def version_mismatch(keyed: dict[str, str], result: dict[str, Any]) -> str | None:
    """Why a worker's result cannot be committed or cached under its key: the versions it
    reports compiling with (``worker.compiled_with``) differ from those the key names, or
    it ran another epbuild. None when they agree."""
    reported = result.get("versions")
    if not isinstance(reported, dict):
        return "the worker did not report the versions it compiled with; result discarded"
    differ = [
        f"{name} {reported.get(name, 'absent')} (worker) vs {want} (key)"
        for name, want in sorted(keyed.items())
        if reported.get(name, "absent") != want
    ]
    theirs = result.get("epbuild")
    if theirs != __version__:
        differ.append(f"epbuild {theirs or 'unknown'} (worker) vs {__version__} (here)")
    if not differ:
        return None
    return (
        "the worker compiled with other versions than the action key names: "
        + "; ".join(differ)
        + "; result neither committed nor cached"
    )


VERSIONS_HINT = (
    "install the same versions where the compiles run (a Dask farm's workers) as where epbuild "
    "runs, or build with --executor local"
)

_MAX_REPLANS = 5
"""Times an action is re-planned because its key changed while it waited for a lock."""


def _failed(
    plan: ActionPlan, error: str | None, hint: str | None = None, **kw: Any
) -> ActionResult:
    """The FAILED result of a planned action."""
    return action_result(
        plan.action, Outcome.FAILED, reasons=plan.reasons, error=error, hint=hint, **kw
    )
