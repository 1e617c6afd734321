"""Quantized groups on the graph: a group with ``quantize = "<name>"`` gets a calibrate and
a quantize action per model (``kinds.quantize.quant_actions``), and its compile actions
take the QDQ models instead of the float ones, each after its model's quantization."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from epbuild._dataclass import dataclass, field
from epbuild.kinds.calibrate import CalibrateAction
from epbuild.kinds.quantize import QuantizeAction, quant_actions, quantized_entry
from epbuild.manifest.model import Group, Manifest, ModelEntry, Quantization
from epbuild.providers.contract import ProviderConfig

if TYPE_CHECKING:
    from epbuild.kinds.contract import GraphRequest


@dataclass(frozen=True)
class QuantizedGroup(Group):
    """The compile group of a quantized manifest group: the QDQ models under the float
    models' names."""

    sources: tuple[ModelEntry, ...] = ()
    """The float models, in the order of ``entries``."""
    quantized_by: Mapping[str, str] = field(default_factory=dict)
    """Model name → the id of the quantize action that writes its QDQ model."""
    calibrated: Mapping[str, str] = field(default_factory=dict)
    """Model name → the preprocessed float model its calibration wrote (what the QDQ
    model's activations are compared with, layer by layer)."""
    provider_configs: Mapping[str, ProviderConfig] = field(default_factory=dict)
    """Provider name → its configuration for QDQ models (``BaseProvider.for_quantized``)."""
    recipe: Quantization | None = None
    """The ``[quantization.<name>]`` it is made by (``verify --numerics`` checks by it)."""
    out_dir: str = ""
    """The workspace's ``out_dir``, where its QDQ models are (``key_path``)."""

    def key_path(self, path: str) -> str:
        """How a compile key names a QDQ model: by its place below ``out_dir``
        (``<out_dir>/<group>/quantized/<name>.onnx``), so that a moved ``out_dir`` keeps the
        compile's key (its cache entry restores it there) as it keeps the quantization's."""
        rel = posixpath.relpath(path, self.out_dir or ".")
        return path if rel.startswith("../") else posixpath.join("<out_dir>", rel)

    def deps_for(self, entries: Sequence[ModelEntry]) -> tuple[str, ...]:
        return tuple(self.quantized_by[e.name] for e in entries)

    def listed_path(self, entry: ModelEntry) -> str:
        """The float model's path: the manifest lists it, not the QDQ model."""
        return next((s.path for s in self.sources if s.name == entry.name), entry.path)


def quantization_actions(request: GraphRequest) -> list[CalibrateAction | QuantizeAction]:
    """The calibrate and quantize actions of every quantized group, in manifest order
    (the quantize kind's actions, with their calibrations)."""
    actions: list[CalibrateAction | QuantizeAction] = []
    for group in request.manifest.groups.values():
        if group.quantize is not None:
            actions += _actions(request.manifest, group)
    return actions


def compiled_group(manifest: Manifest, group: Group) -> Group:
    """The group its compile actions take: ``group`` itself, or the quantized group of a
    group with ``quantize``."""
    from epbuild.providers import get_provider

    if group.quantize is None:
        return group
    quantize = [a for a in _actions(manifest, group) if isinstance(a, QuantizeAction)]
    return QuantizedGroup(
        **{f: getattr(group, f) for f in Group.__dataclass_fields__},
        sources=group.entries,
        recipe=manifest.quantization[group.quantize],
        out_dir=manifest.workspace.out_dir,
        quantized_by={a.entry.name: a.id for a in quantize},
        calibrated={a.entry.name: a.calibration.model for a in quantize},
        provider_configs={
            p: get_provider(manifest.providers[p].ep).for_quantized(manifest.providers[p])
            for p in group.providers
        },
    ).with_entries(tuple(quantized_entry(a) for a in quantize))


def _actions(manifest: Manifest, group: Group) -> list[CalibrateAction | QuantizeAction]:
    from epbuild.providers import get_provider

    assert group.quantize is not None
    recipe = manifest.quantization[group.quantize]
    flavour = get_provider(manifest.providers[group.providers[0]].ep).quantization
    ws = manifest.workspace
    return quant_actions(group, recipe, flavour, ws.out_dir, ws.state_dir)
