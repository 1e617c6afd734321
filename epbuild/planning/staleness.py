"""The plan: which actions are stale, and why (reasons are data, shared by status,
dry-run and JSON output)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from epbuild._dataclass import dataclass, field
from epbuild.errors import ModelError, ToolchainError, UserError
from epbuild.kinds.contract import GraphAction, kind_of
from epbuild.planning.keys import ActionKey, KeyComputer, explain_difference
from epbuild.planning.moves import moved_from, moved_reason
from epbuild.state.journal import State
from epbuild.state.statcache import StatCache
from epbuild.toolchains.resolve import ToolchainPending


@dataclass
class ActionPlan:
    """One action's planned fate."""

    action: GraphAction
    key: ActionKey | None
    stale: bool
    reasons: list[str] = field(default_factory=list)
    error: UserError | None = None
    """A broken input or toolchain: the action cannot be built until it is fixed."""


def outputs_intact(
    root: str, stats: StatCache, outputs: Mapping[str, tuple[int, str]]
) -> list[str]:
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
            cached = stats.digest(root, rel, output=True)
        if cached.digest != digest:
            problems.append(f"output {rel} was modified")
    return problems


def plan_action(
    action: GraphAction,
    state: State,
    keys: KeyComputer,
    stats: StatCache,
    root: str,
    *,
    fresh: bool = False,
) -> ActionPlan:
    """Decide whether one action is stale; ``fresh`` re-checks the inputs' digests instead
    of taking those memoised earlier in the run (``KeyComputer.model_inputs``)."""
    keyed = _key(action, state, keys, fresh=fresh)
    if isinstance(keyed, ActionPlan):
        return keyed
    return plan_keyed(action, keyed, state, stats, root)


def _key(
    action: GraphAction, state: State, keys: KeyComputer, *, fresh: bool = False
) -> ActionKey | ActionPlan:
    """The action's key (its kind's), or its plan when it has none (a broken input or
    toolchain)."""
    try:
        return kind_of(action).key(action, keys, fresh=fresh)
    except ToolchainPending as exc:  # status: the build will make it
        return ActionPlan(action, None, True, _pending(action, state, exc))
    except (ModelError, ToolchainError) as exc:
        return ActionPlan(action, None, True, [exc.message], error=exc)


def plan_keyed(
    action: GraphAction,
    key: ActionKey,
    state: State,
    stats: StatCache,
    root: str,
) -> ActionPlan:
    """The plan of an action under its key (``status`` also plans one under the key the
    build will compute once it has restored the actions whose outputs this one reads)."""
    if action.id in state.damaged:
        return ActionPlan(action, key, True, [state.damaged[action.id].reason()])
    if action.id in state.interrupted:
        return ActionPlan(action, key, True, ["the last build of this action was interrupted"])
    committed = state.records.committed(action.id)  # without decoding the whole record
    if committed is None:
        return ActionPlan(action, key, True, ["never built"])
    recorded, outputs = committed
    old = moved_from(action.out_dir, outputs)  # out_dir or state_dir changed since
    moved = [] if old is None else [moved_reason(old, action.out_dir)]
    if recorded != key.key:
        components = state.records[action.id].components
        reasons = explain_difference(components, key.components)
        return ActionPlan(action, key, True, [*moved, *reasons])
    if moved:
        return ActionPlan(action, key, True, moved)
    problems = outputs_intact(root, stats, outputs)
    return ActionPlan(action, key, bool(problems), problems)


def _pending(action: GraphAction, state: State, exc: ToolchainPending) -> list[str]:
    """Why an action whose toolchain is not made yet is stale: what changed in its
    toolchain when it was built before with another one."""
    rec = state.records.get(action.id)
    spec = action.toolchain
    if rec is None or spec is None:
        return [exc.message]
    before = rec.components.get("toolchain")
    if before is not None and before != spec.key():
        now = json.dumps(spec.key(), sort_keys=True)
        return [f"toolchain {json.dumps(before, sort_keys=True)} → {now} ({exc.message})"]
    return [exc.message]


EMBED_LIMIT = 2 << 30
"""Protobuf's 2 GB message limit: a ctx model with the context embedded cannot exceed it."""


def make_plan(
    actions: Sequence[GraphAction], state: State, keys: KeyComputer, stats: StatCache, root: str
) -> list[ActionPlan]:
    """Plan every action, in order (each after those it depends on): every key first,
    then every action's outputs (their stat calls together; interleaved with the keys'
    work they made planning 5,000 actions about a third slower, ``benchmarks/bench_plan.py``).
    An action that depends on a stale one is stale too, whatever its inputs say now: the
    build plans it again once that one has run (early cutoff: outputs that come out the
    same leave it up to date)."""
    keyed = [_key(a, state, keys) for a in actions]
    plans: dict[str, ActionPlan] = {}
    for action, k in zip(actions, keyed, strict=True):
        plan = k if isinstance(k, ActionPlan) else plan_keyed(action, k, state, stats, root)
        waits = [plans[d].action for d in action.deps if d in plans and plans[d].stale]
        if waits:
            now = plan.reasons if plan.error is None else []
            reasons = [kind_of(waits[0]).words.waits_note(waits[0]), *now]
            key = plan.key if plan.error is None else None
            plan = ActionPlan(action, key, True, reasons)
        plans[action.id] = plan
    return list(plans.values())
