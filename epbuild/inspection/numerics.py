"""``verify --numerics``: does each ctx model compute what its source computes?

For each ctx model that can run on this host, a loader process (the one ``verify --load``
uses, in the action's toolchain, with ``session.disable_model_compile=1``) runs it and its
source model on the CPU EP on the same feeds — seeded random inputs, or the ``.npz`` samples
the manifest names — and reports per output ``max_abs``, ``max_rel`` (relative to the
output's largest reference magnitude), ``cosine`` and, for integer or logits-like outputs,
the share of positions whose ``argmax`` agrees. The tolerances of the group or model entry
(``numerics = { rtol, atol, min_cosine }``, else the EP's defaults) judge them.

A check is cached like a compile: its figures are recorded in the state directory against a
key of the action's record (source digests, options, toolchain versions), the ctx model's
outputs' digests, the sample files' digests and the input settings. Tolerances are not in
the key: changing one re-judges the recorded figures without running anything. Where a ctx
model cannot run here (a weight-sharing group on x86_64, a toolchain that is not usable, an
EP without its hardware) the status is ``not_checkable`` with the reason, never ``ok``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
from dataclasses import field
from typing import Any

from epbuild._dataclass import dataclass
from epbuild.errors import UserError
from epbuild.manifest.model import NumericsSettings
from epbuild.planning.actions import Action
from epbuild.planning.workspace import Workspace
from epbuild.results import CheckStatus

STORE_NAME = "numerics.json"
"""The recorded figures, in the state directory."""
_STORE_MAX = 2000
"""Entries kept (the newest): old keys are of inputs that no longer exist."""
_VERSION = 2


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


def _sample_files(root: str, patterns: tuple[str, ...]) -> list[str]:
    """The ``.npz`` files of the settings' paths and globs, workspace-relative, sorted."""
    found: list[str] = []
    for pattern in patterns:
        matches = sorted(
            os.path.relpath(p, root).replace(os.sep, "/")
            for p in glob.glob(os.path.join(root, pattern))
            if os.path.isfile(p)
        )
        if not matches:
            raise UserError(
                f"numerics inputs {pattern!r} match no file",
                hint="add the .npz samples, or fix the path (relative to the manifest)",
            )
        found += [m for m in matches if m not in found]
    return found


def check_key(
    ws: Workspace, action: Action, index: int, samples: list[str], settings: NumericsSettings
) -> str:
    """What a check's figures depend on: the action's committed record (its key covers the
    sources, options and toolchain versions) and output digests, which model, the samples'
    bytes and the input settings."""
    rec = ws.state.records[action.id]
    doc = {
        "version": _VERSION,
        "record": rec.key,
        "outputs": {p: o.digest for p, o in sorted(rec.outputs.items())},
        "model": action.ctx_paths[index],
        "samples": {s: ws.stats.digest(ws.root, s).digest for s in samples},
        "settings": {k: v for k, v in settings.to_json().items() if k in _INPUT_SETTINGS},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


_INPUT_SETTINGS = ("seed", "float_range", "int_range")


class Store:
    """The recorded figures: check key → the loader's result (outcome, message, outputs)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, STORE_NAME)
        self.entries: dict[str, dict[str, Any]] = {}
        self.new: dict[str, dict[str, Any]] = {}
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict) and data.get("version") == _VERSION:
                entries = data.get("entries")
                self.entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            pass  # a damaged record only costs running the checks again

    def get(self, key: str) -> dict[str, Any] | None:
        """The recorded result of a check, if any."""
        found = self.new.get(key) or self.entries.get(key)
        return found if isinstance(found, dict) else None

    def put(self, key: str, result: dict[str, Any]) -> None:
        """Record a result (written by ``save``)."""
        self.new[key] = result

    def save(self, ws: Workspace) -> None:
        """Merge the new results into the file, under the state lock."""
        from epbuild.fs import atomic_write_bytes
        from epbuild.state import locks

        if not self.new or not os.path.isdir(ws.state_dir):
            return
        with locks.hold(ws.state_lock, "epbuild verify --numerics (recording)"):
            current = Store(ws.state_dir).entries
            current.update(self.new)
            kept = dict(list(current.items())[-_STORE_MAX:])
            doc = {"version": _VERSION, "entries": kept}
            atomic_write_bytes(self.path, json.dumps(doc, allow_nan=True).encode())
        self.entries, self.new = kept, {}


def check_action(
    ws: Workspace, action: Action, toolchain: Any, store: Store
) -> list[NumericsCheck]:
    """The numerical checks of one committed action's ctx models (recorded figures where
    there are some for the same key, else a loader run)."""
    from epbuild.inspection.loading import load_check

    checks = []
    for index, ctx in enumerate(action.ctx_paths):
        if isinstance(toolchain, str):  # may be usable next time: nothing is recorded
            reason = f"its toolchain is not usable here: {toolchain}"
            checks.append(NumericsCheck(action.id, ctx, CheckStatus.NOT_CHECKABLE, reason))
            continue
        settings = action.entries[index].numerics
        try:
            samples, extra, tol = _inputs(ws, action, index)
        except UserError as exc:
            checks.append(NumericsCheck(action.id, ctx, CheckStatus.FAILED, exc.message))
            continue
        key = check_key(ws, action, index, samples, settings)
        recorded = store.get(key)
        if recorded is None:
            load = load_check(ws, action, index, toolchain, extra, standalone=True)
            recorded = {"outcome": load.outcome.value, "message": load.message,
                        "outputs": load.outputs, **load.more}  # fmt: skip
            # A model this host cannot run stays so for the same key (a loader that crashes
            # here, in 17 s for inception_v1): recorded too, so it is not run every time.
            store.put(key, recorded)
        checks.append(_judge(action.id, ctx, recorded, tol, cached=key in store.entries))
    return checks


def _inputs(
    ws: Workspace, action: Action, index: int
) -> tuple[list[str], dict[str, Any], Tolerance | QuantTolerance]:
    """What one check compares on: the files its key covers, the loader job's part beyond
    the models, and the tolerance. A quantized group's model is compared with its float
    source on the recipe's validation samples, the QDQ model beside it."""
    from epbuild.manifest.quantization import sample_files
    from epbuild.planning.quantize import QuantizedGroup

    group, entry = action.group, action.entries[index]
    if isinstance(group, QuantizedGroup) and group.quantize is not None:
        recipe = ws.manifest.quantization[group.quantize]
        source = group.sources[group.entries.index(entry)].path
        calibrated = group.calibrated[entry.name]
        files = [f for s in recipe.feeds for f in sample_files(ws.root, s)]
        quantized = {
            "qdq": action.models[index],
            "float": calibrated,
            "samples": list(recipe.feeds),
        }
        extra = {"source": source, "quantized": quantized}
        return (
            [*files, source, calibrated],
            extra,
            QuantTolerance(recipe.check.min_sqnr_db, recipe.check.top1),
        )
    samples = _sample_files(ws.root, entry.numerics.inputs)
    extra = {**entry.numerics.to_json(), "inputs": samples}
    return samples, extra, tolerance(action.provider.ep, entry.numerics)


def last_check(ws: Workspace, action: Action, index: int, store: Store) -> NumericsCheck | None:
    """The recorded check of one ctx model as the outputs and settings are now (for
    ``status --detail`` and packages); None when none was recorded. Runs nothing."""
    if action.id not in ws.state.records:
        return None
    settings = action.entries[index].numerics
    try:
        samples, _, tol = _inputs(ws, action, index)
    except (UserError, OSError):
        return None
    recorded = store.get(check_key(ws, action, index, samples, settings))
    if recorded is None:
        return None
    return _judge(action.id, action.ctx_paths[index], recorded, tol, cached=True)


def _judge(
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


def check_numerics(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
) -> list[NumericsCheck]:
    """The numerical checks of the selected committed actions (``build --numerics`` runs
    them for the actions it built); actions not committed are left out."""
    from epbuild.errors import ToolchainError
    from epbuild.planning.workspace import open_workspace

    ws = open_workspace(directory, manifest, selectors)
    store = Store(ws.state_dir)
    checks: list[NumericsCheck] = []
    for action in ws.actions:
        if action.id not in ws.state.records or action.id in ws.state.interrupted:
            continue
        try:
            toolchain: Any = ws.keys.toolchains.get(action.provider)
        except ToolchainError as exc:
            toolchain = exc.message
        checks += check_action(ws, action, toolchain, store)
    store.save(ws)
    return checks
