"""The ``[llms.<name>]`` tables: an onnxruntime-genai model folder per entry, checked here
(``epbuild.llm.source`` reads its ``genai_config.json``) so that a folder epbuild cannot
build ends in one message naming the manifest's line and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epbuild.errors import UnsafePathError
from epbuild.fs import safe_relpath
from epbuild.llm.source import PIPELINE, LlmSourceError, read_source
from epbuild.manifest.locate import Where
from epbuild.manifest.model import DEFAULT_CONTEXT_LENGTH, DEFAULT_WINDOW_SIZE, Llm
from epbuild.manifest.refs import check_provider_list
from epbuild.providers.contract import ProviderConfig


def load_llms(
    where: Where,
    root: Path,
    tables: dict[str, Any],
    providers: dict[str, ProviderConfig],
    group_names: set[str],
) -> dict[str, Llm]:
    """Every ``[llms.*]`` table, validated against the schema already."""
    return {
        name: _llm(where, root, name, table, providers, group_names)
        for name, table in tables.items()
    }


def _llm(
    where: Where,
    root: Path,
    name: str,
    table: dict[str, Any],
    providers: dict[str, ProviderConfig],
    group_names: set[str],
) -> Llm:
    base = ("llms", name)
    if name in group_names:
        raise where.error(
            base,
            f"{name!r} names a group too: both would build into the same output folder",
            "rename the [llms] entry or the group",
        )
    names: list[str] = table["providers"]
    check_provider_list(where, base, names, providers)
    try:
        source = safe_relpath(table["source"], what="an LLM source folder")
    except UnsafePathError as exc:
        raise where.error((*base, "source"), exc.message, exc.hint) from exc
    try:
        found = read_source(root / source)
    except LlmSourceError as exc:
        raise where.error((*base, "source"), f"{source}: {exc.message}", exc.hint) from exc
    limit = found.context_limit
    if found.form == PIPELINE:
        _check_static(where, base, source, table, "context_length", limit)
        _check_static(where, base, source, table, "window_size", found.window_size)
    context = table.get("context_length", min(DEFAULT_CONTEXT_LENGTH, limit))
    if context > limit:
        raise where.error(
            (*base, "context_length"),
            f"{context} is above the model's limit of {limit} "
            f"({source}/genai_config.json: model.context_length)",
            f"use context_length = {limit} or less",
        )
    default_window = found.window_size or min(DEFAULT_WINDOW_SIZE, context)
    window = table.get("window_size", default_window)
    if window > context:
        raise where.error(
            (*base, "window_size"),
            f"{window} is above context_length ({context}): a prompt window must fit the KV cache",
            f"use window_size = {context} or less",
        )
    return Llm(
        name=name,
        source=source,
        providers=tuple(names),
        context_length=context,
        window_size=window,
        share_weights=table.get("share_weights", True),
        form=found.form,
        model_type=found.model_type,
        files=found.files,
        head_size=found.head_size,
        prompt=table.get("prompt"),
        stages=found.stages,
    )


def _check_static(
    where: Where, base: tuple[str, str], source: str, table: dict[str, Any], key: str, fixed: int
) -> None:
    """A ``decoder-pipeline`` source's graphs are static already: ``key`` may only repeat
    the value they were made with."""
    value = table.get(key)
    if value is None or value == fixed:
        return
    what = f"{fixed}" if fixed else "none"
    raise where.error(
        (*base, key),
        f"{source} is a decoder-pipeline whose graphs are static already ({key} {what}, "
        f"{source}/genai_config.json); it cannot be built with {key} = {value}",
        f"remove {key} from [llms.{base[1]}]",
    )
