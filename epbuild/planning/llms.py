"""LLM entries as compile groups: each ``[llms.<name>]`` whose source is a single decoder
becomes a group of its two prepared graphs (``context``, ``iterator``), or with ``parts``
one group per part (``partK_context``, ``partK_iterator``: ``llm.parts``); one whose source is a
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
from epbuild.kinds.llmquant import LlmCalibrateAction, LlmQuantizeAction, llm_quant_actions
from epbuild.kinds.package import PackageAction
from epbuild.kinds.prepare import PrepareAction, prepare_action
from epbuild.llm.parts import STAGE_SEQUENCES, part_name, part_stages
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
    """The actions whose outputs its graphs are (a single decoder's preparation, or its
    graphs' quantizations)."""
    part: str = ""
    """The part of a decoder split into parts (``part1``, …; ``llm.parts``): each is a
    group of its own, compiled (and weight-shared) apart from the others; empty: the
    whole decoder."""
    deps_by_graph: Mapping[str, str] = field(default_factory=dict)
    """Graph name → the one action whose output it is (a quantized LLM's: each graph's
    compile waits for its own quantization only)."""

    def deps_for(self, entries: Sequence[ModelEntry]) -> tuple[str, ...]:
        if self.deps_by_graph:
            return tuple(dict.fromkeys(self.deps_by_graph[e.name] for e in entries))
        return self.deps


def llm_groups(
    manifest: Manifest, keys: KeyComputer, state_dir: str, *, prepare: bool
) -> list[LlmGroup]:
    """The groups of every buildable LLM entry. A single decoder's graphs are the outputs
    of its preparation (``llm_preparations``), which its compile actions depend on; a
    pipeline's stages compile as they are, with the default ``op_affinity.json``, which
    ``prepare`` writes (a build) where it is missing. A pipeline source that cannot be read
    becomes a problem of the group's models (its actions fail, the others build)."""
    groups: list[LlmGroup] = []
    for llm in manifest.llms.values():
        providers = {p: manifest.providers[p] for p in llm.providers}
        # A pipeline with no compiled stage has nothing to compile: the build says so.
        if llm.form == DECODER or compiled_stages(keys.root, llm):
            groups.extend(by_part(_group(manifest, llm, providers, keys, state_dir, prepare), llm))
    return groups


def by_part(group: LlmGroup, llm: Llm) -> list[LlmGroup]:
    """``group`` as one group per part of ``llm`` (itself when it has one part)."""
    if llm.parts == 1:
        return [group]
    stages = len(STAGE_SEQUENCES)
    return [
        replace(group, entries=group.entries[i * stages : (i + 1) * stages], part=part_name(i + 1))
        for i in range(llm.parts)
    ]


def llm_preparations(request: GraphRequest) -> list[PrepareAction]:
    """The preparation action of each single-decoder LLM entry (the prepare kind's)."""
    llms, state_dir = request.manifest.llms, request.manifest.workspace.state_dir
    return [prepare_action(llm, state_dir) for llm in llms.values() if llm.form == DECODER]


def llm_quantizations(request: GraphRequest) -> list[LlmCalibrateAction | LlmQuantizeAction]:
    """The calibration and the graphs' quantizations of each quantized LLM entry (the LLM
    quantize kind's actions, with their calibrations)."""
    manifest = request.manifest
    state_dir = manifest.workspace.state_dir
    actions: list[LlmCalibrateAction | LlmQuantizeAction] = []
    for llm in manifest.llms.values():
        if llm.quantize is not None and llm.form == DECODER:
            recipe = manifest.quantization[llm.quantize]
            prep = prepare_action(llm, state_dir)
            calibrate, quantize = llm_quant_actions(llm, recipe, prep, state_dir)
            actions += [calibrate, *quantize]
    return actions


def _quantized(cfg: ProviderConfig) -> ProviderConfig:
    """``cfg`` for QDQ graphs (QNN: the graph's I/O quantization on the HTP too: one
    EPContext node with float inputs and outputs)."""
    return get_provider(cfg.ep).for_quantized(cfg)


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
    deps_by_graph: dict[str, str] = {}


def _group(
    manifest: Manifest,
    llm: Llm,
    providers: Mapping[str, ProviderConfig],
    keys: KeyComputer,
    state_dir: str,
    prepare: bool,
) -> LlmGroup:
    """The group of an LLM entry's graphs; a problem becomes each graph's (its actions
    fail), and each provider gets the graphs' ``op_affinity`` (``with_affinity``)."""
    if llm.form == DECODER:
        graphs = _decoder_graphs(llm, keys, state_dir, prepare, manifest)
    else:
        graphs = _pipeline_graphs(llm, keys, state_dir, prepare)
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
        provider_configs={
            p: with_affinity(_quantized(cfg) if llm.quantize else cfg, graphs.folder)
            for p, cfg in providers.items()
        },
        deps=graphs.deps,
        deps_by_graph=graphs.deps_by_graph,
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


def _decoder_graphs(
    llm: Llm, keys: KeyComputer, state_dir: str, prepare: bool, manifest: Manifest
) -> _Graphs:
    """A single decoder's two static graphs (``context``, ``iterator``): the outputs of
    its preparation, or of their quantizations (``quantize``), which the compile actions
    depend on."""
    prep = prepare_action(llm, state_dir)
    if llm.quantize is not None:
        recipe = manifest.quantization[llm.quantize]
        _, quantize = llm_quant_actions(llm, recipe, prep, state_dir)
        entries = tuple(ModelEntry(path=q.output, name=q.stage) for q in quantize)
        by_graph = {q.stage: q.id for q in quantize}
        return _Graphs(entries, prep.out_dir, None, {}, tuple(by_graph.values()), by_graph)
    entries = tuple(
        ModelEntry(path=path, name=stage)
        for path, stage in zip(prep.graphs, decoder_stages(llm), strict=True)
    )
    return _Graphs(entries, prep.out_dir, None, {}, (prep.id,))


def decoder_stages(llm: Llm) -> tuple[str, ...]:
    """The compiled stages of a single decoder, in session order: ``context`` and
    ``iterator``, or each part's (``llm.parts``)."""
    if llm.parts == 1:
        return tuple(stage for stage, _ in STAGES)
    return tuple(stage for stage, _ in part_stages(llm.parts))


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
        by_graph: dict[str, str] = {}
        if llm.form == DECODER:
            stages = list(decoder_stages(llm))
            prep = prepare_action(llm, manifest.workspace.state_dir)
            deps = (prep.id,)
            if llm.quantize is not None:
                recipe = manifest.quantization[llm.quantize]
                _, quantize = llm_quant_actions(llm, recipe, prep, manifest.workspace.state_dir)
                by_graph = {q.stage: q.id for q in quantize}
                deps = tuple(by_graph.values())
        else:
            stages = [stage for stage, _ in compiled_stages(str(manifest.root), llm)]
        if stages:
            entries = tuple(ModelEntry(path="", name=n) for n in stages)
            groups.extend(by_part(_llm_group(llm, entries, deps=deps, deps_by_graph=by_graph), llm))
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
            prepare_action(t.llm, request.manifest.workspace.state_dir).out_dir
            if t.llm.parts > 1
            else "",
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
        llm = manifest.llms[name]
        wanted = decoder_stages(llm) if llm.form == DECODER else first.group.entries
        if len({e.name for a in mine for e in a.entries}) < len(wanted):
            continue
        targets.append(
            PackageTarget(manifest.llms[name], first.provider, first.out_dir, tuple(mine))
        )
    return targets
