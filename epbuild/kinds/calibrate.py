"""The calibrate kind: one float model of a quantized group, preprocessed for its providers
and run on the calibration samples in a worker, into the tensor ranges its quantization
reads (``<state_dir>/quant/<group>/<model>/``: ``model.onnx`` and ``ranges.json``).

Its key holds the source model's digests (and its external data's), each sample file's
digest in order, the calibration method, the kind of preprocessing (the providers') and
the onnxruntime and onnx versions: an edit of types, exclusions or overrides keys nothing
here, so it re-quantizes without calibrating (``kinds.quantize``)."""

from __future__ import annotations

import json
import os
import posixpath
from typing import Any

from epbuild._dataclass import dataclass
from epbuild.errors import VerificationError
from epbuild.kinds.contract import BaseKind, Checked, OwnStep, Reported, RunContext, Wording
from epbuild.manifest.model import Group, ModelEntry, Quantization
from epbuild.planning.keys import ActionKey, KeyComputer

CALIBRATE_FORMAT = 3
"""Bump when the same inputs make other ranges or another preprocessed model."""


@dataclass(frozen=True)
class QuantStep(OwnStep):
    """What the actions a quantized group adds before its compiles have alike: one float
    model of the group, the group's recipe, epbuild's own environment."""

    id: str
    group: Group
    entry: ModelEntry
    recipe: Quantization
    flavour: str
    """The providers' kind of quantization (``BaseProvider.quantization``)."""
    out_dir: str

    @property
    def group_name(self) -> str:
        return self.group.name

    @property
    def label(self) -> str:
        """How messages name it: the source and the recipe."""
        return f"{self.entry.path} (quantization.{self.recipe.name})"


@dataclass(frozen=True)
class CalibrateAction(QuantStep):
    """One float model's calibration."""

    KIND = "calibrate"
    deps: tuple[str, ...] = ()
    """None: it reads source files. Its ``out_dir``: ``<state_dir>/quant/<group>/<model>``."""

    @property
    def model(self) -> str:
        """Workspace-relative path of the preprocessed float model it writes."""
        from epbuild.quant.work import MODEL

        return posixpath.join(self.out_dir, MODEL)

    @property
    def ranges(self) -> str:
        """Workspace-relative path of the ranges it writes."""
        from epbuild.quant.work import RANGES

        return posixpath.join(self.out_dir, RANGES)


class CalibrateKind(BaseKind):
    """``Kind`` of the calibrations (``CalibrateAction``); its job's user errors (a bad
    sample, a name the model lacks) are bad input."""

    name = "calibrate"
    runner = "epbuild.quant.work:calibrate"
    format = CALIBRATE_FORMAT
    words = Wording(
        "calibrated",
        "calibrating",
        "{a.entry.path} is not calibrated yet for its current inputs ({a.id} runs first)",
    )
    checks_input = True

    def key(self, action: CalibrateAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        from epbuild.manifest.quantization import sample_files
        from epbuild.providers.distributions import dist_version

        source = action.entry.path
        inputs = keys.model_digests(source, fresh=fresh)
        for sample in action.recipe.calibration:
            for rel in sample_files(keys.root, sample):
                what = f"calibration sample of quantization.{action.recipe.name}"
                inputs[rel] = keys.input_digest(
                    rel, what, "restore it, or fix the calibration entry"
                )
        return self.keyed(
            inputs,
            samples=list(action.recipe.calibration),
            method=action.recipe.method,
            preprocess=action.flavour,
            versions={d: dist_version(d) for d in ("onnxruntime", "onnx")},
        )

    def payload(self, action: CalibrateAction, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        payload = {
            "model": action.entry.path,
            "samples": list(action.recipe.calibration),
            "method": action.recipe.method,
            "flavour": action.flavour,
        }
        return payload

    def check(
        self, action: CalibrateAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """The preprocessed model (and its external data) and readable ranges, nothing
        else."""
        from epbuild.onnx.staged import staged_names
        from epbuild.quant.work import MODEL, RANGES

        names = staged_names(ctx.root, staging)
        for required in (MODEL, RANGES):
            if required not in names:
                raise VerificationError(f"expected output {required} was not written")
        extra = sorted(set(names) - {MODEL, MODEL + ".data", RANGES})
        if extra:
            raise VerificationError(f"unexpected output {extra[0]} staged by the calibration")
        check_ranges(os.path.join(ctx.root, staging, RANGES), RANGES)
        return names, []


def check_ranges(path: str, name: str) -> None:
    """A calibration's ranges file (``name`` in messages): readable, with the ranges of at
    least one tensor."""
    try:
        with open(path, encoding="utf-8") as f:
            ranges = json.load(f)
    except (OSError, ValueError) as exc:
        raise VerificationError(f"{name}: unreadable calibration ranges ({exc})") from exc
    if not isinstance(ranges, dict) or not ranges.get("data"):
        raise VerificationError(f"{name}: the calibration found no tensor to quantize")


CALIBRATE = CalibrateKind()
