"""LLM entries as compile groups: each ``[llms.<name>]`` whose source is a single decoder
becomes a group of its two prepared graphs (``context``, ``iterator``); one whose source is a
``decoder-pipeline`` already, a group of the stages a provider can take (static input
shapes: ``compiled_stages``; the others, e.g. a CPU ``embeddings`` or ``lm_head``, are
copied into the package as they are). Each group compiles for each provider through the
ordinary actions (keys, cache, locks, reports), shared (one action, N+1) or not (one action
per graph). Outputs go to ``<out_dir>/<name>/<provider>/``."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from epbuild._dataclass import dataclass, field, replace
from epbuild.errors import ModelError
from epbuild.kinds.package import PackageAction
from epbuild.kinds.prepare import PrepareAction, prepare_action
from epbuild.llm.prepare import AFFINITY, STAGES, write_affinity
from epbuild.llm.source import DECODER, static_stages
from epbuild.manifest.model import ContextSettings, Group, Llm, Manifest, ModelEntry
from epbuild.planning.actions import CompileAction
from epbuild.planning.keys import KeyComputer
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig

if TYPE_CHECKING:
    from epbuild.kinds.contract import GraphRequest


@dataclass(frozen=True)
class LlmGroup(Group):
    """The compile group of one LLM entry."""

    llm: Llm | None = None
    source_inputs: Mapping[str, str] = field(default_factory=dict)
    """The source decoder and its external data: path → digest (action inputs, so that the
    no-op path stamps them)."""
    provider_configs: Mapping[str, ProviderConfig] = field(default_factory=dict)
    """Provider name → its configuration for this LLM (``op_affinity`` defaulted)."""
    deps: tuple[str, ...] = ()
    """The actions whose outputs its graphs are (a single decoder's preparation)."""

    def deps_for(self, entries: Sequence[ModelEntry]) -> tuple[str, ...]:
        return self.deps


def llm_groups(
    manifest: Manifest, keys: KeyComputer, state_dir: str, *, prepare: bool
) -> list[LlmGroup]:
    """The groups of every buildable LLM entry. A single decoder's graphs are the outputs
    of its preparation (``llm_preparations``), which its compile actions depend on; a
    pipeline's stages compile as they are, with the default ``op_affinity.json``, which
    ``prepare`` writes (a build) where it is missing. A pipeline source that cannot be read
    becomes a problem of the group's models (its actions fail, the others build)."""
    groups = []
    for llm in manifest.llms.values():
        providers = {p: manifest.providers[p] for p in llm.providers}
        # A pipeline with no compiled stage has nothing to compile: the build says so.
        if llm.form == DECODER or compiled_stages(keys.root, llm):
            groups.append(_group(llm, providers, keys, state_dir, prepare))
    return groups


def llm_preparations(request: GraphRequest) -> list[PrepareAction]:
    """The preparation action of each single-decoder LLM entry (the prepare kind's)."""
    llms, state_dir = request.manifest.llms, request.manifest.workspace.state_dir
    return [prepare_action(llm, state_dir) for llm in llms.values() if llm.form == DECODER]


def compiled_stages(root: str, llm: Llm) -> tuple[tuple[str, str], ...]:
    """The stages of a ``decoder-pipeline`` source that are compiled (``static_stages``)."""
    return static_stages(os.path.join(root, llm.source), llm.stages)


class _Graphs(NamedTuple):
    """What an LLM entry compiles: its graphs, the folder of their ``op_affinity.json``,
    why they cannot be compiled (None: they can), the source's inputs."""

    entries: tuple[ModelEntry, ...]
    folder: str
    problem: Exception | None
    source_inputs: dict[str, str]
    deps: tuple[str, ...] = ()


def _group(
    llm: Llm,
    providers: Mapping[str, ProviderConfig],
    keys: KeyComputer,
    state_dir: str,
    prepare: bool,
) -> LlmGroup:
    """The group of an LLM entry's graphs; a problem becomes each graph's (its actions
    fail), and each provider gets the graphs' ``op_affinity`` (``with_affinity``)."""
    graphs = (_decoder_graphs if llm.form == DECODER else _pipeline_graphs)(
        llm, keys, state_dir, prepare
    )
    if graphs.problem is not None:
        hint = getattr(graphs.problem, "hint", None)
        message = getattr(graphs.problem, "message", None) or str(graphs.problem)
        for entry in graphs.entries:
            keys.problems[entry.path] = ModelError(message, hint=hint)
    return _llm_group(
        llm,
        graphs.entries,
        compile=dict(llm.compile),
        llm=llm,
        source_inputs=graphs.source_inputs,
        provider_configs={p: with_affinity(cfg, graphs.folder) for p, cfg in providers.items()},
        deps=graphs.deps,
    )


def _pipeline_graphs(llm: Llm, keys: KeyComputer, state_dir: str, prepare: bool) -> _Graphs:
    """A ``decoder-pipeline`` source's compiled stages, compiled as they are."""
    entries = tuple(
        ModelEntry(path=posixpath.join(llm.source, filename), name=stage)
        for stage, filename in compiled_stages(keys.root, llm)
    )
    folder = posixpath.join(state_dir, "llm", llm.name)
    affinity = os.path.join(keys.root, folder, AFFINITY)
    if prepare and not os.path.isfile(affinity):
        write_affinity(affinity)
    problem = None
    if not os.path.isfile(affinity):
        problem = ModelError(
            f"llms.{llm.name}: its op_affinity.json is not written yet",
            hint="'epbuild build' writes it",
        )
    return _Graphs(entries, folder, problem, {})


def _decoder_graphs(llm: Llm, keys: KeyComputer, state_dir: str, prepare: bool) -> _Graphs:
    """A single decoder's two static graphs (``context``, ``iterator``): the outputs of
    its preparation, which the compile actions depend on."""
    prep = prepare_action(llm, state_dir)
    entries = tuple(
        ModelEntry(path=path, name=stage)
        for path, (stage, _) in zip(prep.graphs, STAGES, strict=True)
    )
    return _Graphs(entries, prep.out_dir, None, {}, (prep.id,))


def _llm_group(entry: Llm, entries: tuple[ModelEntry, ...], **more: Any) -> LlmGroup:
    """An LLM entry as a group: its graphs, providers and sharing; the rest of a group's
    settings are fixed (embed 0, by path, no prefix, no external initializers)."""
    return LlmGroup(
        name=entry.name,
        entries=entries,
        providers=entry.providers,
        context=ContextSettings(share_weights=entry.share_weights),
        patterns=(),
        **more,
    )


def llm_shapes(manifest: Manifest) -> list[LlmGroup]:
    """The LLM groups without their prepared paths: enough for action ids (``orphaned``,
    watch), computed without preparing anything (a pipeline's stage files are read for
    their input shapes)."""
    groups = []
    for llm in manifest.llms.values():
        deps: tuple[str, ...] = ()
        if llm.form == DECODER:
            stages = [stage for stage, _ in STAGES]
            deps = (prepare_action(llm, manifest.workspace.state_dir).id,)
        else:
            stages = [stage for stage, _ in compiled_stages(str(manifest.root), llm)]
        if stages:
            entries = tuple(ModelEntry(path="", name=n) for n in stages)
            groups.append(_llm_group(llm, entries, deps=deps))
    return groups


def with_affinity(cfg: ProviderConfig, folder: str) -> ProviderConfig:
    """``cfg`` with the prepared ``op_affinity`` file (GroupQueryAttention on the HTP) where
    its EP takes one and the manifest sets none."""
    names = get_provider(cfg.ep).file_options
    if "op_affinity" not in names or "op_affinity" in cfg.options:
        return cfg
    return replace(cfg, options={**cfg.options, "op_affinity": posixpath.join(folder, AFFINITY)})


@dataclass(frozen=True)
class PackageTarget:
    """One LLM × provider package: its folder and the actions that compile its graphs."""

    llm: Llm
    provider: ProviderConfig
    out_dir: str
    """Workspace-relative ``<out_dir>/<llm>/<provider>``."""
    actions: tuple[CompileAction, ...]


def llm_packages(request: GraphRequest) -> list[PackageAction]:
    """The package action of each LLM × provider whose graphs all compile (the package
    kind's), after them."""
    compiles = [a for a in request.made if isinstance(a, CompileAction)]
    return [
        PackageAction(
            f"{t.llm.name}/{t.provider.name}/package",
            t.llm,
            t.provider,
            t.out_dir,
            tuple(a.id for a in t.actions),
        )
        for t in package_targets(request.manifest, compiles)
    ]


def package_targets(manifest: Manifest, actions: Sequence[CompileAction]) -> list[PackageTarget]:
    """The packages whose graphs are all among ``actions`` (a selection of some of an LLM's
    graphs makes no package), sorted by LLM and provider."""
    found: dict[tuple[str, str], list[CompileAction]] = {}
    for action in actions:
        if isinstance(action.group, LlmGroup):
            found.setdefault((action.group.name, action.provider.name), []).append(action)
    targets = []
    for (name, _), mine in sorted(found.items()):
        first = mine[0]
        if len({e.name for a in mine for e in a.entries}) < len(first.group.entries):
            continue
        targets.append(
            PackageTarget(manifest.llms[name], first.provider, first.out_dir, tuple(mine))
        )
    return targets
