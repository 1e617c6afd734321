"""Actions: the units of compile work a manifest describes, in a deterministic order."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from epbuild._dataclass import dataclass
from epbuild._names import CTX_SUFFIX
from epbuild.errors import UserError
from epbuild.kinds.contract import ActionIdentity
from epbuild.manifest.model import CompileSettings, Group, Manifest, ModelEntry
from epbuild.providers.contract import ProviderConfig

if TYPE_CHECKING:
    from epbuild.kinds.contract import GraphAction
    from epbuild.toolchains.spec import ToolchainSpec

A = TypeVar("A", bound="GraphAction")


@dataclass(frozen=True)
class CompileAction(ActionIdentity):
    """One unit of compile work: a sharing group × provider, or one model × provider."""

    id: str
    """``group/provider`` for a sharing group, ``group/provider/<model name>`` otherwise."""
    group: Group
    provider: ProviderConfig
    entries: tuple[ModelEntry, ...]
    """The models, in session order."""
    out_dir: str
    """Workspace-relative directory the outputs go to: ``<out_dir>/<group>/<provider>``."""
    deps: tuple[str, ...] = ()
    """Ids of the actions whose outputs it reads (an LLM's preparation): it runs after
    them."""

    @property
    def kind(self) -> str:
        """What sort of work it is (``epbuild.kinds``)."""
        return "compile"

    @property
    def group_name(self) -> str:
        return self.group.name

    @property
    def provider_name(self) -> str:
        return self.provider.name

    @property
    def toolchain(self) -> ToolchainSpec | None:
        return self.provider.toolchain

    @property
    def models(self) -> tuple[str, ...]:
        """Workspace-relative source models, in session order (a source may repeat under
        different names)."""
        return tuple(e.path for e in self.entries)

    @property
    def names(self) -> tuple[str, ...]:
        """The models' output stems (the file's stem unless the manifest names it)."""
        return tuple(e.name for e in self.entries)

    @property
    def free_dimensions(self) -> tuple[dict[str, int], ...]:
        """Per model, the free-dimension overrides it is compiled with."""
        return tuple(self.group.free_dimensions_of(e) for e in self.entries)

    @property
    def compile(self) -> CompileSettings:
        """How it compiles: its group's settings for its provider (``Group.compile``)."""
        return self.group.compile[self.provider.name]

    @property
    def ctx_names(self) -> tuple[str, ...]:
        """File names of the ctx models, one per source model."""
        return tuple(n + CTX_SUFFIX for n in self.names)

    @property
    def initializer_names(self) -> tuple[str, ...]:
        """Per model, the external-initializer file name; empty when initializers stay inline.

        The configured name as is when it can only ever be one action's one model; otherwise
        prefixed with the model's name, so models sharing an output directory never collide.
        """
        name, g = self.group.context.external_initializers, self.group
        if not name:
            return ()
        if len(self.models) == 1 and not g.context.share_weights and len(g.models) == 1:
            return (name,)
        return tuple(f"{n}_{name}" for n in self.names)

    @property
    def ctx_paths(self) -> tuple[str, ...]:
        """Workspace-relative paths of the ctx models."""
        return tuple(posixpath.join(self.out_dir, n) for n in self.ctx_names)


def make_actions(manifest: Manifest, extra: Sequence[Group] = ()) -> list[CompileAction]:
    """All actions of a manifest, groups and providers in manifest order, then those of
    ``extra`` groups (LLM entries: ``planning.llms``), whose ``provider_configs`` may
    replace a provider's configuration."""
    actions: list[CompileAction] = []
    groups = list(manifest.groups.values())
    if any(g.quantize is not None for g in groups):  # else the quantization kinds stay unloaded
        from epbuild.planning.quantize import compiled_group

        groups = [compiled_group(manifest, g) for g in groups]
    for group in [*groups, *extra]:
        own: Mapping[str, ProviderConfig] = getattr(group, "provider_configs", {})
        for pname in group.providers:
            provider = own.get(pname) or manifest.providers[pname]
            out_dir = posixpath.join(manifest.workspace.out_dir, group.name, pname)
            if group.context.share_weights:
                part = getattr(group, "part", "")  # an LLM split into parts: one per part
                action_id = f"{group.name}/{pname}" + (f"/{part}" if part else "")
                deps = group.deps_for(group.entries)
                actions.append(
                    CompileAction(action_id, group, provider, group.entries, out_dir, deps)
                )
            else:
                for entry in group.entries:
                    action_id = f"{group.name}/{pname}/{entry.name}"
                    deps = group.deps_for((entry,))
                    actions.append(
                        CompileAction(action_id, group, provider, (entry,), out_dir, deps)
                    )
    return actions


def select(actions: list[A], selectors: list[str] | tuple[str, ...]) -> list[A]:
    """Actions matching any selector (a group, ``group/provider`` or an action id)."""
    if not selectors:
        return actions
    chosen: list[A] = []
    for sel in selectors:
        sel = sel.strip("/")
        matched = [
            a
            for a in actions
            if a.id == sel or a.group_name == sel or f"{a.group_name}/{a.provider_name}" == sel
        ]
        if not matched:
            known = ", ".join(sorted({a.group_name for a in actions})) or "none"
            raise UserError(
                f"no action matches {sel!r}",
                hint=f"give a group ({known}), group/provider or an action id "
                "(see 'epbuild status')",
            )
        chosen.extend(a for a in matched if a not in chosen)
    return [a for a in actions if a in chosen]
