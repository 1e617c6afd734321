"""The plan: which actions are stale, and why (reasons are data, shared by status,
dry-run and JSON output)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from epbuild.errors import ModelError, ToolchainError, UserError
from epbuild.planning.actions import Action
from epbuild.planning.keys import ActionKey, KeyComputer, explain_difference
from epbuild.state.journal import State
from epbuild.state.statcache import StatCache
from epbuild.toolchains.resolve import ToolchainPending


@dataclass
class ActionPlan:
    """One action's planned fate."""

    action: Action
    key: ActionKey | None
    stale: bool
    reasons: list[str] = field(default_factory=list)
    error: UserError | None = None
    """A broken input or toolchain: the action cannot be built until it is fixed."""


def outputs_intact(root: str, stats: StatCache, outputs: dict[str, tuple[int, str]]) -> list[str]:
    """Reasons an action's recorded outputs are not intact (empty when they are)."""
    problems: list[str] = []
    for rel, (size, digest) in outputs.items():
        full = os.path.join(root, rel)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            problems.append(f"output {rel} is missing")
            continue
        if st.st_size != size:
            problems.append(f"output {rel} was modified")
            continue
        cached = stats.lookup(rel, st)
        if cached is None:
            cached = stats.digest(root, rel)
        if cached.digest != digest:
            problems.append(f"output {rel} was modified")
    return problems


def plan_action(
    action: Action,
    state: State,
    keys: KeyComputer,
    stats: StatCache,
    root: str,
    *,
    fresh: bool = False,
) -> ActionPlan:
    """Decide whether one action is stale; ``fresh`` re-checks the inputs' digests instead
    of taking those memoised earlier in the run (``KeyComputer.compute``)."""
    keyed = _key(action, state, keys, fresh=fresh)
    if isinstance(keyed, ActionPlan):
        return keyed
    return _plan_keyed(action, keyed, state, stats, root)


def _key(
    action: Action, state: State, keys: KeyComputer, *, fresh: bool = False
) -> ActionKey | ActionPlan:
    """The action's key, or its plan when it has none (a broken input or toolchain)."""
    try:
        return keys.compute(action, fresh=fresh)
    except ToolchainPending as exc:  # status: the build will make it
        return ActionPlan(action, None, True, _pending(action, state, exc))
    except (ModelError, ToolchainError) as exc:
        return ActionPlan(action, None, True, [exc.message], error=exc)


def _plan_keyed(
    action: Action, key: ActionKey, state: State, stats: StatCache, root: str
) -> ActionPlan:
    too_big = _embed_too_big(action, key, stats, root)
    if too_big is not None:
        return ActionPlan(action, key, True, [too_big.message], error=too_big)
    rec = state.records.get(action.id)
    if action.id in state.damaged:
        return ActionPlan(action, key, True, [state.damaged[action.id].reason()])
    if action.id in state.interrupted:
        return ActionPlan(action, key, True, ["the last build of this action was interrupted"])
    if rec is None:
        return ActionPlan(action, key, True, ["never built"])
    if rec.key != key.key:
        return ActionPlan(action, key, True, explain_difference(rec.components, key.components))
    problems = outputs_intact(root, stats, {p: (o.size, o.digest) for p, o in rec.outputs.items()})
    return ActionPlan(action, key, bool(problems), problems)


def _pending(action: Action, state: State, exc: ToolchainPending) -> list[str]:
    """Why an action whose toolchain is not made yet is stale: what changed in its
    toolchain when it was built before with another one."""
    rec = state.records.get(action.id)
    spec = action.provider.toolchain
    if rec is None or spec is None:
        return [exc.message]
    before = rec.components.get("toolchain")
    if before is not None and before != spec.key():
        now = json.dumps(spec.key(), sort_keys=True)
        return [f"toolchain {json.dumps(before, sort_keys=True)} → {now} ({exc.message})"]
    return [exc.message]


EMBED_LIMIT = 2 << 30
"""Protobuf's 2 GB message limit: a ctx model with the context embedded cannot exceed it."""


def _embed_too_big(
    action: Action, key: ActionKey, stats: StatCache, root: str
) -> ModelError | None:
    if action.group.embed_mode != 1:
        return None
    for m in key.components["models"]:
        size = sum(stats.digest(root, rel).size for rel in (m["path"], *m["external"]))
        if size >= EMBED_LIMIT:
            return ModelError(
                f"{m['path']}: {size / (1 << 30):.1f} GB with its external data; with "
                "embed_mode = 1 its ctx model would pass protobuf's 2 GB limit",
                hint=f"set embed_mode = 0 for group {action.group.name!r} (and "
                "external_initializers for weights that stay on the CPU EP)",
            )
    return None


def make_plan(
    actions: list[Action], state: State, keys: KeyComputer, stats: StatCache, root: str
) -> list[ActionPlan]:
    """Plan every action, in order: every key first, then every action's outputs (their
    stat calls together; interleaved with the keys' work they made planning 5,000 actions
    about a third slower, ``benchmarks/bench_plan.py``)."""
    keyed = [_key(a, state, keys) for a in actions]
    return [
        k if isinstance(k, ActionPlan) else _plan_keyed(a, k, state, stats, root)
        for a, k in zip(actions, keyed, strict=True)
    ]
