"""What the cache says about stale actions, appended to their reasons by ``status``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache
    from epbuild.planning.staleness import ActionPlan


def explain_plans(cache: ActionCache, plans: list[ActionPlan]) -> None:
    """Add to each stale plan whether the cache can restore it, and if not why not."""
    for plan in plans:
        if not plan.stale or plan.key is None:
            continue
        try:
            where = cache.has(plan.key.key)
            if where is not None:
                plan.reasons.append(f"in the cache ({where}): a build restores it")
            else:
                plan.reasons.append(
                    "not in the cache: " + cache.explain_miss(plan.action.id, plan.key.components)
                )
        except Exception as exc:  # an unreachable remote must not break status
            plan.reasons.append(f"cache unreadable ({cache.describe()}): {exc}")
