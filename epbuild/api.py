"""The library API: ``build``, ``status`` and ``clean``, and the manifest edits ``init``,
``init_from``, ``add_models``, ``add_provider`` and ``add_target`` (``manifest.init``,
``manifest.edit``). The CLI is a thin layer over it."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from epbuild._names import STAGING_DIR, TRACE_NAME
from epbuild.engine.scheduler import executor_for, schedule
from epbuild.engine.staging import check_removable, clean_stale_staging, refuse_planted_links
from epbuild.errors import EpbuildError, LockTimeoutError, StorageError, UserError
from epbuild.fs import LinkedPathError, os_error_text
from epbuild.planning.moves import moved_from, owning_top, still_written
from epbuild.planning.staleness import ActionPlan, make_plan
from epbuild.planning.workspace import (
    Workspace,
    open_action_cache,
    open_workspace,
    recorded_outputs,
    save_stats,
)
from epbuild.results import (
    ActionResult,
    ActionStatus,
    BuildResult,
    Outcome,
    Reporter,
    StatusResult,
    action_result,
)
from epbuild.state import locks

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache
    from epbuild.engine.builder import Builder
    from epbuild.engine.scheduler import Execution
    from epbuild.engine.trace import Tracer
    from epbuild.executors.local import Executor
    from epbuild.manifest.edit import EditResult, add_models, add_provider, add_target
    from epbuild.manifest.init import InitResult, init, init_from
    from epbuild.manifest.model import Manifest
    from epbuild.state.journal import OutputRecord, State


__all__ = [
    "ActionResult",
    "ActionStatus",
    "BuildResult",
    "EditResult",
    "InitResult",
    "Outcome",
    "Reporter",
    "StatusResult",
    "add_models",
    "add_provider",
    "add_target",
    "build",
    "clean",
    "init",
    "init_from",
    "orphaned",
    "status",
]


_EDITS = {
    "EditResult": "edit",
    "add_models": "edit",
    "add_provider": "edit",
    "add_target": "edit",
    "InitResult": "init",
    "init": "init",
    "init_from": "init",
}
"""The manifest edits, imported when first asked for (``manifest.edit`` and ``init``): a
build or a status never loads them."""


def __getattr__(name: str) -> Any:
    if name in _EDITS:
        import importlib

        return getattr(importlib.import_module(f"epbuild.manifest.{_EDITS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def status(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    cache: str | bool | None = None,
) -> StatusResult:
    """Every selected action as up to date or stale, with reasons. Takes no lock.

    A stale action's reasons end with what the cache says: restorable, or why not (the
    key components that differ from the newest cache entry of the same action id). Without
    selectors it also lists the orphaned actions (built, but no longer in the manifest).
    """
    ws = open_workspace(directory, manifest, selectors)
    plans = make_plan(ws.graph, ws.state, ws.keys, ws.stats, ws.root)
    lock_notes = _lock_notes(ws)
    if any(p.stale and p.key for p in plans):
        cached = open_action_cache(ws, directory, cache)
        if cached is not None:
            from epbuild.planning.cache_explain import explain_plans

            explain_plans(cached, plans, ws)
    _save_stats_if_possible(ws)
    orphans = [] if selectors else orphaned_actions(ws)
    moved = [] if selectors else _moved_actions(ws, ws.state)
    held = sum(orphaned_files(ws, ws.state).values()) if orphans or moved else 0
    return StatusResult([ActionStatus.from_plan(p) for p in plans], orphans, lock_notes, held)


def _lock_notes(ws: Workspace) -> list[str]:
    """Why the workspace's ``epbuild.lock`` is out of date with the manifest (none: it is
    current, or there is no lock)."""
    from epbuild.toolchains.lockfile import LockError, lock_path, read_lock

    path = lock_path(ws.manifest.path)
    try:
        lock = read_lock(path)
    except LockError as exc:
        return [exc.message]
    if lock is None:
        return []
    from epbuild.planning.lock import outdated

    name = os.path.basename(path)
    return [f"{name} is out of date: {r}" for r in outdated(lock, ws.manifest)]


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
    locked: bool = False,
    numerics: bool = False,
) -> BuildResult:
    """Bring the selected actions up to date; returns what happened to each.

    ``memory_budget`` (bytes) caps the summed predicted peaks of concurrent local compiles
    (default: manifest, else a safe share of RAM); ``trace`` writes the timeline as Chrome
    trace-event JSON; ``executor`` is ``"local"``, ``"dask"`` (with ``scheduler``, a Dask
    scheduler address) or an ``Executor`` object (the caller's to close). ``loaded`` builds
    with an already-loaded manifest instead of re-reading the file (watch keeps its last).
    ``locked`` refuses (``LockError``, exit 2) to compile or restore when an environment
    differs from ``epbuild.lock`` (``build --locked``). ``numerics`` adds their checks.
    """
    t0 = time.perf_counter()
    reporter = reporter or Reporter()
    opening = (directory, manifest, selectors, loaded, reporter, dry_run, locked, lock_timeout,
               numerics)  # fmt: skip
    ws, plans, warnings, tracer = _plan(functools.partial(_open_for_build, *opening))
    try:
        results = {p.action.id: _planned(ws, p) for p in plans}
        stale = [p for p in plans if p.stale]
        if not dry_run and stale:
            from epbuild.engine.builder import Builder

            run = executor_for(
                ws, stale, executor, scheduler, jobs, memory_budget, restores_only=cache_only
            )
            builder = functools.partial(Builder, keep_going=keep_going or cache_only,
                                        reporter=reporter, lock_timeout=lock_timeout,
                                        tracer=tracer, cache_only=cache_only)  # fmt: skip
            # (--cache-only keeps going: it lists every missing action)
            opened = partial(open_action_cache, ws, directory, cache, cache_push, cache_only)
            results.update(_compile(ws, run, builder, opened, len(plans), stale, trace, warnings))
        if isinstance(cache, str) and not dry_run:  # --cache DIR: seeded with what is built
            warnings += _seed_cache(ws, plans, directory, cache)
        done = BuildResult(list(results.values()), time.perf_counter() - t0, warnings)
        if dry_run or not stale:
            record = not numerics  # the fingerprint answers plain builds
            return _without_compiling(ws, plans, selectors, done, dry_run, tracer, (trace, record))
        return done
    finally:
        ws.keys.toolchains.release()  # its environments may be pruned from now on


def _seed_cache(
    ws: Workspace, plans: list[ActionPlan], directory: str | os.PathLike[str], cache: str
) -> list[str]:
    """``build --cache DIR``: store the up-to-date actions DIR lacks (``store_up_to_date``)."""
    if all(p.stale for p in plans):
        return []  # none to store (a restore into a fresh checkout): not even an import
    from epbuild.cache.operations import store_up_to_date

    return store_up_to_date(ws, plans, directory, cache)


def _compile(
    ws: Workspace,
    run: Execution,
    make_builder: Callable[..., Builder],
    open_cache: Callable[[], ActionCache | None],
    total: int,
    stale: list[ActionPlan],
    trace: str | os.PathLike[str] | None,
    warnings: list[str],
) -> dict[str, ActionResult]:
    """Prepare the state directory, run the stale actions, close an executor we opened."""
    try:
        _prepare(ws, ws.lock_timeout, stale)
        builder = make_builder(ws, run, cache=open_cache())
        builder.reporter.start(total, len(stale))
        return _run(builder, stale, trace, warnings)
    finally:
        if run.owned:  # an executor passed in belongs to the caller, who may reuse it
            run.executor.close()


def _without_compiling(
    ws: Workspace,
    plans: list[ActionPlan],
    selectors: list[str] | tuple[str, ...],
    done: BuildResult,
    dry_run: bool,
    tracer: Tracer,
    writing: tuple[str | os.PathLike[str] | None, bool],
) -> BuildResult:
    """Finish a dry run, or a build with nothing stale: write the trace (``writing``: its
    path, None for none) and record the fingerprint for the no-op path (``writing``'s
    flag)."""
    trace, record = writing
    stale = any(p.stale for p in plans)
    if record and not dry_run and not stale and not done.warnings and trace is None:
        _record_noop(ws, plans, selectors, done)
    if not dry_run:  # after the fingerprint, which may hash (and remember) more files
        _save_stats_if_possible(ws)
    if trace is not None:
        tracer.write(trace)
    return done


def _plan(
    open_ws: Callable[[], tuple[Workspace, list[str]]],
) -> tuple[Workspace, list[ActionPlan], list[str], Tracer]:
    """Open the workspace (``open_ws``: ``_open_for_build`` with the build's arguments) and
    plan every action; also what loading its state warned about, and the build's tracer
    (its first span is this one)."""
    from epbuild.engine.trace import Tracer

    tracer = Tracer()
    with tracer.span("plan"):
        ws, warnings = open_ws()
        plans = make_plan(ws.graph, ws.state, ws.keys, ws.stats, ws.root)
    return ws, plans, warnings, tracer


def _open_for_build(
    directory: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | None,
    selectors: list[str] | tuple[str, ...],
    loaded: Manifest | None,
    reporter: Reporter,
    dry_run: bool,
    locked: bool,
    lock_timeout: float | None,
    numerics: bool = False,
) -> tuple[Workspace, list[str]]:
    """The workspace (toolchains made unless a dry run, checked against ``epbuild.lock``
    when ``locked``) and the warnings loading it gave, each said once."""
    from epbuild.toolchains.resolve import Toolchains

    toolchains = Toolchains(create=not dry_run, say=reporter.message, lock_timeout=lock_timeout)
    ws = open_workspace(
        directory, manifest, selectors, loaded=loaded, toolchains=toolchains, numerics=numerics
    )
    if locked:
        from epbuild.planning.lock import enforce
        from epbuild.toolchains.lockfile import lock_path, read_lock

        path = lock_path(ws.manifest.path)
        providers = {a.provider.name for a in ws.actions}
        enforce(read_lock(path), path, ws.manifest, toolchains, providers)
    warnings = list(ws.state.warnings)
    if not selectors:  # said on every build, so that no build reads as having made them
        names = {a.group.name for a in ws.actions}
        warnings += [
            f"llms.{name}: no stage of its decoder-pipeline has static input shapes, so "
            "nothing is compiled for it (a stage an NPU takes has fixed shapes)"
            for name, llm in ws.manifest.llms.items()
            if llm.stages and name not in names
        ]
    for w in warnings:
        reporter.message(f"warning: {w}")
    return ws, warnings


def _planned(ws: Workspace, plan: ActionPlan) -> ActionResult:
    """What the plan says of an action before anything runs."""
    if plan.stale:
        return action_result(plan.action, Outcome.WOULD_BUILD, reasons=plan.reasons)
    return action_result(plan.action, Outcome.UP_TO_DATE, outputs=recorded_outputs(ws, plan.action))


def _prepare(ws: Workspace, lock_timeout: float | None, stale: list[ActionPlan]) -> None:
    """Before running anything: refuse a link planted where the build writes, drop dead
    builds' staging, compact a damaged journal."""
    out_dir, state_dir = ws.manifest.workspace.out_dir, ws.manifest.workspace.state_dir
    paths = []
    for plan in stale:
        lock = os.path.relpath(ws.action_lock(plan.action), ws.root).replace(os.sep, "/")
        paths += [plan.action.out_dir, lock, lock + ".owner"]
    try:
        refuse_planted_links(ws.root, out_dir, state_dir, paths)
        os.makedirs(ws.state_dir, exist_ok=True)
        with locks.hold(ws.state_lock, "epbuild build (startup)", timeout=lock_timeout):
            clean_stale_staging(ws.root, out_dir)
            if ws.state.warnings:
                ws.journal.compact_if_needed(ws.reload_state())
    except LinkedPathError:
        raise  # exit 2, naming the link
    except OSError as exc:
        raise StorageError(
            f"cannot prepare the state directory: {os_error_text(exc, ws.root)}",
            hint="check that the workspace is writable and has free space",
        ) from exc


def _run(
    builder: Builder,
    stale: list[ActionPlan],
    trace: str | os.PathLike[str] | None,
    warnings: list[str],
) -> dict[str, ActionResult]:
    """Schedule the stale actions, then persist the stat cache, the journal and the trace
    (a step that cannot write is said and added to ``warnings``)."""
    ws = builder.ws
    try:
        return schedule(builder, stale)
    finally:
        # Each step only saves work for later builds: one that cannot write (a full disk)
        # is a warning, and never hides the results of the actions.
        steps: list[tuple[str, Callable[[], None]]] = [
            ("the stat cache was not saved", lambda: save_stats(ws)),
            ("the state journal was not synced or compacted", lambda: _finish_journal(ws)),
            ("the trace was not written",
             lambda: builder.tracer.write(os.path.join(ws.state_dir, TRACE_NAME))),
        ]  # fmt: skip
        if trace is not None:
            steps.append((f"--trace {os.fspath(trace)} was not written",
                          lambda: builder.tracer.write(trace)))  # fmt: skip
        for what, step in steps:
            try:
                step()
            except (OSError, LockTimeoutError) as exc:
                why = os_error_text(exc, ws.root) if isinstance(exc, OSError) else str(exc)
                warnings.append(f"{what}: {why}")
                builder.reporter.message(f"warning: {warnings[-1]}")


def run_plans(ws: Workspace, stale: list[ActionPlan]) -> list[ActionResult]:
    """Run the stale actions of ``stale`` (of a workspace opened without making
    toolchains: ``verify --numerics``'s checks) with the workspace's settings, quietly."""
    from epbuild.engine.builder import Builder
    from epbuild.engine.trace import Tracer

    run = executor_for(ws, stale, "local", None, None, None)
    builder = functools.partial(Builder, keep_going=True, reporter=Reporter(),
                                lock_timeout=ws.lock_timeout, tracer=Tracer())  # fmt: skip
    opened = functools.partial(open_action_cache, ws, ws.root, None)
    return list(_compile(ws, run, builder, opened, len(stale), stale, None, []).values())


def _save_stats_if_possible(ws: Workspace) -> None:
    """The stat cache only saves re-hashing: a disk that cannot take it fails nothing."""
    try:
        save_stats(ws)
    except (OSError, LockTimeoutError):
        pass


def _finish_journal(ws: Workspace) -> None:
    with locks.hold(ws.state_lock, "epbuild build (finish)", timeout=ws.lock_timeout):
        ws.journal.sync()  # restores' done records
        ws.journal.compact_if_needed(ws.reload_state())


def _record_noop(
    ws: Workspace,
    plans: list[ActionPlan],
    selectors: list[str] | tuple[str, ...],
    result: BuildResult,
) -> None:
    """Let the next no-op build answer from stats alone (see ``noop``)."""
    from epbuild.planning.noop import write_fingerprint

    try:
        write_fingerprint(ws, plans, selectors, result.to_json())
    except (OSError, EpbuildError):
        pass  # only an optimisation: the full path stays correct without it


def orphaned_actions(ws: Workspace) -> list[str]:
    """Recorded actions the manifest no longer has (their outputs are still on disk); the
    numerical check of a compile it has is not one, though only some commands plan it."""
    from epbuild.kinds.check import check_id
    from epbuild.planning.actions import CompileAction

    graph = ws.graph
    if ws.selectors:
        from epbuild.kinds.contract import GraphRequest
        from epbuild.planning.graph import make_graph
        from epbuild.planning.llms import llm_shapes

        graph = make_graph(GraphRequest(ws.manifest, tuple(llm_shapes(ws.manifest))))
    # else the workspace's graph is the whole graph
    current = {a.id for a in graph} | {
        check_id(a.id) for a in graph if isinstance(a, CompileAction)
    }
    return sorted(i for i in ws.state.records if i not in current)


def orphaned(
    directory: str | os.PathLike[str] = ".", manifest: str | os.PathLike[str] | None = None
) -> list[str]:
    """Ids of built actions the manifest no longer has; ``clean`` removes their outputs."""
    return orphaned_actions(open_workspace(directory, manifest))


def orphaned_files(ws: Workspace, state: State) -> dict[str, int]:
    """The outputs of orphaned actions that no action of the manifest owns (its record
    does not list them), with their sizes: what ``clean --orphaned`` removes. Outputs an
    action left where a changed ``[workspace]`` moved them from are among them, also before
    its build in the new place."""
    found: dict[str, int] = {}
    for rel in _orphaned_outputs(ws, state)[0]:
        try:
            found[rel] = os.lstat(os.path.join(ws.root, rel)).st_size
        except OSError:
            continue
    return found


def _orphaned_outputs(ws: Workspace, state: State) -> tuple[dict[str, OutputRecord], list[str]]:
    """The recorded outputs of the orphaned actions and of the actions whose outputs moved,
    less those a record in place lists (by their path, or where a link leads); and those
    actions' ids."""
    dead = [*orphaned_actions(ws), *_moved_actions(ws, state)]
    gone = set(dead)
    live = {p for i, rec in state.records.items() if i not in gone for p in rec.outputs}
    # The same files by another path (an out_dir that named a link to the directory it
    # names now): resolved once there is an output to tell.
    real: set[str] | None = None
    found: dict[str, OutputRecord] = {}
    for action_id in sorted(dead):
        for rel, out in state.records[action_id].outputs.items():
            if rel in live or rel in found:
                continue
            if real is None:
                real = {os.path.realpath(os.path.join(ws.root, p)) for p in live}
            if os.path.realpath(os.path.join(ws.root, rel)) not in real:
                found[rel] = out
    return found, dead


def _moved_actions(ws: Workspace, state: State) -> list[str]:
    """Actions of the graph whose recorded outputs are elsewhere than it puts them."""
    found = []
    for action in ws.graph:
        committed = state.records.committed(action.id)
        if committed is not None and moved_from(action.out_dir, committed[1]) is not None:
            found.append(action.id)
    return found


def clean(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    orphaned: bool = False,
) -> list[str]:
    """Remove the selected actions' outputs and records; returns the removed paths.
    ``orphaned``: remove only what actions no longer in the manifest left, and no action of
    the manifest owns (ninja's ``cleandead``), and forget those actions. Outputs outside the
    output and state directories (where a changed ``[workspace]`` moved them from) are
    removed only while they are as a build wrote them."""
    if orphaned and selectors:
        raise UserError(
            "clean --orphaned takes no selectors: it removes what no action of the manifest owns",
            hint="run 'epbuild clean --orphaned', or 'epbuild clean SELECTOR'",
        )
    ws = open_workspace(directory, manifest, selectors, numerics=True)  # their checks too
    removed: list[str] = []
    if not os.path.isdir(ws.state_dir):
        return removed
    out_dir, state_dir = ws.manifest.workspace.out_dir, ws.manifest.workspace.state_dir
    journal = os.path.relpath(ws.journal.path, ws.root).replace(os.sep, "/")
    refuse_planted_links(ws.root, out_dir, state_dir, [journal])  # what it would go by
    with locks.hold(ws.state_lock, "epbuild clean"):
        if orphaned:  # what the manifest has now: an action added and built meanwhile is no orphan
            ws = _reopened(ws, directory, manifest)
        state = ws.reload_state()
        clean_one = (
            _clean_orphaned if orphaned else functools.partial(_clean_actions, selectors=selectors)
        )
        removed = clean_one(ws, state)
    _remove_emptied_dirs(ws, removed)
    return removed


def _reopened(
    ws: Workspace, directory: str | os.PathLike[str], manifest: str | os.PathLike[str] | None
) -> Workspace:
    """The workspace as its manifest is now, for a command that waited for the state lock
    ``ws`` names; a manifest that moved the state directory meanwhile is a user error."""
    now = open_workspace(directory, manifest, (), numerics=True)
    if now.state_dir != ws.state_dir:
        raise UserError(
            "the manifest's state_dir changed while epbuild clean waited for the state lock",
            hint="run the command again",
        )
    return now


def _clean_orphaned(ws: Workspace, state: State) -> list[str]:
    """Under the state lock: remove the orphaned outputs nothing owns, forget the orphans
    (and the actions whose outputs moved: their record names only the old place)."""
    found, dead = _orphaned_outputs(ws, state)
    files = sorted(_removable(ws, found))
    for rel in files:  # refuse before deleting anything
        check_removable(ws.root, _owning_dir(ws, rel), [rel])
    removed = _unlink_existing(ws.root, files)
    for action_id in dead:
        ws.journal.forget(action_id)
    return removed


def _clean_actions(
    ws: Workspace, state: State, selectors: list[str] | tuple[str, ...]
) -> list[str]:
    """Under the state lock: remove the selected actions' outputs (all, and the orphans',
    without selectors) and forget them."""
    removed: list[str] = []
    ids = [a.id for a in ws.graph]
    if not selectors:  # also what earlier manifests built and this one no longer has
        ids += orphaned_actions(ws)
    outputs = {
        i: _removable(ws, state.records[i].outputs) if i in state.records else [] for i in ids
    }
    outputs["llm packages"] = _llm_package_files(ws)
    for paths in outputs.values():  # refuse before deleting anything
        for rel in paths:
            check_removable(ws.root, _owning_dir(ws, rel), [rel])
    for action_id, paths in outputs.items():
        removed += _unlink_existing(ws.root, paths)
        if action_id in state.records or action_id in state.interrupted:
            ws.journal.forget(action_id)
    clean_stale_staging(ws.root, ws.manifest.workspace.out_dir)
    return removed


def _removable(ws: Workspace, outputs: Mapping[str, OutputRecord]) -> list[str]:
    """Those of an action's recorded ``outputs`` that clean may delete: every one in the
    output or state directory; elsewhere (moved from) only those still as written."""
    return [
        rel
        for rel, out in outputs.items()
        if _in_own_dir(ws, rel) or still_written(ws.root, rel, out.size, out.digest, ws.stats)
    ]


def _in_own_dir(ws: Workspace, rel: str) -> str | None:
    """The directory of epbuild's that ``rel`` is in: the state directory (an LLM's prepared
    graphs, calibrations), the output directory, or None."""
    for top in (ws.manifest.workspace.state_dir, ws.manifest.workspace.out_dir):
        if rel.startswith(top.rstrip("/") + "/"):
            return top
    return None


def _owning_dir(ws: Workspace, rel: str) -> str:
    """The directory epbuild owns (or owned, before ``[workspace]`` moved its outputs) that a
    recorded output is in, which no deletion may resolve outside of."""
    return _in_own_dir(ws, rel) or owning_top(rel)


def _llm_package_files(ws: Workspace) -> list[str]:
    """The files ``_write_llm_packages`` writes for the selected LLM actions."""
    from epbuild.llm.package import package_files
    from epbuild.planning.llms import LlmGroup

    found: set[str] = set()
    for action in ws.actions:
        if isinstance(action.group, LlmGroup):
            llm = ws.manifest.llms[action.group.name]
            found.update(package_files(ws.root, llm, action.out_dir))
    return sorted(found)


def _unlink_existing(root: str, paths: list[str]) -> list[str]:
    """Delete those of ``paths`` (workspace-relative) that exist; returns them."""
    gone = []
    for rel in paths:
        full = os.path.join(root, rel)
        if os.path.lexists(full):
            os.unlink(full)
            gone.append(rel)
    return gone


def _remove_emptied_dirs(ws: Workspace, removed: list[str]) -> None:
    """Drop the directories that deleting ``removed`` left empty, never above the output
    directory; a place outputs moved from goes entirely once nothing is left in it (its
    staging folder was epbuild's too)."""
    out_dir = ws.manifest.workspace.out_dir
    old = set()
    for rel in removed:
        own = _in_own_dir(ws, rel)
        if own == ws.manifest.workspace.state_dir:
            continue
        top = os.path.join(ws.root, own or owning_top(rel))
        if own is None:
            old.add(top)
        d = os.path.dirname(os.path.join(ws.root, rel))
        while _empty_dir_below(d, top):
            os.rmdir(d)
            d = os.path.dirname(d)
    for top in sorted(old):
        staging = os.path.join(top, STAGING_DIR)
        for d in (staging, top):
            if _empty_dir_below(d, os.path.dirname(top)) and d != os.path.join(ws.root, out_dir):
                os.rmdir(d)


def _empty_dir_below(d: str, top: str) -> bool:
    """Is ``d`` a real, empty directory strictly inside ``top``?"""
    inside = d.startswith(top + os.sep)
    return inside and os.path.isdir(d) and not os.path.islink(d) and not os.listdir(d)
