"""``epbuild add llm``: an ``[llms.NAME]`` table for an onnxruntime-genai model folder, made
the way ``manifest.edit`` makes every edit (the manifest lock, the user's layout kept, the
edited text checked by the loader before an atomic replace, the file byte-identical after a
refusal)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epbuild.errors import UserError
from epbuild.manifest.edit import EditResult, _editing, _only, _Session, manifest_relative
from epbuild.manifest.tomledit import append_unique

if TYPE_CHECKING:
    from tomlkit.items import Table

__all__ = ["add_llm"]


def add_llm(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    name: str,
    source: str,
    providers: Sequence[str] = (),
    context_length: int | None = None,
    window_size: int | None = None,
    share_weights: bool | None = None,
) -> EditResult:
    """Add ``[llms.NAME]`` building the genai model folder ``source`` (relative to
    ``directory``) for ``providers`` (default: the manifest's only provider). An existing
    entry for the same folder gets the providers it lacks and the settings given; one for
    another folder is refused. The loader checks the folder (``genai_config.json``, the
    model's context limit) before anything is written."""
    with _editing(directory, manifest) as s:
        rel = manifest_relative(directory, s.path, source)
        table = s.table("llms", name)
        if table is None:
            values: dict[str, Any] = {"source": rel}
            chosen = list(dict.fromkeys(providers)) or [
                _only(s, "providers", "--provider", "a provider")
            ]
            values["providers"] = chosen
            values.update(_settings(context_length, window_size, share_weights))
            s.add_table("llms", name, values)
            s.changes.append(f"added llm {name} ({rel}, for {', '.join(chosen)})")
        else:
            _extend(s, name, table, rel, providers, context_length, window_size, share_weights)
        return s.finish()


def _settings(
    context_length: int | None, window_size: int | None, share_weights: bool | None
) -> dict[str, Any]:
    """The keys given, in the manifest's order (the loader defaults the rest)."""
    values: dict[str, Any] = {}
    if context_length is not None:
        values["context_length"] = context_length
    if window_size is not None:
        values["window_size"] = window_size
    if share_weights is not None:
        values["share_weights"] = share_weights
    return values


def _extend(
    s: _Session,
    name: str,
    table: Table,
    rel: str,
    providers: Sequence[str],
    context_length: int | None,
    window_size: int | None,
    share_weights: bool | None,
) -> None:
    from tomlkit.items import Array

    data = s.data["llms"][name]
    listed = table.get("source")
    if not isinstance(listed, str) or posixpath.normpath(listed) != rel:
        raise UserError(
            f"llm {name!r} already exists for {listed!r} ({s.line_of('llms', name)})",
            hint="choose another name, or change its source by hand",
        )
    if providers:
        array = table.get("providers")
        if not isinstance(array, Array):
            raise UserError(f"llms.{name}.providers is not a list ({s.line_of('llms', name)})")
        for p in append_unique(array, list(providers)):
            data["providers"].append(p)
            s.changes.append(f"llm {name} is now also built for {p}")
    for key, value in _settings(context_length, window_size, share_weights).items():
        if data.get(key) == value and type(data.get(key)) is type(value):
            continue
        table[key] = value
        data[key] = value
        s.changes.append(f"llm {name}: {key} = {str(value).lower()}")
    if not s.changes:
        s.notes.append(f"llm {name} already builds {rel} with these settings")
