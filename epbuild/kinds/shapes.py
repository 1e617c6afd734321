"""Static shapes, checked before a compile: an NPU EP compiles only inputs of fixed shape.

With a symbolic input dimension (``batch``, ``sequence_length``) such an EP takes no node
and ONNX Runtime silently runs the model on the CPU EP: the compile "succeeds" with nothing
compiled. So before a worker starts, every input dimension of every model of an action for
such a provider (``needs_static_shapes``) must be a number, or a name the manifest's
``free_dimensions`` gives a value (the group's, under the model entry's own). Overrides
naming a dimension no model has are warnings: the compile is right without them, and the
group's apply to models that lack some of them (a vision encoder beside a decoder).

Only actions about to compile come here (not the no-op path): the source models' input
shapes are read with the proto reader, memoised by file stat.
"""

from __future__ import annotations

import os

from epbuild._dataclass import dataclass, field
from epbuild._names import model_label
from epbuild.errors import ModelError
from epbuild.manifest.model import Group, ModelEntry
from epbuild.manifest.tomledit import render_key
from epbuild.onnx.proto import Dim, GraphInput, ProtoError, read_model
from epbuild.planning.actions import CompileAction
from epbuild.providers import get_provider

_INPUTS: dict[tuple[str, int, int, int], tuple[GraphInput, ...]] = {}
"""(path, inode, size, mtime_ns) → the model's inputs, for this process."""


@dataclass(frozen=True)
class ShapeCheck:
    """What the check found for one action."""

    warnings: list[str] = field(default_factory=list)
    """Overrides that name no dimension of the models they apply to."""


def check_shapes(root: str, action: CompileAction) -> ShapeCheck:
    """Raise ``ModelError`` for an input dimension the action's NPU provider cannot compile
    (naming model, input, dimension and the manifest key to set); return the warnings."""
    config = action.provider
    strict = get_provider(config.ep).needs_static_shapes(config)
    group = action.group
    if (
        not strict
        and not group.free_dimensions
        and not any(e.free_dimensions for e in group.entries)
    ):
        return ShapeCheck()
    for entry in action.entries:
        inputs = graph_inputs(root, entry.path)
        if strict and inputs is not None:
            _require_static(action, entry, inputs)
    return ShapeCheck(_unused(root, action))


def _require_static(
    action: CompileAction, entry: ModelEntry, inputs: tuple[GraphInput, ...]
) -> None:
    """Raise for the first input dimension that stays unknown under the overrides."""
    dims = action.group.free_dimensions_of(entry)
    label = _label(entry)
    target = f"the {action.provider.ep} provider {action.provider.name!r}"
    unset = [
        (inp, i, d)
        for inp in inputs
        for i, d in enumerate(inp.shape or ())
        if _open(d) and not (isinstance(d, str) and d in dims)
    ]
    for inp in inputs:
        if inp.shape is None:
            raise ModelError(
                f"{label}: input {inp.name!r} has no shape in the model, and {target} "
                "compiles static shapes only",
                hint="re-export the model with its input shapes",
            )
    if not unset:
        return
    inp, index, dim = unset[0]
    shown = "[" + ", ".join("?" if d is None else str(d) for d in inp.shape or ()) + "]"
    if not isinstance(dim, str):
        raise ModelError(
            f"{label}: dimension {index} of input {inp.name!r} {shown} has neither a size nor "
            f"a name, and {target} compiles static shapes only",
            hint="free_dimensions sets named (dim_param) dimensions only: re-export the model "
            "with a size or a name there",
        )
    names = list(dict.fromkeys(d for _, _, d in unset if isinstance(d, str)))
    more = f" (also unset: {', '.join(names[1:])})" if len(names) > 1 else ""
    raise ModelError(
        f"{label}: input {inp.name!r} {shown} has the symbolic dimension {dim!r}{more}, and "
        f"{target} compiles static shapes only",
        hint=_where_to_set(action.group, entry, names),
    )


def _where_to_set(group: Group, entry: ModelEntry, names: list[str]) -> str:
    """The manifest keys that would fix the dimensions ``names`` (quoted where a name is
    no bare TOML key: an exporter's ``batch size``, ``2*s0``)."""
    values = ", ".join(f"{render_key(n)} = ..." for n in names)
    base = f"groups.{group.name}"
    first = render_key(names[0])
    if entry.index is not None:
        return (
            f"set {base}.{entry.key}.free_dimensions.{first} (this model), or "
            f"{base}.free_dimensions.{first} (every model of the group): "
            f"free_dimensions = {{ {values} }}"
        )
    return (
        f"set {base}.free_dimensions.{first}: free_dimensions = {{ {values} }} in "
        f"[groups.{group.name}], or for this model only write its entry as a table: "
        f'{{ path = "{group.listed_path(entry)}", free_dimensions = {{ {values} }} }}'
    )


def _unused(root: str, action: CompileAction) -> list[str]:
    """Overrides that no model they apply to has as an input dimension."""
    group, warnings = action.group, []
    for entry in action.entries:
        names = _symbolic(root, entry.path)
        for dim in entry.free_dimensions:
            if names is not None and dim not in names:
                warnings.append(
                    f"groups.{group.name}.{entry.key}.free_dimensions.{dim}: {_label(entry)} "
                    f"has no input dimension {dim!r} ({_known(names)})"
                )
    if group.free_dimensions:
        per_model = [_symbolic(root, e.path) for e in group.entries]
        if all(n is not None for n in per_model):
            everywhere = set().union(*(n for n in per_model if n is not None))
            for dim in group.free_dimensions:
                if dim not in everywhere:
                    warnings.append(
                        f"groups.{group.name}.free_dimensions.{dim}: no model of the group has "
                        f"an input dimension {dim!r} ({_known(everywhere)})"
                    )
    return warnings


def _known(names: set[str]) -> str:
    return "its symbolic ones: " + ", ".join(sorted(names)) if names else "none is symbolic"


def _open(dim: Dim) -> bool:
    """A dimension without a fixed size (some exporters write -1 for one)."""
    return not isinstance(dim, int) or dim < 0


def _label(entry: ModelEntry) -> str:
    return model_label(entry.path, entry.name)


def _symbolic(root: str, model: str) -> set[str] | None:
    """The symbolic dimension names of a model's inputs (None: unreadable)."""
    inputs = graph_inputs(root, model)
    if inputs is None:
        return None
    return {d for inp in inputs for d in inp.shape or () if isinstance(d, str)}


def graph_inputs(root: str, model: str) -> tuple[GraphInput, ...] | None:
    """A model's graph inputs (read once per file state in this process); None when it
    cannot be read (the compile, or the preparation, reports that)."""
    path = os.path.join(root, model)
    try:
        st = os.stat(path)
        memo = (path, st.st_ino, st.st_size, st.st_mtime_ns)
        if memo not in _INPUTS:
            _INPUTS[memo] = read_model(path).inputs
        return _INPUTS[memo]
    except (OSError, ProtoError):
        return None
