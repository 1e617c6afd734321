"""The ``[llms.<name>]`` tables: an onnxruntime-genai model folder per entry, checked here
(``epbuild.llm.source`` reads its ``genai_config.json``) so that a folder epbuild cannot
build ends in one message naming the manifest's line and key."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from epbuild.errors import UnsafePathError
from epbuild.fs import format_bytes, safe_relpath
from epbuild.llm.sizes import parse_size, parts_for_size, weight_sizes
from epbuild.manifest.locate import Where
from epbuild.manifest.model import DEFAULT_CONTEXT_LENGTH, DEFAULT_WINDOW_SIZE, Llm, Quantization
from epbuild.manifest.quantization import check_provider_runs
from epbuild.manifest.refs import check_provider_list
from epbuild.onnx.proto import ProtoError
from epbuild.providers.contract import ProviderConfig

if TYPE_CHECKING:
    from epbuild.llm.source import LlmSource


def load_llms(
    where: Where,
    root: Path,
    tables: dict[str, Any],
    providers: dict[str, ProviderConfig],
    group_names: set[str],
    budget: int | None = None,
    quantization: dict[str, Quantization] | None = None,
) -> dict[str, Llm]:
    """Every ``[llms.*]`` table, validated against the schema already. ``budget``: the
    workspace's memory budget (None: this machine's memory), which one graph's KV cache
    must fit; ``quantization``: the ``[quantization.*]`` tables an entry's ``quantize`` may
    name."""
    found = {
        name: _llm(where, root, name, table, providers, group_names)
        for name, table in tables.items()
    }
    for llm, _ in found.values():
        if llm.quantize is not None:
            check_quantized_llm(where, llm, quantization or {}, providers)
    for name, (llm, kv) in found.items():
        _check_kv(where, name, llm, kv, budget)
    return {name: llm for name, (llm, _) in found.items()}


KV_BYTES = 4
"""Bytes of one KV-cache element in the prepared graphs (float32)."""


def kv_cache_bytes(llm: Llm, layers: int, kv_heads: int) -> int:
    """One static graph's KV cache: keys and values of every layer, ``kv_heads × context_length
    × head_size`` each, in float32. A compile holds it (as input and output) several times
    over."""
    return 2 * layers * kv_heads * llm.context_length * llm.head_size * KV_BYTES


def _check_kv(
    where: Where, name: str, llm: Llm, shape: tuple[int, int], budget: int | None
) -> None:
    """Refuse an entry whose KV cache alone exceeds the memory a build may use."""
    import os

    from epbuild.fs import format_bytes

    if not shape[0] or not shape[1]:
        return
    need = kv_cache_bytes(llm, *shape)
    try:
        limit = budget or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): the budget only
        limit = budget or 0
    if not limit:
        return
    if need > limit:
        what = "the workspace's memory_budget" if budget else "this machine's memory"
        raise where.error(
            ("llms", name, "context_length"),
            f"{llm.context_length} makes one graph's KV cache {format_bytes(need)} "
            f"(2 × {shape[0]} layers × {shape[1]} KV heads × {llm.context_length} × head size "
            f"{llm.head_size} × {KV_BYTES} bytes), more than {what} ({format_bytes(limit)}); "
            "the build would be killed for memory",
            "lower context_length",
        )


def _llm(
    where: Where,
    root: Path,
    name: str,
    table: dict[str, Any],
    providers: dict[str, ProviderConfig],
    group_names: set[str],
) -> tuple[Llm, tuple[int, int]]:
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
    from epbuild.llm.source import PIPELINE  # read only for an [llms] entry

    found = _source(where, base, root, source)
    if found.form == PIPELINE and "quantize" in table:
        raise where.error(
            (*base, "quantize"),
            f"{source} is a {PIPELINE} (static stages already): epbuild quantizes the "
            "static graphs it prepares from a single decoder",
            "build from the decoder genai's model builder writes, or quantize the stages before",
        )
    pipeline = found.form == PIPELINE
    context, window = _sizes(where, base, source, table, found, pipeline=pipeline)
    llm = Llm(
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
        parts=_parts(where, base, root, source, table, found, pipeline=pipeline),
        quantize=table.get("quantize"),
    )
    return llm, (found.layers, found.kv_heads)


def _sizes(
    where: Where,
    base: tuple[str, str],
    source: str,
    table: dict[str, Any],
    found: LlmSource,
    *,
    pipeline: bool,
) -> tuple[int, int]:
    """The entry's ``context_length`` and ``window_size``: within the model's limit, the
    window within the context; a pipeline's (``pipeline``) as its static stages have them."""
    limit = found.context_limit
    if pipeline:
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
    # A prompt is read in whole windows: one as long as the KV cache leaves no room for
    # a generated token (genai stops the package at its first), so the default is below it.
    default_window = found.window_size or (
        DEFAULT_WINDOW_SIZE if context > DEFAULT_WINDOW_SIZE else max(1, context // 2)
    )
    window = table.get("window_size", default_window)
    if window > context:
        raise where.error(
            (*base, "window_size"),
            f"{window} is above context_length ({context}): a prompt window must fit the KV cache",
            f"use a window_size below context_length, e.g. {max(1, context // 2)}",
        )
    if window == context and not pipeline:
        raise where.error(
            (*base, "window_size" if "window_size" in table else "context_length"),
            f"window_size {window} is context_length: a prompt is read in whole windows, so "
            "its first fills the KV cache and leaves no room for a generated token",
            f"use window_size = {context // 2}, or raise context_length"
            if context > 1
            else "raise context_length: the prompt and a generated token need 2 at least",
        )
    return context, window


def _parts(
    where: Where,
    base: tuple[str, str],
    root: Path,
    source: str,
    table: dict[str, Any],
    found: LlmSource,
    *,
    pipeline: bool,
) -> int:
    """How many parts ``parts`` or ``max_part_size`` asks for (1 when neither is set)."""
    count, size = table.get("parts"), table.get("max_part_size")
    if count is None and size is None:
        return 1
    if count is not None and size is not None:
        raise where.error(
            (*base, "max_part_size"),
            "is set together with parts: give the number of parts or the largest part's "
            "size, not both",
            "remove parts or max_part_size",
        )
    key = "parts" if count is not None else "max_part_size"
    if pipeline:
        raise where.error(
            (*base, key),
            f"{source} is a decoder-pipeline already: epbuild splits only a single decoder "
            "(model.decoder.filename) into parts",
            f"remove {key} from [llms.{base[1]}]",
        )
    layers = found.layers
    if count is not None:
        if not 1 <= count <= layers:
            raise where.error(
                (*base, "parts"),
                f"{count} is not between 1 and the model's {layers} layers "
                f"({source}/genai_config.json: model.decoder.num_hidden_layers)",
                f"use parts = 1 to {layers}",
            )
        return int(count)
    return _parts_for_size(where, base, (root, source), found, str(size))


def _parts_for_size(
    where: Where, base: tuple[str, str], at: tuple[Path, str], found: LlmSource, size: str
) -> int:
    """The fewest parts none of which holds more than ``max_part_size`` weight bytes
    (``at``: the workspace root and the source folder in it)."""
    root, source = at
    limit = parse_size(size)
    if limit is None:
        raise where.error(
            (*base, "max_part_size"),
            f"{size!r} is not a size",
            'write e.g. "1 GiB" or "512 MiB"',
        )
    layers = found.layers
    if layers < 1:
        return 1
    model = root / source / found.files[0]
    try:
        sizes = weight_sizes(model, layers)
    except (OSError, ProtoError) as exc:
        raise where.error(
            (*base, "source"),
            f"{source}/{found.files[0]}: cannot read its weights' sizes ({exc})",
            "restore the source model",
        ) from exc
    if not min(sizes.layers):  # a layer that holds no external weights holds them inline
        layer = sizes.layers.index(0)
        raise where.error(
            (*base, "max_part_size"),
            f"{source}/{found.files[0]} keeps the weights of layer {layer} inside the graph "
            "file: max_part_size weighs a layer by its external data (as genai's model "
            "builder writes it)",
            "give the number of parts instead (parts = N), or save the model's weights as "
            "external data",
        )
    try:
        return parts_for_size(sizes, limit)
    except ValueError as exc:
        smallest = int(exc.args[0])
        raise where.error(
            (*base, "max_part_size"),
            f"{size} is smaller than one layer's weights ({format_bytes(smallest)}, the "
            "last layer's with the final norm and lm_head)",
            f'use max_part_size = "{_ceil_size(smallest)}" or more',
        ) from exc


def _ceil_size(size: int) -> str:
    """``size`` rounded up to whole MiB (KiB below one MiB)."""
    unit, scale = ("MiB", 1 << 20) if size >= 1 << 20 else ("KiB", 1 << 10)
    return f"{-(-size // scale)} {unit}"


def _source(where: Where, base: tuple[str, ...], root: Path, source: str) -> LlmSource:
    """The LLM source folder ``source`` read (``llm.source.read_source``)."""
    from epbuild.llm.genai_schema import LlmSourceError
    from epbuild.llm.source import read_source

    try:
        return read_source(root / source)
    except LlmSourceError as exc:
        raise where.error((*base, "source"), f"{source}: {exc.message}", exc.hint) from exc


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


def quantize_names(where: Where, tables: dict[str, Any], recipes: dict[str, Any]) -> set[str]:
    """The ``[quantization.*]`` tables the ``[llms.*]`` tables name (their calibration is
    text), each one defined; checked before the tables' samples are looked for."""
    names = set()
    for name, table in tables.items():
        if "quantize" not in table:
            continue
        if table["quantize"] not in recipes:
            defined = ", ".join(recipes) or "none"
            raise where.error(
                ("llms", name, "quantize"),
                f"no [quantization.{table['quantize']}] table",
                f"add one whose calibration names .txt files of prompts (defined: {defined})",
            )
        names.add(table["quantize"])
    return names


def check_quantized_llm(
    where: Where,
    llm: Llm,
    tables: dict[str, Quantization],
    providers: dict[str, ProviderConfig],
) -> None:
    """Each of a quantized entry's providers takes its ``quantize`` table's types (a
    decoder in parts is quantized part by part, each part's graphs calibrated on the inputs
    the parts before it give them)."""
    recipe = tables[llm.quantize or ""]  # defined: ``quantize_names``
    for name in llm.providers:
        check_provider_runs(where, recipe, name, providers[name], f"llms.{llm.name}")
