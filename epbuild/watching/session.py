"""One watch session: the last good manifest, what changed, and the build each cycle runs."""

from __future__ import annotations

import functools
import os
import posixpath
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from epbuild.api import build
from epbuild.errors import EpbuildError, Interrupted
from epbuild.executors.local import LocalExecutor
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.manifest.load import load_manifest
from epbuild.planning.actions import make_actions, select
from epbuild.planning.llms import llm_shapes
from epbuild.results import Outcome, Reporter
from epbuild.watching.targets import Sig, glob_match, make_targets, samples_of, signature

if TYPE_CHECKING:
    from epbuild.manifest.load import Manifest
    from epbuild.planning.actions import CompileAction
    from epbuild.results import ActionResult, BuildResult


@dataclass
class Cycle:
    """One watch cycle: what changed and what the build did about it."""

    number: int
    changed: list[str]
    """Workspace-relative paths that changed (empty for the first build)."""
    reloaded: bool = False
    """The manifest was re-read and differs from the one before."""
    manifest_error: str | None = None
    """The manifest could not be reloaded; the last good one is still in use."""
    error: str | None = None
    """The build could not start (e.g. a selector no longer matches)."""
    result: BuildResult | None = None
    first_event: float | None = None
    """Wall time of the first event of the burst this cycle answers."""
    started: float = 0.0
    finished: float = 0.0
    action_started: dict[str, float] = field(default_factory=dict)
    """Action id -> wall time its compile started."""
    again: list[str] = field(default_factory=list)
    """Workspace-relative inputs that changed while the build read them (a file still being
    saved): the actions that failed on them are skipped, and the next cycle builds them."""

    @property
    def ok(self) -> bool:
        """Nothing failed in this cycle."""
        return (
            not self.manifest_error and not self.error and (self.result is None or self.result.ok)
        )

    def to_json(self) -> dict[str, Any]:
        """One line of ``watch --json``."""
        data: dict[str, Any] = {
            "cycle": self.number,
            "changed": self.changed,
            "manifest_reloaded": self.reloaded,
            "manifest_error": self.manifest_error,
            "build_error": self.error,  # ("error" is the envelope's: a failed command)
            "first_event": self.first_event,
            "started": self.started,
            "finished": self.finished,
            "action_started": self.action_started,
            "changed_while_read": self.again,
        }
        if self.result is not None:
            data.update(self.result.to_json())
        else:
            data.update({"summary": None, "actions": [], "warnings": []})
        return data


class CycleReporter(Reporter):
    """Forwards progress to the caller's reporter and notes when each compile started; a
    failure on an input that changed while it was read reaches it as a skip (``settle``)."""

    def __init__(
        self,
        inner: Reporter,
        started: dict[str, float],
        settle: Callable[[ActionResult], ActionResult],
    ) -> None:
        self.inner = inner
        self.started = started
        self.settle = settle

    def start(self, total: int, stale: int) -> None:
        self.inner.start(total, stale)

    def action_started(self, action_id: str) -> None:
        self.started[action_id] = time.time()
        self.inner.action_started(action_id)

    def action_finished(self, result: ActionResult) -> None:
        self.inner.action_finished(self.settle(result))

    def message(self, text: str) -> None:
        self.inner.message(text)


class Session:
    """The state of one ``watch``: last good manifest, what is watched, file signatures."""

    def __init__(
        self,
        manifest_path: str,
        selectors: list[str] | tuple[str, ...],
        build_kw: dict[str, Any],
        reporter_factory: Callable[[], Reporter],
        on_start: Callable[[Cycle], None] | None = None,
    ) -> None:
        self.manifest_path = manifest_path
        self.selectors = selectors
        self.build_kw = build_kw
        self.reporter_factory = reporter_factory
        self.on_start = on_start or (lambda c: None)
        self.broken = False
        self.manifest = load_manifest(manifest_path)
        self.targets = make_targets(self.manifest, selectors)
        self.seen: dict[str, Sig | None] = {}
        self.number = 0
        self.warm: LocalExecutor | None = None
        """Outlives each build (which does not close an executor passed in): its spare worker,
        already past ``import onnxruntime``, takes the next save's compile at once."""

    def snapshot(self, paths: Iterable[str]) -> None:
        for p in paths:
            self.seen[p] = signature(p)

    def _reload(self) -> tuple[Manifest | None, str | None]:
        try:
            m = load_manifest(self.manifest_path)
            _selected(m, self.selectors)
        except EpbuildError as exc:
            return None, str(exc)
        return m, None

    def evaluate(self, paths: set[str], first_event: float | None) -> Cycle | None:
        """Decide what a settled burst means; build if needed. None: nothing changed."""
        t = self.targets
        watched = {p for p in paths if p in t.files or t.in_folder(p)}
        changed = {p for p in watched if signature(p) != self.seen.get(p, ())}
        candidates = {p for p in paths if p not in watched}
        gone = {p for p in changed if not os.path.exists(p)}
        if any(glob_match(t.rel(p), pat) for p in gone for pat in t.patterns):
            candidates |= gone  # a globbed model went away: it leaves its group
        candidates |= {p for p in gone if t.in_listed(p)}  # a listed sample left the listing
        manifest_changed = t.manifest in changed
        # The manifest reads each LLM source's genai_config.json: an edit is one of it.
        config_changed = any(
            t.in_folder(p) and os.path.basename(p) == GENAI_CONFIG for p in changed
        )
        new, error, reloaded = self._next_manifest(
            manifest_changed or config_changed, bool(candidates)
        )
        self.snapshot(changed)
        old_models = {m for g in self.manifest.groups.values() for m in g.models}
        new_models = {m for g in new.groups.values() for m in g.models}
        rel = {t.rel(p) for p in changed} | (old_models ^ new_models)
        rel |= _samples(self.manifest) ^ _samples(new)  # a sample joined or left a calibration
        if manifest_changed and not reloaded and error is None:
            rel.discard(t.rel(t.manifest))  # re-saved with the same meaning
        if not rel and error is None:
            return None
        cycle = Cycle(self.number + 1, sorted(rel), reloaded, error, first_event=first_event)
        self.number += 1
        self.on_start(cycle)
        # a reloaded manifest builds everything selected: the plan decides what is stale
        ids = None if reloaded and manifest_changed else self._affected(new, rel)
        self.manifest = new
        if ids is None or ids:
            self.run_build(cycle, ids)
        return cycle

    def _next_manifest(
        self, manifest_changed: bool, glob_candidates: bool
    ) -> tuple[Manifest, str | None, bool]:
        """The manifest to build with, the reload error to report, and whether it changed."""
        if not (manifest_changed or glob_candidates):
            return self.manifest, None, False
        loaded, error = self._reload()
        if loaded is not None:
            # fixed after an error: say so, and build with it even if it reads the same
            reloaded = loaded != self.manifest or (manifest_changed and self.broken)
            self.broken = False
            return loaded, None, reloaded
        if manifest_changed:
            self.broken = True
            return self.manifest, error, False
        return self.manifest, None, False  # a glob candidate while broken: reported already

    def _affected(self, new: Manifest, rel: set[str]) -> list[str]:
        """Selected actions of ``new`` that are new, changed models, or read a path in ``rel``
        (an LLM's actions: any file of its source folder; a quantized one's: its calibration
        samples, those ``new`` names included)."""
        old = {a.id: a for a in _selected(self.manifest, self.selectors)}
        folders = {self.targets.rel(f): name for f, name in self.targets.folders.items()}
        touched = {folders[posixpath.dirname(r)] for r in rel if posixpath.dirname(r) in folders}
        ids = []
        samples: dict[str, frozenset[str]] = {}
        for a in _selected(new, self.selectors):
            reads = self.targets.inputs.get(a.id, frozenset()) | set(a.models)
            reads |= samples_of(new, a.group, samples)
            llm = a.group.name in touched and a.group.name in new.llms
            if a.id not in old or old[a.id].entries != a.entries or rel & reads or llm:
                ids.append(a.id)
        return ids

    def run_build(self, cycle: Cycle, ids: list[str] | None) -> None:
        """Build the given actions (None: all selected) with the current manifest."""
        kw = dict(self.build_kw)
        if self.manifest.workspace.executor == "local":
            if self.warm is None:
                self.warm = LocalExecutor(str(self.manifest.root), prewarm=True)
            kw["executor"] = self.warm
        selected = list(self.selectors) if ids is None else ids
        settle = functools.partial(self._settled, cycle)
        reporter = CycleReporter(self.reporter_factory(), cycle.action_started, settle)
        cycle.started = time.time()
        try:
            result = build(
                self.manifest.root,
                None,
                selected,
                keep_going=True,
                loaded=self.manifest,
                reporter=reporter,
                **kw,
            )
            cycle.result = replace(result, actions=[settle(a) for a in result.actions])
        except Interrupted:
            raise
        except EpbuildError as exc:
            cycle.error = str(exc)
        cycle.finished = time.time()

    def _settled(self, cycle: Cycle, result: ActionResult) -> ActionResult:
        """``result``; for a failure of an action whose input changed since the cycle looked
        at it (the build read a file still being saved), a skip that says so, the input
        noted in ``cycle.again`` for the next cycle to build it again."""
        if result.outcome is not Outcome.FAILED:
            return result
        changed = self._changed_inputs(result)
        if not changed:
            return result
        for rel in changed:
            if rel not in cycle.again:
                cycle.again.append(rel)
        return replace(
            result,
            outcome=Outcome.SKIPPED,
            error=f"{changed[0]} changed while the build read it: built again once it is written",
            hint=None,
            log_tail=[],
        )

    def _changed_inputs(self, result: ActionResult) -> list[str]:
        """The action's watched inputs (workspace-relative) whose signature is not the one
        seen before the build: those of its group for an action watch does not key by its
        inputs (an LLM's preparation)."""
        t = self.targets
        reads = t.inputs.get(result.id)
        if reads is None:
            prefix = result.group + "/"
            reads = frozenset(p for a, s in t.inputs.items() if a.startswith(prefix) for p in s)
        changed = []
        for rel in sorted(reads):
            path = os.path.join(t.root, rel)
            if path in self.seen and signature(path) != self.seen[path]:
                changed.append(rel)
        return changed

    def retarget(self, since: float) -> list[str]:
        """Recompute the watched inputs; returns new ones written since ``since`` (they
        changed while we were not yet watching them)."""
        old = self.targets
        try:
            self.targets = make_targets(self.manifest, self.selectors, old)
        except EpbuildError:
            return []
        late: list[str] = []
        for p in sorted(self.targets.files - old.files):
            sig = signature(p)
            if sig is not None and sig[2] >= since * 1e9:
                self.seen.pop(p, None)
                late.append(p)
            else:
                self.seen[p] = sig
        return late


def _samples(m: Manifest) -> set[str]:
    """The calibration samples of every quantization of ``m`` (workspace-relative)."""
    return {s for recipe in m.quantization.values() for s in recipe.calibration}


def _selected(m: Manifest, selectors: list[str] | tuple[str, ...]) -> list[CompileAction]:
    """The selected actions of ``m``, its LLMs' included (their ids, read from nothing)."""
    return select(make_actions(m, llm_shapes(m)), selectors)
