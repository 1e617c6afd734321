"""``verify --numerics``: does each ctx model compute what its source computes?

For each ctx model that can run on this host, a loader process (the one ``verify --load``
uses, in the action's toolchain, with ``session.disable_model_compile=1``) runs it and its
source model on the CPU EP on the same feeds — seeded random inputs, or the ``.npz`` samples
the manifest names — and reports per output ``max_abs``, ``max_rel`` (relative to the
output's largest reference magnitude), ``cosine`` and, for integer or logits-like outputs,
the share of positions whose ``argmax`` agrees. The tolerances of the group or model entry
(``numerics = { rtol, atol, min_cosine }``, else the EP's defaults) judge them.

A check is an action of the graph (``kinds.check``): its figures are recorded, journaled and
cached against a key of the ctx model's outputs' digests, the sources', the sample files',
the input settings, the toolchain's versions and the host. Tolerances are not in the key:
changing one re-judges the recorded figures without running anything. Where a ctx model
cannot run here (a weight-sharing group on x86_64, a toolchain that is not usable, an EP
without its hardware) the status is ``not_checkable`` with the reason, never ``ok``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from epbuild._dataclass import dataclass, field
from epbuild.api import run_plans
from epbuild.errors import ModelError, ToolchainError, UserError
from epbuild.kinds.check import CHECK, CheckAction, check_action
from epbuild.manifest.model import NumericsSettings
from epbuild.planning.actions import CompileAction
from epbuild.planning.quantize import QuantizedGroup
from epbuild.planning.staleness import make_plan, outputs_intact
from epbuild.planning.workspace import Workspace, open_workspace
from epbuild.results import BuildResult, CheckStatus, Outcome


@dataclass(frozen=True)
class Tolerance:
    """What an output may differ by: within ``atol`` absolutely or ``rtol`` relatively, and
    a cosine similarity of at least ``min_cosine``."""

    rtol: float
    atol: float
    min_cosine: float

    def problem(self, figures: dict[str, Any]) -> str | None:
        """Why an output's figures fail, or None."""
        max_abs, max_rel, cosine = figures["max_abs"], figures["max_rel"], figures["cosine"]
        if not math.isfinite(max_abs):
            return "values are not finite where the source's are (an fp16 overflow?)"
        if max_abs > self.atol and max_rel > self.rtol:
            return (
                f"max_abs {max_abs:.3g} (allowed {self.atol:g}) and max_rel {max_rel:.3g} "
                f"(allowed {self.rtol:g})"
            )
        if cosine < self.min_cosine:
            return f"cosine {cosine:.6f} (allowed ≥ {self.min_cosine:g})"
        return None


DEFAULT_TOLERANCE = Tolerance(rtol=1e-3, atol=1e-5, min_cosine=0.9999)
"""For an EP that computes in fp32."""
EP_TOLERANCES = {"qnn": Tolerance(rtol=2e-2, atol=1e-3, min_cosine=0.999)}
"""Per adapter: HTP compiles fp32 graphs to fp16 (about 1e-3 relative error measured on the
corpus and model-zoo models; see docs/research/numerics.md)."""


@dataclass(frozen=True)
class QuantTolerance:
    """What a quantized model's output may lose against the float source: at least
    ``min_sqnr_db`` of SQNR over the validation set and (outputs shaped [batch, classes])
    ``top1`` agreement (``[quantization.<name>.check]``)."""

    min_sqnr_db: float
    top1: float | None

    def problem(self, figures: dict[str, Any]) -> str | None:
        """Why an output's figures fail, or None; says what the QDQ model on the CPU
        reached, which tells quantization error from the EP's."""
        sqnr, top1 = figures.get("sqnr_db"), figures.get("top1")
        cpu = figures.get("qdq_sqnr_db")
        found = []
        if sqnr is None or not sqnr >= self.min_sqnr_db:
            found.append(
                f"SQNR {_db(sqnr)} against the float source (allowed ≥ {self.min_sqnr_db:g} dB)"
            )
        if self.top1 is not None and top1 is not None and top1 < self.top1:
            found.append(f"top-1 agreement {top1:.1%} (allowed ≥ {self.top1:.1%})")
        if not found:
            return None
        if cpu is not None:
            who = "the quantization" if cpu < self.min_sqnr_db else "the EP"
            found.append(f"the QDQ model on the CPU: {_db(cpu)}, so it is {who}")
        return "; ".join(found)


def _db(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} dB"


def tolerance(ep: str, settings: NumericsSettings) -> Tolerance:
    """The tolerance of one model: the manifest's values over the EP's defaults."""
    base = EP_TOLERANCES.get(ep, DEFAULT_TOLERANCE)
    return Tolerance(
        base.rtol if settings.rtol is None else settings.rtol,
        base.atol if settings.atol is None else settings.atol,
        base.min_cosine if settings.min_cosine is None else settings.min_cosine,
    )


@dataclass
class NumericsCheck:
    """The numerical check of one ctx model."""

    action: str
    model: str
    """The ctx model, workspace-relative."""
    status: CheckStatus
    reason: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    """Per output: ``name``, ``max_abs``, ``max_rel``, ``cosine``, ``argmax`` (None where it
    does not apply), and ``problem`` where it exceeds the tolerance."""
    tolerance: Tolerance | QuantTolerance | None = None
    cached: bool = False
    """The figures were recorded by an earlier check (nothing ran)."""
    layers: list[list[Any]] = field(default_factory=list)
    """A quantized model's worst activations against the float model's: [tensor, SQNR dB]."""

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form (non-finite figures as null)."""
        return {
            "action": self.action,
            "model": self.model,
            "status": self.status.value,
            "reason": self.reason,
            "outputs": [{k: _finite(v) for k, v in o.items()} for o in self.outputs],
            "tolerance": None if self.tolerance is None else vars(self.tolerance),
            "cached": self.cached,
            **({"layers": [[t, _finite(db)] for t, db in self.layers]} if self.layers else {}),
        }

    def line(self) -> str:
        """One line for the terminal."""
        if self.status is CheckStatus.NOT_CHECKABLE:
            return f"{self.model}: numerics: not checkable here: {self.reason}"
        if self.status is CheckStatus.FAILED:
            return f"{self.model}: numerics: {self.reason}"
        worst = max(self.outputs, key=lambda o: o["max_rel"], default=None)
        if worst is None:
            return f"{self.model}: numerics: ok (no outputs)"
        note = f"; {self.reason}" if self.reason else ""
        if isinstance(self.tolerance, QuantTolerance):
            return f"{self.model}: numerics: ok ({_quant_line(self.outputs)}{note})"
        return (
            f"{self.model}: numerics: ok (worst output {worst['name']}: max_abs "
            f"{worst['max_abs']:.3g}, max_rel {worst['max_rel']:.3g}, cosine "
            f"{worst['cosine']:.6f}{note})"
        )


def _quant_line(outputs: list[dict[str, Any]]) -> str:
    """Each output's SQNR (and top-1) against the float source, and the QDQ model's."""
    parts = []
    for o in outputs:
        top1 = f", top-1 {o['top1']:.1%}" if o.get("top1") is not None else ""
        parts.append(
            f"output {o['name']}: SQNR {_db(o.get('sqnr_db'))} against the float source"
            f"{top1}; the QDQ model on the CPU {_db(o.get('qdq_sqnr_db'))}"
        )
    return "; ".join(parts)


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def tolerance_of(action: CompileAction, index: int) -> Tolerance | QuantTolerance:
    """What the ``index``-th ctx model's figures are judged by."""
    group, entry = action.group, action.entries[index]
    if isinstance(group, QuantizedGroup) and group.recipe is not None:
        check = group.recipe.check
        return QuantTolerance(check.min_sqnr_db, check.top1)
    return tolerance(action.provider.ep, entry.numerics)


def judged(
    ws: Workspace, check: CheckAction, *, cached: bool, failure: str | None = None
) -> list[NumericsCheck]:
    """The verdicts of a check action's recorded figures (``failure``: why the action
    failed, so that every model of it failed with that reason)."""
    action = check.compile
    out = []
    for index, ctx in enumerate(action.ctx_paths):
        if failure is not None:
            out.append(NumericsCheck(action.id, ctx, CheckStatus.FAILED, failure))
            continue
        path = os.path.join(ws.root, check.figures_path(index))
        try:
            with open(path, encoding="utf-8") as f:
                recorded = json.load(f)
        except (OSError, ValueError) as exc:
            why = f"the recorded figures cannot be read ({exc}); run it again"
            out.append(NumericsCheck(action.id, ctx, CheckStatus.FAILED, why))
            continue
        out.append(
            judge_figures(action.id, ctx, recorded, tolerance_of(action, index), cached=cached)
        )
    return out


def last_checks(ws: Workspace, action: CompileAction) -> list[NumericsCheck] | None:
    """The recorded checks of a committed action's ctx models, as its outputs and settings
    are now (for ``status --detail`` and packages); None when none is recorded or the
    record is of other inputs. Runs nothing."""
    if action.id not in ws.state.records:
        return None
    check = check_action(action, ws.manifest.workspace.state_dir)
    committed = ws.state.records.committed(check.id)
    if committed is None or check.id in ws.state.damaged or check.id in ws.state.interrupted:
        return None
    try:
        key = CHECK.key(check, ws.keys, fresh=False)
        if key.key != committed[0] or outputs_intact(ws.root, ws.stats, committed[1]):
            return None
    except (UserError, OSError):
        return None
    return judged(ws, check, cached=True)


def judge_figures(
    action: str,
    ctx: str,
    recorded: dict[str, Any],
    tol: Tolerance | QuantTolerance,
    *,
    cached: bool,
) -> NumericsCheck:
    outputs = recorded.get("outputs")
    if recorded.get("outcome") == "not_loadable_here":
        reason = recorded["message"]
        return NumericsCheck(action, ctx, CheckStatus.NOT_CHECKABLE, reason, cached=cached)
    if not outputs:  # the loader failed before comparing anything
        reason = recorded.get("message") or "the check produced no figures"
        return NumericsCheck(action, ctx, CheckStatus.FAILED, reason, cached=cached)
    judged, problems = [], []
    cpu = {o["name"]: o for o in recorded.get("qdq") or []}  # a quantized model's QDQ model
    for figures in outputs:
        if figures["name"] in cpu:
            qdq = cpu[figures["name"]]
            figures = {**figures, "qdq_sqnr_db": qdq.get("sqnr_db"), "qdq_top1": qdq.get("top1")}
        problem = tol.problem(figures)
        judged.append({**figures, **({"problem": problem} if problem else {})})
        if problem:
            problems.append(f"output {figures['name']}: {problem}")
    status = CheckStatus.FAILED if problems else CheckStatus.OK
    # A passing loader's message says how the model ran (e.g. without the EP, whose package
    # cannot load it here): kept with the verdict either way.
    note = recorded.get("message", "") if recorded.get("outcome") == "passed" else ""
    layers = recorded.get("layers") or []
    if problems and layers:
        worst = ", ".join(f"{t} ({_db(db)})" for t, db in layers[:5])
        problems.append(
            f"the layers with the worst SQNR: {worst} — give those tensors another type in "
            "overrides or their nodes to exclude, or calibrate on samples like the real inputs"
        )
    reason = "; ".join(problems + ([note] if note else []))
    return NumericsCheck(action, ctx, status, reason, judged, tol, cached, layers)


def build_verdicts(
    directory: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | None,
    result: BuildResult,
) -> list[NumericsCheck]:
    """The verdicts of the numerical checks a ``build(numerics=True)`` ran or restored (up
    to date ones were judged when they ran)."""
    done = (Outcome.RAN, Outcome.RESTORED, Outcome.FAILED)
    ran = {r.id: r for r in result.actions if r.kind == CHECK.name and r.outcome in done}
    if not ran:
        return []
    ws = open_workspace(directory, manifest, sorted(ran), numerics=True)
    out: list[NumericsCheck] = []
    for check in ws.graph:
        r = ran.get(check.id)
        if isinstance(check, CheckAction) and r is not None:
            failure = (r.error or "the check failed") if r.outcome is Outcome.FAILED else None
            out += judged(ws, check, cached=r.outcome is Outcome.RESTORED, failure=failure)
    return out


def run_checks(ws: Workspace, actions: list[CompileAction]) -> list[NumericsCheck]:
    """Check ``actions`` (committed): the check actions that are stale run (a loader per
    ctx model), the others' recorded figures are judged again. An action whose toolchain
    is not usable here is not checkable (nothing is recorded: it may be next time)."""
    out: list[NumericsCheck] = []
    checks = []
    for action in actions:
        try:
            ws.keys.toolchains.get(action.provider)
        except ToolchainError as exc:
            reason = f"its toolchain is not usable here: {exc.message}"
            out += [
                NumericsCheck(action.id, ctx, CheckStatus.NOT_CHECKABLE, reason)
                for ctx in action.ctx_paths
            ]
            continue
        checks.append(check_action(action, ws.manifest.workspace.state_dir))
    plans = make_plan(checks, ws.state, ws.keys, ws.stats, ws.root)
    ran = {}
    stale = [p for p in plans if p.stale and p.error is None]
    if stale:
        ran = {r.id: r for r in run_plans(ws, stale)}
        ws.reload_state()
        bad = next(
            (r for r in ran.values() if r.outcome is Outcome.FAILED and r.exit_code == 2), None
        )
        if bad is not None:  # a validation sample the user must fix (kinds.check)
            raise ModelError(bad.error or "a validation sample cannot be used", hint=bad.hint)
    for plan in plans:
        check = plan.action
        assert isinstance(check, CheckAction)
        result = ran.get(check.id)
        failure = plan.error.message if plan.error is not None else None
        if result is not None and result.outcome in (Outcome.FAILED, Outcome.SKIPPED):
            failure = result.error or "; ".join(result.reasons) or "the check did not run"
        cached = result is None or result.outcome is not Outcome.RAN  # ran elsewhere
        out += judged(ws, check, cached=cached, failure=failure)
    return out
