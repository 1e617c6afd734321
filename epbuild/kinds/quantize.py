"""The quantize kind: one calibrated model of a quantized group made a QDQ model in a
worker (``<out_dir>/<group>/quantized/<name>.onnx``, an output the user can open), which
every provider of the group compiles.

It depends on the model's calibration; its key holds the calibration's outputs' digests
(the preprocessed model and the ranges), the types, per-channel, exclusions and overrides,
the providers' kind of quantization and the tool versions. Changing ``exclude``,
``overrides``, ``activations`` or ``weights`` re-quantizes without calibrating; a QDQ model
that comes out byte-identical leaves the compiles up to date (early cutoff)."""

from __future__ import annotations

import os
import posixpath
from typing import Any

from epbuild._dataclass import dataclass
from epbuild.errors import VerificationError
from epbuild.fs import is_safe_reference
from epbuild.kinds.calibrate import CalibrateAction, QuantStep
from epbuild.kinds.contract import BaseKind, Checked, Reported, RunContext, Wording
from epbuild.manifest.model import Group, ModelEntry, Quantization
from epbuild.onnx.proto import ProtoError, read_model
from epbuild.onnx.staged import staged_names
from epbuild.planning.keys import ActionKey, KeyComputer

QUANTIZE_FORMAT = 1
"""Bump when the same inputs make another QDQ model."""


@dataclass(frozen=True)
class QuantizeAction(QuantStep):
    """One float model's quantization."""

    KIND = "quantize"
    calibration: CalibrateAction
    """The calibration whose outputs it reads. Its ``out_dir``: ``<out_dir>/<group>/quantized``."""

    @property
    def deps(self) -> tuple[str, ...]:
        return (self.calibration.id,)

    @property
    def output(self) -> str:
        """Workspace-relative path of the QDQ model."""
        return posixpath.join(self.out_dir, f"{self.entry.name}.onnx")


class QuantizeKind(BaseKind):
    """``Kind`` of the quantizations (``QuantizeAction``); its job's user errors (a name
    the model lacks) are bad input."""

    name = "quantize"
    runner = "epbuild.quant.work:quantize"
    format = QUANTIZE_FORMAT
    words = Wording(
        "quantized",
        waits="{a.output} is not quantized yet for its current inputs ({a.id} runs first)",
    )
    checks_input = True

    def key(self, action: QuantizeAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        from epbuild.providers.distributions import dist_version

        calibration = action.calibration
        inputs = keys.model_digests(calibration.model, fresh=fresh)
        inputs[calibration.ranges] = keys.input_digest(
            calibration.ranges, "calibration ranges", f"run 'epbuild build {calibration.id}'"
        )
        return self.keyed(
            inputs,
            **_settings(action),
            versions={d: dist_version(d) for d in ("onnxruntime", "onnx")},
        )

    def payload(self, action: QuantizeAction, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        return {
            "calibrated": action.calibration.model,
            "source": action.entry.path,
            "label": action.label,
            **_settings(action),
        }

    def check(
        self, action: QuantizeAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """The QDQ model (and its external data), readable, nothing else."""
        return check_qdq(ctx.root, staging, posixpath.basename(action.output), "QDQ model"), []


def check_qdq(root: str, staging: str, name: str, what: str) -> list[str]:
    """The staged file names, after refusing (``VerificationError``) a staging that lacks the
    QDQ graph ``name`` (``what`` it is), holds it unreadable or with external data that was not
    staged beside it, or holds anything else."""
    names = staged_names(root, staging)
    if name not in names:
        raise VerificationError(f"expected output {name} was not written")
    try:
        info = read_model(os.path.join(root, staging, name))
    except ProtoError as exc:
        raise VerificationError(f"{name}: unreadable {what} ({exc})") from exc
    data = {ref.location for ref in info.external_refs}
    for location in data:
        if not is_safe_reference(location) or location not in names:
            raise VerificationError(f"{name}: external data {location!r} was not written")
    extra = sorted(set(names) - {name} - data)
    if extra:
        raise VerificationError(f"unexpected output {extra[0]} staged by the quantization")
    return names


def _settings(action: QuantizeAction) -> dict[str, Any]:
    """What makes the QDQ model besides its inputs: in its key, and given to its job."""
    return {
        "flavour": action.flavour,
        **recipe_settings(action.recipe),
        "output": posixpath.basename(action.output),
    }


def recipe_settings(recipe: Quantization) -> dict[str, Any]:
    """What a ``[quantization]`` table sets of how a QDQ graph is made (JSON values: in the
    keys of the quantize actions, a group's and an LLM's, and given to their jobs)."""
    return {
        "method": recipe.method,
        "activations": recipe.activations,
        "weights": recipe.weights,
        "per_channel": recipe.per_channel,
        "exclude": sorted(recipe.exclude),
        "overrides": dict(sorted(recipe.overrides.items())),
    }


QUANTIZE = QuantizeKind()


def quant_actions(
    group: Group, recipe: Quantization, flavour: str, out_dir: str, state_dir: str
) -> list[CalibrateAction | QuantizeAction]:
    """A quantized group's calibrate and quantize actions, one pair per model."""
    actions: list[CalibrateAction | QuantizeAction] = []
    for entry in group.entries:
        calibrate = CalibrateAction(
            f"{group.name}/{entry.name}/calibrate",
            group,
            entry,
            recipe,
            flavour,
            posixpath.join(state_dir, "quant", group.name, entry.name),
        )
        quantize = QuantizeAction(
            f"{group.name}/{entry.name}/quantize",
            group,
            entry,
            recipe,
            flavour,
            posixpath.join(out_dir, group.name, "quantized"),
            calibrate,
        )
        actions += [calibrate, quantize]
    return actions


def quantized_entry(action: QuantizeAction) -> ModelEntry:
    """The entry a compile of the group takes instead of the float one: the QDQ model,
    under the float model's name."""
    from dataclasses import replace

    return replace(action.entry, path=action.output)
