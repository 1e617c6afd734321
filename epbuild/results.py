"""What the API reports: outcomes, build and status results, progress events."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from epbuild.kinds.contract import kind_named

if not TYPE_CHECKING:
    from epbuild._dataclass import dataclass, field, fields
else:  # what type checkers and the API reference (which labels a dataclass by it) read
    from dataclasses import dataclass, field, fields

if TYPE_CHECKING:
    from epbuild.kinds.contract import GraphAction
    from epbuild.planning.staleness import ActionPlan


class Outcome(enum.Enum):
    """How an action ended in a build (or would, in a dry run)."""

    RAN = "compiled"
    """Its job ran and its outputs were committed. Results and progress say so in its kind's
    words (``compiled``, ``prepared``: ``BuildResult.summary``); ``--json`` writes
    ``compiled``, as it always has."""
    COMPILED = RAN
    """``RAN``, by the name the API gave it before there were other kinds (an alias)."""
    RESTORED = "restored"
    UP_TO_DATE = "up_to_date"
    FAILED = "failed"
    SKIPPED = "skipped"
    WOULD_BUILD = "would_build"


class CheckStatus(enum.Enum):
    """How one of ``verify``'s checks of built outputs ended (``--numerics``, ``--generate``)."""

    OK = "ok"
    FAILED = "failed"
    NOT_CHECKABLE = "not_checkable"
    """It cannot run on this machine; the reason says why. Never reported as ``ok``."""


@dataclass
class ActionResult:
    """One action's result."""

    id: str
    group: str
    provider: str
    outcome: Outcome
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    error: str | None = None
    hint: str | None = None
    log_tail: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    exit_code: int = 1
    """The exit code a failure of this action maps to (3: a lock wait timed out)."""
    kind: str = "compile"
    """What sort of work the action is (``epbuild.kinds``)."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form."""
        data: dict[str, Any] = {
            "id": self.id,
            "kind": self.kind,
            "group": self.group,
            "provider": self.provider,
            "outcome": self.outcome.value,
            "seconds": round(self.seconds, 3),
            "outputs": self.outputs,
            "reasons": self.reasons,
        }
        if self.error:
            data["error"] = self.error
            if self.hint:
                data["hint"] = self.hint
            if self.log_tail:
                data["log_tail"] = self.log_tail
        if self.warnings:
            data["warnings"] = self.warnings
        return data


@dataclass
class BuildResult:
    """What a build did."""

    actions: list[ActionResult]
    seconds: float
    warnings: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        """How many actions ended with ``outcome``."""
        return sum(1 for a in self.actions if a.outcome is outcome)

    @property
    def ok(self) -> bool:
        """No action failed."""
        return self.count(Outcome.FAILED) == 0

    @property
    def exit_code(self) -> int:
        """0 on success, 3 if a lock wait timed out, 2 if every failure is bad input of a
        kind that checks its input (``Kind.checks_input``: a calibration sample), else 1."""
        failed = [a for a in self.actions if a.outcome is Outcome.FAILED]
        codes = {a.exit_code for a in failed}
        if not codes or 3 in codes:
            return 0 if not codes else 3
        if codes == {2} and all(kind_named(a.kind).checks_input for a in failed):
            return 2
        return 1

    def summary(self) -> dict[str, Any]:
        """Counts per outcome plus the wall time; the actions that ran count under their
        kinds' words (``compiled``, always present, then ``prepared``, ...)."""
        data: dict[str, Any] = {}
        for o in Outcome:
            data[o.value] = 0 if o is Outcome.RAN else self.count(o)
            if o is Outcome.RAN:
                ran = sorted(a.kind for a in self.actions if a.outcome is o)
                for kind in dict.fromkeys(ran):
                    data[kind_named(kind).words.past] = ran.count(kind)
        data["total"] = len(self.actions)
        data["seconds"] = round(self.seconds, 3)
        return data

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "summary": self.summary(),
            "actions": [a.to_json() for a in self.actions],
            "warnings": self.warnings,
        }


@dataclass(frozen=True)
class ActionStatus:
    """One action as ``status`` sees it: up to date or stale, and why."""

    id: str
    group: str
    provider: str
    stale: bool
    reasons: list[str]
    """Why it is stale; a stale action's last reason says what the cache could restore."""
    key: str | None
    """Its action key; None when an input is broken."""
    kind: str = "compile"
    """What sort of work the action is (``epbuild.kinds``)."""
    deps: tuple[str, ...] = ()
    """Ids of the actions whose outputs it reads."""

    @classmethod
    def from_plan(cls, plan: ActionPlan) -> ActionStatus:
        """The status of a planned action."""
        a = plan.action
        key = plan.key.key if plan.key else None
        return cls(
            a.id, a.group_name, a.provider_name, plan.stale, list(plan.reasons), key, a.kind, a.deps
        )

    def to_json(self) -> dict[str, Any]:
        """One entry of ``status --json``: every field, ``deps`` as a list."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"deps": list(self.deps)}


@dataclass(frozen=True)
class StatusResult:
    """What ``status`` found: the selected actions, and recorded ones the manifest dropped."""

    actions: list[ActionStatus]
    orphaned: list[str] = field(default_factory=list)
    """Ids of built actions no longer in the manifest (only listed without selectors)."""
    lock: list[str] = field(default_factory=list)
    """Why ``epbuild.lock`` is out of date with the manifest (empty: current, or none)."""
    orphaned_bytes: int = 0
    """Bytes of the orphaned actions' outputs that no action of the manifest owns (what
    ``clean --orphaned`` removes)."""

    def to_json(self) -> dict[str, Any]:
        """The ``status --json`` document."""
        return {
            "actions": [a.to_json() for a in self.actions],
            "orphaned": self.orphaned,
            "orphaned_bytes": self.orphaned_bytes,
            "lock": self.lock,
        }


class Reporter:
    """Receives progress events; the CLI renders them. The default ignores them."""

    def start(self, total: int, stale: int) -> None:
        """The build is about to run ``stale`` of ``total`` actions."""

    def action_started(self, action_id: str) -> None:
        """An action began compiling."""

    def action_finished(self, result: ActionResult) -> None:
        """An action ended."""

    def action_progress(self, action_id: str, text: str) -> None:
        """A running action said how far it is (``calibrating vision/cnn: 37/128 samples``:
        ``text`` is the whole sentence)."""

    def message(self, text: str) -> None:
        """A one-off note (waiting on a lock, a warning)."""


def action_result(action: GraphAction, outcome: Outcome, **kw: Any) -> ActionResult:
    """A result for ``action`` with its group and provider filled in."""
    kw.setdefault("kind", action.kind)
    return ActionResult(action.id, action.group_name, action.provider_name, outcome, **kw)
