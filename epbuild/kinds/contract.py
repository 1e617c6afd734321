"""The kinds of action: what each sort of work in the build graph supplies to the engine.

An action is a kind plus its inputs (source files, or the outputs of the actions it depends
on). A kind supplies, through ``Kind``: the action's key (a digest of a canonical
description: kind, the kind's settings, its inputs' digests and the tool versions it
declares), the job a worker runs, the check of what the worker staged, and what the worker
reported against the rules. The engine knows only this interface: restore, commit, the
cache, the journal, the farm and ``status`` work the same for every kind. Adding a kind is
a module with a ``Kind`` and its actions, registered here (``register``).
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from epbuild._dataclass import dataclass

if TYPE_CHECKING:
    from epbuild.errors import UserError
    from epbuild.executors.job import AnyJob
    from epbuild.manifest.model import Manifest
    from epbuild.onnx.context import MachinePaths, Problem
    from epbuild.planning.keys import ActionKey, KeyComputer
    from epbuild.toolchains.spec import ToolchainSpec


class GraphAction(Protocol):
    """One action of the build graph, of any kind."""

    @property
    def id(self) -> str:
        """Unique in the graph; what selectors, the journal and the cache name it by."""
        ...

    @property
    def kind(self) -> str:
        """The name of its ``Kind``."""
        ...

    @property
    def deps(self) -> tuple[str, ...]:
        """Ids of the actions whose outputs it reads: it runs after them."""
        ...

    @property
    def out_dir(self) -> str:
        """Workspace-relative directory its outputs are committed to (three levels deep:
        ``<top>/<group>/<leaf>``; commits never reach above ``<top>``)."""
        ...

    @property
    def slug(self) -> str:
        """A short, file-name-safe, stable token for locks and staging directories."""
        ...

    @property
    def group_name(self) -> str:
        """The manifest entry it comes from (results and reports)."""
        ...

    @property
    def provider_name(self) -> str:
        """The provider it builds for (empty: none)."""
        ...

    @property
    def toolchain(self) -> ToolchainSpec | None:
        """The environment its worker runs in (None: epbuild's own)."""
        ...


def make_key(components: Mapping[str, Any], inputs: Mapping[str, str]) -> ActionKey:
    """The key of a kind's action: the digest of its components' canonical JSON."""
    import json

    from epbuild.planning.keys import ActionKey

    blob = json.dumps(components, sort_keys=True, separators=(",", ":")).encode()
    return ActionKey(hashlib.sha256(blob).hexdigest(), dict(components), dict(inputs))


class ActionIdentity:
    """What every kind's action derives from its id alike (a base of the action types)."""

    id: str

    @property
    def slug(self) -> str:
        """A short, file-name-safe, stable token for locks and staging directories."""
        return hashlib.sha256(self.id.encode()).hexdigest()[:16]


class OwnStep(ActionIdentity):
    """An action for no provider, run in epbuild's own environment (a preparation, a
    calibration): its kind is its class's ``KIND``; ``group_name`` is the subclass's."""

    KIND: ClassVar[str]

    @property
    def kind(self) -> str:
        return self.KIND

    @property
    def provider_name(self) -> str:
        return ""

    @property
    def toolchain(self) -> ToolchainSpec | None:
        return None


@dataclass(frozen=True)
class RunContext:
    """What the engine gives a kind to run and check one action."""

    root: str
    keys: KeyComputer
    machine: MachinePaths
    """The build machine's directories that no output may name (per build)."""
    predicted_peak: int
    """The action's predicted peak memory in bytes (0: unknown)."""


class Kind(Protocol):
    """One sort of action."""

    name: str
    past: str
    """What progress says of an action of this kind that ran (``compiled``)."""
    follows: bool
    """A selection that takes every action it depends on takes it too (an LLM's package
    follows its graphs' compiles)."""
    inline: bool
    """Its jobs run in the building process, never in a worker (``KindJob.inline``)."""

    def key(self, action: Any, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        """The action's key and its components; raises ``ModelError`` (or another
        ``UserError``) for a broken input. ``fresh``: look at the inputs again instead of
        taking this run's memoised digests."""
        ...

    def refuse(self, action: Any, key: ActionKey, keys: KeyComputer) -> UserError | None:
        """Why an action with this key cannot be built at all (None: it can)."""
        ...

    def job(
        self, action: Any, key: ActionKey, staging: str, ctx: RunContext
    ) -> tuple[AnyJob, list[str]]:
        """The job a worker runs to stage the action's outputs into ``staging``, and
        warnings found making it (raises ``UserError`` for what cannot be built)."""
        ...

    def check(self, action: Any, staging: str, ctx: RunContext) -> tuple[list[str], list[Problem]]:
        """Check what was staged (by a worker, or restored from the cache): the output file
        names and the warnings; raises ``VerificationError`` for an output it must refuse."""
        ...

    def problems(self, action: Any, result: Mapping[str, Any]) -> list[Problem]:
        """What the worker's result document reports, against the kind's rules."""
        ...

    def waits_note(self, action: Any) -> str:
        """What ``status`` says of an action that reads the outputs of this stale one."""
        ...


class BaseKind:
    """What kinds answer alike, for a kind to override where it differs (a kind need not
    derive from it: ``Kind`` is the interface). Its jobs run in a worker; it refuses no
    key and reports nothing against its rules."""

    name: ClassVar[str]
    past: ClassVar[str]
    runner: ClassVar[str] = ""
    """``module:function`` a worker calls with a job (``KindJob``) and the workspace root."""
    format: ClassVar[int] = 1
    """Bump when the same inputs make other outputs (a key component)."""
    doing: ClassVar[str] = ""
    """How progress names a running one (``calibrating``); empty: not said."""
    follows: ClassVar[bool] = False
    inline: ClassVar[bool] = False
    checks_input: ClassVar[bool] = False
    """Its job's user errors are bad input: a build failed only by them exits 2."""

    def keyed(self, inputs: Mapping[str, str], **settings: Any) -> ActionKey:
        """The key of an action of this kind that reads ``inputs`` ({path: digest}) with
        ``settings`` (JSON values): the kind, its format, the inputs, the settings."""
        components = {"kind": self.name, "format": self.format, "inputs": dict(inputs)}
        return make_key({**components, **settings}, inputs)

    def refuse(self, action: Any, key: ActionKey, keys: KeyComputer) -> UserError | None:
        return None

    def problems(self, action: Any, result: Mapping[str, Any]) -> list[Problem]:
        return []

    def waits_note(self, action: Any) -> str:
        return f"{action.id} is stale: planned again once it has run"

    def job(
        self, action: Any, key: ActionKey, staging: str, ctx: RunContext
    ) -> tuple[AnyJob, list[str]]:
        """Its ``runner`` with the action's ``payload``, in a worker (or inline)."""
        from epbuild.executors.job import KindJob

        payload = self.payload(action, key, ctx)
        return KindJob(action.id, self.name, self.runner, staging, payload, dict(key.inputs),
                       predicted_peak=ctx.predicted_peak, inline=self.inline), []  # fmt: skip

    def payload(self, action: Any, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        """What its runner needs of one action (JSON values)."""
        raise NotImplementedError(f"kind {self.name} makes no jobs")


_BUILT_IN = {
    "compile": "epbuild.kinds.compile:COMPILE",
    "prepare": "epbuild.kinds.prepare:PREPARE",
    "package": "epbuild.kinds.package:PACKAGE",
    "calibrate": "epbuild.kinds.calibrate:CALIBRATE",
    "quantize": "epbuild.kinds.quantize:QUANTIZE",
    "check": "epbuild.kinds.check:CHECK",
    "llm-calibrate": "epbuild.kinds.llmquant:LLM_CALIBRATE",
    "llm-quantize": "epbuild.kinds.llmquant:LLM_QUANTIZE",
}
_KINDS: dict[str, Kind] = {}
_SOURCES: dict[str, Callable[[Manifest], list[GraphAction]]] = {}


def kind_of(action: GraphAction) -> Kind:
    """The ``Kind`` of an action."""
    return kind_named(action.kind)


def kind_named(name: str) -> Kind:
    """The registered kind ``name`` (built-in kinds are imported on first use)."""
    if name not in _KINDS:
        module, _, attr = _BUILT_IN[name].partition(":")
        _KINDS[name] = getattr(importlib.import_module(module), attr)
    return _KINDS[name]


def register(kind: Kind, actions: Callable[[Manifest], list[GraphAction]] | None = None) -> None:
    """Add a kind; ``actions`` gives the actions of that kind a manifest has (they join
    every workspace's graph after the built-in kinds' actions)."""
    _KINDS[kind.name] = kind
    if actions is not None:
        _SOURCES[kind.name] = actions


def unregister(name: str) -> None:
    """Remove a kind added by ``register``."""
    _KINDS.pop(name, None)
    _SOURCES.pop(name, None)


def registered_actions(manifest: Manifest) -> list[GraphAction]:
    """The actions of the kinds added by ``register``."""
    return [a for source in _SOURCES.values() for a in source(manifest)]
