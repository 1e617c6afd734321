"""The build graph of a manifest: every action of every kind, each after the actions it
depends on, checked (unique ids, dependencies that exist, no cycle) and selected."""

from __future__ import annotations

from collections.abc import Sequence

from epbuild.errors import UserError
from epbuild.kinds.contract import GraphAction, kind_of, registered_actions
from epbuild.manifest.model import Manifest
from epbuild.planning.actions import Action, select


def make_graph(
    manifest: Manifest, compiles: Sequence[Action], *, numerics: bool = False
) -> list[GraphAction]:
    """The actions of every kind: calibrations and quantizations, LLM preparations, the
    compiles, LLM packages, the compiles' numerical checks (``numerics``: only when a
    command asks for them), then those of kinds added by ``kinds.contract.register``; each
    after its dependencies."""
    before: list[GraphAction] = []
    after: list[GraphAction] = []
    if any(g.quantize is not None for g in manifest.groups.values()):  # else not imported
        from epbuild.planning.quantize import quantization_actions

        before += quantization_actions(manifest)
    if manifest.llms:
        from epbuild.planning.llms import llm_packages, llm_preparations, llm_quantizations

        before += llm_preparations(manifest)
        before += llm_quantizations(manifest)
        after += llm_packages(manifest, compiles)
    if numerics:
        from epbuild.kinds.check import check_actions

        after += check_actions(list(compiles), manifest.workspace.state_dir)
    return ordered([*before, *compiles, *after, *registered_actions(manifest)])


def ordered(actions: Sequence[GraphAction]) -> list[GraphAction]:
    """``actions`` in their order, except that each comes after the actions it depends on
    (Kahn's algorithm, stable); a duplicate id, a dependency that is not an action or a
    cycle is a ``UserError`` naming the actions."""
    by_id: dict[str, GraphAction] = {}
    for a in actions:
        if a.id in by_id:
            raise UserError(
                f"two actions are named {a.id!r} ({by_id[a.id].kind} and {a.kind})",
                hint="rename one of the manifest entries they come from",
            )
        by_id[a.id] = a
    for a in actions:
        for dep in a.deps:
            if dep not in by_id:
                raise UserError(
                    f"action {a.id} depends on {dep}, which is not an action of this manifest",
                    hint="this is a bug in the kind that made the action",
                )
    done: dict[str, GraphAction] = {}
    left = list(actions)
    while left:
        ready = [a for a in left if all(d in done for d in a.deps)]
        if not ready:
            cycle = " → ".join(a.id for a in left)
            raise UserError(
                f"the actions {cycle} depend on each other in a circle",
                hint="this is a bug in the kinds that made them",
            )
        for a in ready:
            done[a.id] = a
        left = [a for a in left if a.id not in done]
    return list(done.values())


def select_graph(actions: Sequence[GraphAction], selectors: Sequence[str]) -> list[GraphAction]:
    """The actions ``selectors`` match (``actions.select``), every action they depend on,
    directly or not, and each action of a kind that ``follows`` whose dependencies are all
    among them; in graph order."""
    if not selectors:
        return list(actions)
    by_id = {a.id: a for a in actions}
    chosen: set[str] = set()
    todo = [a.id for a in select(list(actions), tuple(selectors))]
    while todo:
        action_id = todo.pop()
        if action_id not in chosen:
            chosen.add(action_id)
            todo.extend(by_id[action_id].deps)
    for a in actions:  # graph order: what follows comes after what it follows
        if a.deps and kind_of(a).follows and all(d in chosen for d in a.deps):
            chosen.add(a.id)
    return [a for a in actions if a.id in chosen]
