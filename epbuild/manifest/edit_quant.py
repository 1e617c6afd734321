"""``epbuild add quantization``: a ``[quantization.NAME]`` recipe, made the way
``manifest.edit`` makes every edit (the manifest lock, the user's layout kept, the edited
text checked by the loader before an atomic replace, the file byte-identical after a
refusal). ``add model --quantize NAME`` names it on a group (``manifest.edit``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from epbuild.errors import UserError
from epbuild.manifest.edit import EditResult, _editing, manifest_relative

__all__ = ["add_quantization"]


def add_quantization(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    name: str,
    calibration: Sequence[str] = (),
    validation: Sequence[str] = (),
    activations: str | None = None,
    weights: str | None = None,
    per_channel: bool | None = None,
    method: str | None = None,
    exclude: Sequence[str] = (),
) -> EditResult:
    """Add ``[quantization.NAME]`` with its calibration samples (files, folders or globs
    relative to ``directory``) and the settings given, or set those settings on an existing
    one (its samples replaced when ``calibration`` is given; ``exclude`` adds node names).
    The loader checks the samples and the types against the providers of every group that
    uses the recipe before anything is written."""
    with _editing(directory, manifest) as s:
        values: dict[str, Any] = {}
        for key, given in (("calibration", calibration), ("validation", validation)):
            if given:
                rels = [manifest_relative(directory, s.path, v) for v in given]
                values[key] = rels[0] if len(rels) == 1 else rels
        for key, value in (
            ("activations", activations),
            ("weights", weights),
            ("per_channel", per_channel),
            ("method", method),
        ):
            if value is not None:
                values[key] = value
        table = s.table("quantization", name)
        if table is None:
            if "calibration" not in values:
                raise UserError(
                    f"a new quantization {name!r} needs its calibration samples",
                    hint=f"epbuild add quantization {name} --calibration 'calib/*.npz'",
                )
            if exclude:
                values["exclude"] = list(dict.fromkeys(exclude))
            s.add_table("quantization", name, values)
            s.changes.append(f"added quantization {name} (calibration {values['calibration']})")
            return s.finish()
        data = s.data["quantization"][name]
        for key, value in values.items():
            if data.get(key) == value and type(data.get(key)) is type(value):
                continue
            table[key] = value
            data[key] = value
            s.changes.append(f"quantization {name}: {key} = {value}")
        if exclude:
            listed = list(data.get("exclude", []))
            fresh = [n for n in dict.fromkeys(exclude) if n not in listed]
            if fresh:
                table["exclude"] = data["exclude"] = listed + fresh
                s.changes.append(f"quantization {name} now keeps {', '.join(fresh)} in float")
        if not s.changes:
            s.notes.append(f"quantization {name} already has these settings")
        return s.finish()
