"""A workspace: a loaded manifest plus its state directory, stat cache and actions."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from epbuild._dataclass import dataclass
from epbuild._names import JOURNAL_NAME, LOCKS_DIR, STATCACHE_NAME, STATE_LOCK_NAME
from epbuild.cache.location import open_cache, resolve, source
from epbuild.errors import UserError
from epbuild.fs import ensure_dir_inside, refuse_outward
from epbuild.kinds.contract import GraphAction, GraphRequest
from epbuild.manifest.load import Manifest, find_manifest, load_manifest
from epbuild.planning.actions import CompileAction
from epbuild.planning.graph import make_graph, select_graph
from epbuild.planning.keys import KeyComputer
from epbuild.state.journal import Journal, State, load_state
from epbuild.state.statcache import StatCache
from epbuild.toolchains.resolve import Toolchains

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache


@dataclass
class Workspace:
    """Everything a command needs to look at a workspace."""

    manifest: Manifest
    root: str
    state_dir: str
    state: State
    stats: StatCache
    keys: KeyComputer
    actions: list[CompileAction]
    """The selected compile actions."""
    graph: list[GraphAction]
    """Every selected action of every kind (the compiles among them), each after the
    actions it depends on (which a selection takes along)."""
    lock_timeout: float | None = None
    """How long this command waits for a lock (``--lock-timeout``; None: as long as it
    takes)."""
    selectors: tuple[str, ...] = ()
    """What the command selected (empty: every action, so ``graph`` is the whole graph)."""

    @property
    def journal(self) -> Journal:
        """Appends to the state journal (hold the state lock)."""
        return Journal(os.path.join(self.state_dir, JOURNAL_NAME))

    @property
    def state_lock(self) -> str:
        """Path of the workspace-state lock."""
        return os.path.join(self.state_dir, STATE_LOCK_NAME)

    def action_lock(self, action: GraphAction) -> str:
        """Path of an action's lock."""
        return os.path.join(self.state_dir, LOCKS_DIR, f"{action.slug}.lock")

    def reload_state(self) -> State:
        """Re-read the journal (another process may have committed); replays only what
        was appended since the last load. Returns this call's state: another thread may
        replace ``self.state`` meanwhile."""
        state = load_state(os.path.join(self.state_dir, JOURNAL_NAME), self.state)
        self.state = state
        return state


def _refuse_non_directory(m: Manifest, key: str, rel: str) -> None:
    """Refuse a ``[workspace]`` directory that is there as something else (a user's file):
    epbuild would fail to write every output under it, action by action."""
    path = os.path.join(m.root, rel)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(
            f"{m.path.name}: [workspace] {key} {rel!r} is a file, not a directory",
            hint=f"move that file away, or name another directory in [workspace] {key}",
        )


def open_workspace(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    loaded: Manifest | None = None,
    toolchains: Toolchains | None = None,
    numerics: bool = False,
) -> Workspace:
    """Load the manifest (unless ``loaded`` is given), the state and the stat cache; select
    actions. ``toolchains`` makes missing provider toolchains (a build); by default they are
    only looked for. ``numerics``: the graph has the numerical check of every compile
    (``kinds.check``), which a selection of the compile takes along."""
    if loaded is not None:
        m = loaded
    else:
        m = load_manifest(find_manifest(directory, os.fspath(manifest) if manifest else None))
    root = str(m.root)
    state_dir = os.path.join(root, m.workspace.state_dir)
    for key in ("state_dir", "out_dir"):
        _refuse_non_directory(m, key, getattr(m.workspace, key))
    if os.path.lexists(state_dir):
        ensure_dir_inside(state_dir, root, what="state_dir")
    refuse_outward(os.path.join(root, m.workspace.out_dir), root, what="out_dir")
    state = load_state(os.path.join(state_dir, JOURNAL_NAME))
    stats = StatCache(os.path.join(state_dir, STATCACHE_NAME))
    keys = KeyComputer(root, stats, m.problems, toolchains)
    extra = []
    if m.llms:
        from epbuild.planning.llms import llm_groups

        prepare = toolchains is not None and toolchains.create
        extra = llm_groups(m, keys, m.workspace.state_dir, prepare=prepare)
    graph = select_graph(make_graph(GraphRequest(m, tuple(extra), numerics)), selectors)
    actions = [a for a in graph if isinstance(a, CompileAction)]
    lock_timeout = toolchains.lock_timeout if toolchains is not None else None
    ws = Workspace(
        m, root, state_dir, state, stats, keys, actions, graph, lock_timeout, tuple(selectors)
    )
    keys.outputs_of = functools.partial(_recorded_by_id, ws)
    return ws


def _recorded_by_id(ws: Workspace, action_id: str) -> list[str]:
    rec = ws.state.records.get(action_id)
    return sorted(rec.outputs) if rec else []


def open_action_cache(
    ws: Workspace,
    directory: str | os.PathLike[str],
    option: str | bool | None,
    push: bool = False,
    cache_only: bool = False,
) -> ActionCache | None:
    """The build's action cache: ``option`` (a directory or URL, False for none, None for the
    configured one), else the manifest's; ``push`` also writes compiles to a remote tier;
    ``cache_only`` (``--cache-only``) refuses a cache that is off."""
    configured = ws.manifest.workspace.cache
    cfg = resolve(
        option,
        base=os.path.abspath(directory),
        manifest_value=configured,
        manifest_root=ws.root,
        push=push,
    )
    return open_cache(cfg, push=push, cache_only=cache_only, chosen_by=source(option, configured))


def save_stats(ws: Workspace) -> None:
    """Persist new stat-cache entries (under the state lock)."""
    if not ws.stats.dirty or not os.path.isdir(ws.state_dir):
        return
    from epbuild.state import locks

    with locks.hold(ws.state_lock, "epbuild (saving the stat cache)", timeout=ws.lock_timeout):
        ws.stats.save()


def recorded_outputs(ws: Workspace, action: GraphAction) -> list[str]:
    """The workspace-relative outputs the journal records for ``action`` (none: not built)."""
    rec = ws.state.records.get(action.id)
    return sorted(rec.outputs) if rec else []
