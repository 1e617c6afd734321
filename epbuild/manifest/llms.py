"""The ``[llms.<name>]`` tables: an onnxruntime-genai model folder per entry, checked here
(``epbuild.llm.source`` reads its ``genai_config.json``) so that a folder epbuild cannot
build ends in one message naming the manifest's line and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epbuild.errors import UnsafePathError
from epbuild.fs import safe_relpath
from epbuild.llm.source import LlmSourceError, read_source
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
    context = table.get("context_length", min(DEFAULT_CONTEXT_LENGTH, limit))
    if context > limit:
        raise where.error(
            (*base, "context_length"),
            f"{context} is above the model's limit of {limit} "
            f"({source}/genai_config.json: model.context_length)",
            f"use context_length = {limit} or less",
        )
    window = table.get("window_size", min(DEFAULT_WINDOW_SIZE, context))
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
    )
