"""The kinds of action: what each sort of work in the build graph supplies to the engine.

An action is a kind plus its inputs (source files, or the outputs of the actions it depends
on). A kind decides, through ``Kind``, one verb per question: the action's inputs and key
(``key``: a digest of a canonical description: kind, the kind's settings, its inputs'
digests and the tool versions it declares; it raises for what cannot be built), the job
that stages its outputs (``job``), and the check of what the job wrote and reported
(``check``); how its actions are spoken of is apart (``Wording``). The engine knows only
this interface: restore, commit, the cache, the journal, the farm and ``status`` work the
same for every kind. Every kind, built-in or not, is in one registry here, with what lists
its actions (``register``).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from epbuild._dataclass import dataclass, replace
from epbuild.executors.job import Job
from epbuild.fs import sha256_hex
from epbuild.planning.keys import ActionKey

if TYPE_CHECKING:
    from epbuild.manifest.model import Group, Manifest
    from epbuild.onnx.context import MachinePaths
    from epbuild.planning.keys import KeyComputer
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
    blob = json.dumps(components, sort_keys=True, separators=(",", ":")).encode()
    return ActionKey(sha256_hex(blob), dict(components), dict(inputs))


class ActionIdentity:
    """What every kind's action derives from its id alike (a base of the action types)."""

    id: str

    @property
    def slug(self) -> str:
        """A short, file-name-safe, stable token for locks and staging directories."""
        return sha256_hex(self.id.encode())[:16]


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


@dataclass(frozen=True)
class Wording:
    """How progress, results and ``status`` speak of a kind's actions; nothing the engine
    decides by."""

    past: str
    """What results and progress say of an action that ran (``compiled``, ``prepared``)."""
    doing: str = ""
    """What progress says of a running one (``calibrating``); empty: nothing."""
    waits: str = "{a.id} is stale: planned again once it has run"
    """What ``status`` says of an action that reads the outputs of a stale one of this
    kind: a ``str.format`` template of that stale action, ``a``."""

    def waits_note(self, action: GraphAction) -> str:
        """``waits`` of the stale ``action``."""
        return self.waits.format(a=action)


Reported = Mapping[str, Any] | None
"""What an action's job reported (the worker's result document); None: its outputs were
restored from the cache."""
Checked = tuple[list[str], list[str]]
"""What a kind's ``check`` returns: the output file names and the warnings."""


class Kind(Protocol):
    """One sort of action: what it decides (its inputs and key, its job, the check of what
    the job wrote), each by one verb, apart from how it is worded (``words``)."""

    name: str
    words: Wording
    follows: bool
    """A selection that takes every action it depends on takes it too (an LLM's package
    follows its graphs' compiles)."""
    inline: bool
    """Its jobs run in the building process, never in a worker
    (``executors.local.run_inline``)."""
    checks_input: bool
    """Its job's user errors are bad input: a build failed only by them exits 2."""

    def key(self, action: Any, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        """The action's inputs and key (``ActionKey``: key, components, inputs by digest).
        Raises ``ModelError`` (or ``ToolchainError``) for what cannot be built: a broken
        input, or an action that never can be (a context past protobuf's limit). ``fresh``:
        look at the inputs again instead of taking this run's memoised digests."""
        ...

    def job(
        self, action: Any, key: ActionKey, staging: str, ctx: RunContext
    ) -> tuple[Job, list[str]]:
        """The job that stages the action's outputs into ``staging``, and the warnings
        found making it (raises ``UserError`` for what cannot be built)."""
        ...

    def check(self, action: Any, staging: str, ctx: RunContext, result: Reported) -> Checked:
        """Judge what was staged and what its job reported (``result``, the worker's
        result document; None: restored from the cache): the output file names and the
        warnings; raises ``VerificationError`` for anything it must refuse."""
        ...


def stored_by_link(kind: Kind) -> bool:
    """Whether ``kind``'s state-directory outputs go into the cache by a hard link
    (``BaseKind.stored_by_link``; False for a kind that does not say)."""
    return bool(getattr(kind, "stored_by_link", False))


class BaseKind:
    """What kinds answer alike, for a kind to override where it differs (a kind need not
    derive from it: ``Kind`` is the interface): its job is its ``runner`` with its
    ``payload``, in a worker."""

    name: ClassVar[str]
    words: ClassVar[Wording]
    runner: ClassVar[str] = ""
    """``module:function`` a worker calls with a job (``Job``) and the workspace root."""
    format: ClassVar[int] = 1
    """Bump when the same inputs make other outputs (a key component)."""
    follows: ClassVar[bool] = False
    inline: ClassVar[bool] = False
    checks_input: ClassVar[bool] = False
    stored_by_link: ClassVar[bool] = False
    """Its outputs (in the state directory) become the cache's objects by a hard link, not
    a copy: what reads them maps or copies their weights or hands them to ONNX Runtime,
    never ONNX's Python loader, which refuses a data file with several hard links (a
    restored output is one all the same). Not part of ``Kind``: a kind without it is
    stored by copy (``stored_by_link``)."""

    def keyed(self, inputs: Mapping[str, str], **settings: Any) -> ActionKey:
        """The key of an action of this kind that reads ``inputs`` ({path: digest}) with
        ``settings`` (JSON values): the kind, its format, the inputs, the settings."""
        components = {"kind": self.name, "format": self.format, "inputs": dict(inputs)}
        return make_key({**components, **settings}, inputs)

    def job(
        self, action: Any, key: ActionKey, staging: str, ctx: RunContext
    ) -> tuple[Job, list[str]]:
        """Its ``runner`` with the action's ``payload``, in a worker (or inline)."""
        payload = self.payload(action, key, ctx)
        inputs = dict(key.inputs)
        return Job(action.id, self.runner, staging, payload, inputs, ctx.predicted_peak), []

    def payload(self, action: Any, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        """What its runner needs of one action (JSON values)."""
        raise NotImplementedError(f"kind {self.name} makes no jobs")


@dataclass(frozen=True)
class GraphRequest:
    """What the kinds make a workspace's actions from (``planning.graph.make_graph``)."""

    manifest: Manifest
    llm_groups: tuple[Group, ...] = ()
    """The compile groups of its LLM entries (``planning.llms``: with their prepared
    graphs, or only their shapes)."""
    numerics: bool = False
    """The command asks for the compiles' numerical checks."""
    made: tuple[GraphAction, ...] = ()
    """The actions the kinds registered before have made (an LLM's package, a numerical
    check reads the compiles among them)."""

    @property
    def quantized(self) -> bool:
        """A group of the manifest is quantized."""
        return any(g.quantize is not None for g in self.manifest.groups.values())

    @property
    def llms(self) -> bool:
        """The manifest has LLM entries."""
        return bool(self.manifest.llms)


ActionsOf = Callable[[GraphRequest], Sequence[GraphAction]]
"""What lists a kind's actions: the actions of that kind a request's manifest has."""


@dataclass
class Registration:
    """A kind in the registry, and where its actions come from. A built-in kind names its
    ``Kind`` and its ``ActionsOf`` by ``module:attribute``, imported on first use, and
    ``when``: the ``GraphRequest`` flag without which it has no action (so a workspace that
    has none never imports it)."""

    kind: Kind | str
    actions: ActionsOf | str | None = None
    """None: another kind's function lists its actions (calibrations come with their
    quantizations)."""
    when: str = ""
    """``quantized``, ``llms`` or ``numerics``; empty: every workspace."""


_REGISTRY: dict[str, Registration] = {
    "calibrate": Registration("epbuild.kinds.calibrate:CALIBRATE"),
    "quantize": Registration(
        "epbuild.kinds.quantize:QUANTIZE",
        "epbuild.planning.quantize:quantization_actions",
        when="quantized",
    ),
    "prepare": Registration(
        "epbuild.kinds.prepare:PREPARE", "epbuild.planning.llms:llm_preparations", when="llms"
    ),
    "compile": Registration(
        "epbuild.kinds.compile:COMPILE", "epbuild.kinds.compile:compile_actions"
    ),
    "package": Registration(
        "epbuild.kinds.package:PACKAGE", "epbuild.planning.llms:llm_packages", when="llms"
    ),
    "check": Registration(
        "epbuild.kinds.check:CHECK", "epbuild.kinds.check:check_actions", when="numerics"
    ),
    "llm-calibrate": Registration("epbuild.kinds.llmquant:LLM_CALIBRATE"),
    "llm-quantize": Registration(
        "epbuild.kinds.llmquant:LLM_QUANTIZE",
        "epbuild.planning.llms:llm_quantizations",
        when="llms",
    ),
}
"""The kinds, in the order their actions join a graph: the built-in ones, then those
added by ``register``."""


def _load(where: str) -> Any:
    """The object ``module:attribute`` names."""
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


def kind_of(action: GraphAction) -> Kind:
    """The ``Kind`` of an action."""
    return kind_named(action.kind)


def kind_named(name: str) -> Kind:
    """The registered kind ``name`` (a built-in kind is imported on first use)."""
    entry = _REGISTRY[name]
    if isinstance(entry.kind, str):
        entry.kind = _load(entry.kind)
    return cast("Kind", entry.kind)


def register(kind: Kind, actions: ActionsOf | None = None) -> None:
    """Add a kind; ``actions`` lists the actions of that kind a request's manifest has
    (they join every workspace's graph after the built-in kinds' actions)."""
    _REGISTRY[kind.name] = Registration(kind, actions)


def unregister(name: str) -> None:
    """Remove a kind added by ``register``."""
    _REGISTRY.pop(name, None)


def registered_actions(request: GraphRequest) -> list[GraphAction]:
    """The actions of every registered kind, in registry order; each kind's function sees
    those made before it (``GraphRequest.made``)."""
    made: list[GraphAction] = []
    for entry in _REGISTRY.values():
        if entry.actions is None or (entry.when and not getattr(request, entry.when)):
            continue
        if isinstance(entry.actions, str):
            entry.actions = cast("ActionsOf", _load(entry.actions))
        made += entry.actions(replace(request, made=tuple(made)))
    return made
