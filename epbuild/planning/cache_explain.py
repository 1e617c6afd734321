"""What the cache says about stale actions, appended to their reasons by ``status``: what
the build will do with each, restore it or run it.

An action that reads a stale one's outputs is keyed as the build will key it once it has
brought that one up to date: by the outputs the cache restores for it (a quantization by its
calibration's cached ranges, a compile by its cached QDQ model), not by the files there now.
An action that runs makes outputs nobody knows yet: whether the cache has its readers is
known once it has run."""

from __future__ import annotations

import copy
import posixpath
from typing import TYPE_CHECKING

from epbuild.cache.store import CorruptEntryError
from epbuild.errors import EpbuildError
from epbuild.kinds.contract import kind_of
from epbuild.planning.keys import ActionKey, Expected, KeyComputer
from epbuild.planning.staleness import plan_keyed

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache
    from epbuild.planning.staleness import ActionPlan
    from epbuild.planning.workspace import Workspace


def explain_plans(cache: ActionCache, plans: list[ActionPlan], ws: Workspace) -> None:
    """Add to each stale plan whether the cache can restore it, and if not why not."""
    keys = copy.copy(ws.keys)  # shares the memoised digests; its own expected outputs
    keys.expected = {}
    read = {d for p in plans if p.stale for d in p.action.deps}
    runs: dict[str, bool] = {}
    """A stale action → whether the build runs it (False: it restores it, or the restore
    of those it reads leaves it up to date)."""
    for plan in plans:
        if not plan.stale:
            continue
        try:
            runs[plan.action.id] = _explain(cache, plan, ws, keys, runs, plan.action.id in read)
        except Exception as exc:  # an unreachable remote must not break status
            plan.reasons.append(f"cache unreadable ({cache.describe()}): {exc}")
            runs[plan.action.id] = True


def _explain(
    cache: ActionCache,
    plan: ActionPlan,
    ws: Workspace,
    keys: KeyComputer,
    runs: dict[str, bool],
    read: bool,
) -> bool:
    """Say what the build does with one stale action; whether it runs it. ``read``: a
    later stale action reads its outputs (``keys.expected`` gets what a restore puts
    there)."""
    action = plan.action
    waits = [d for d in action.deps if d in runs]
    running = [d for d in waits if runs[d]]
    if running:
        plan.reasons.append(
            f"whether the cache has it is known once {running[0]} is up to date (its outputs are "
            "this action's inputs)"
        )
        return True
    key: ActionKey | None = None if plan.error is not None else plan.key
    if waits:  # each restores: keyed as the build will key it after those restores
        try:
            key = kind_of(action).key(action, keys, fresh=False)
        except EpbuildError:  # (a restore that is not at hand to read)
            plan.reasons.append(f"whether the cache has it is known once {waits[0]} is restored")
            return True
        again = plan_keyed(action, key, ws.state, ws.stats, ws.root)
        if again.error is not None:
            return True
        if not again.stale:
            plan.reasons.append(
                f"up to date once {waits[0]} is restored from the cache (the same inputs "
                "as its last build)"
            )
            return False
    if key is None:
        return True
    return _restores(cache, plan, key, keys, read)


def _restores(
    cache: ActionCache, plan: ActionPlan, key: ActionKey, keys: KeyComputer, read: bool
) -> bool:
    """Say whether the cache restores ``key``, and if not why not; whether the build runs
    the action (see ``_explain``)."""
    action = plan.action
    where = cache.has(key.key)
    if where is None:
        plan.reasons.append("not in the cache: " + cache.explain_miss(action.id, key.components))
        return True
    local = where == cache.local.url
    if read or local:
        try:
            entry = cache.entry(key.key)
        except CorruptEntryError as exc:
            plan.reasons.append(f"not in the cache: {exc} (a build discards it and runs this)")
            return True
        lacking = cache.lacking(entry) if local and entry is not None else None
        if lacking is not None:
            plan.reasons.append(
                f"not in the cache: its entry lacks the object of {lacking} (a build discards "
                "it and runs this)"
            )
            return True
    if read:  # what it restores: what the actions that read it are keyed by
        for name, out in entry.outputs.items() if entry is not None else ():
            rel = posixpath.join(action.out_dir, name)
            keys.expected[rel] = Expected(out.digest, cache.local_copy(out.digest))
    plan.reasons.append(f"in the cache ({where}): a build restores it")
    return False
