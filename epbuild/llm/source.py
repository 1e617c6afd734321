"""What an onnxruntime-genai model folder holds, read from its ``genai_config.json`` alone.

Standard library only (and epbuild's own ONNX reader for a pipeline's stage shapes): the
manifest reads it on every load, and the no-op path must not import onnx or onnxruntime.
``read_source`` accepts the two shapes epbuild builds from (one dynamic-shape ``decoder``,
as genai's model builder writes it, or a ``decoder-pipeline``, as Olive writes it) and
refuses anything else with a ``LlmSourceError`` naming what it found.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epbuild._dataclass import dataclass
from epbuild.llm.genai_schema import GENAI_CONFIG, LlmSourceError, check_config
from epbuild.onnx.proto import ProtoError, read_model

DECODER = "decoder"
"""A single dynamic-shape decoder model (``model.decoder.filename``)."""
PIPELINE = "decoder-pipeline"
"""Static stages already (``model.decoder.pipeline``)."""

# Model parts that make a genai model something other than a decoder-only LLM.
_NOT_DECODER = ("encoder", "vision", "speech", "audio", "embedding", "image_encoder")


@dataclass(frozen=True)
class LlmSource:
    """The facts of a genai model folder that the manifest and planning need."""

    form: str
    """``DECODER`` or ``PIPELINE``."""
    model_type: str
    """``model.type`` of the config (``llama``, ``qwen2``, ``decoder-pipeline``, ...)."""
    context_limit: int
    """``model.context_length``: the longest sequence the model supports."""
    files: tuple[str, ...]
    """The ONNX files the decoder names, relative to the folder."""
    head_size: int = 0
    """``model.decoder.head_size`` (0 where the config has none)."""
    stages: tuple[tuple[str, str], ...] = ()
    """A pipeline's stages in order: (name, ONNX file relative to the folder)."""
    window_size: int = 0
    """A pipeline's ``model.decoder.sliding_window.window_size`` (0 where it has none)."""
    layers: int = 0
    """A decoder's ``model.decoder.num_hidden_layers`` (0 for a pipeline)."""
    kv_heads: int = 0
    """A decoder's key/value heads (``num_key_value_heads``, else ``num_attention_heads``;
    0 where the config has neither)."""


def read_source(folder: Path) -> LlmSource:
    """Read ``folder/genai_config.json``; raise ``LlmSourceError`` if it is no decoder LLM."""
    config_path = folder / GENAI_CONFIG
    if not folder.is_dir():
        raise LlmSourceError(
            "is not a folder" if folder.exists() else "does not exist",
            "name an onnxruntime-genai model folder (genai_config.json + ONNX + tokenizer)",
        )
    try:
        text = config_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LlmSourceError(
            f"has no {GENAI_CONFIG}: not an onnxruntime-genai model folder",
            "make one with 'python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT "
            "-p fp32 -e cpu', or with Olive",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmSourceError(f"cannot read {GENAI_CONFIG}: {exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LlmSourceError(f"{GENAI_CONFIG} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise LlmSourceError(f"{GENAI_CONFIG} nests tables or lists too deeply") from None
    check_config(config)
    _refuse_outward_links(folder)
    return _decoder_source(config["model"])


def _refuse_outward_links(folder: Path) -> None:
    """Every link in the folder resolves inside it: a file the package would copy (a
    tokenizer, a template) or a graph it compiles is never one from elsewhere."""
    import os

    base = os.path.realpath(folder)
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not entry.is_symlink():
            continue
        target = os.path.realpath(entry.path)
        if not (target + os.sep).startswith(base + os.sep):
            raise LlmSourceError(
                f"{entry.name} is a link to {target}, outside the folder",
                "copy the file into the folder (or remove the link): epbuild reads and ships "
                "only files of the source folder",
            )


def _decoder_source(model: dict[str, Any]) -> LlmSource:
    model_type = str(model.get("type", "?"))
    found = [part for part in _NOT_DECODER if part in model]
    if found:
        raise LlmSourceError(
            f"is a {model_type!r} model with an {found[0]} ({GENAI_CONFIG}: model.{found[0]}), "
            "not a decoder-only LLM",
            "epbuild builds decoder-only LLMs (Llama, Qwen2, Phi, Mistral, ...)",
        )
    limit = model.get("context_length")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise LlmSourceError(f"{GENAI_CONFIG} has no positive model.context_length")
    decoder = model.get("decoder")
    if not isinstance(decoder, dict):
        raise LlmSourceError(
            f"is a {model_type!r} model without a decoder ({GENAI_CONFIG}: no model.decoder)",
            "epbuild builds decoder-only LLMs (Llama, Qwen2, Phi, Mistral, ...)",
        )
    pipeline = decoder.get("pipeline")
    if isinstance(pipeline, list) and pipeline:
        return _pipeline_source(model_type, limit, decoder, pipeline)
    filename = decoder.get("filename")
    if not isinstance(filename, str) or not filename:
        raise LlmSourceError(
            f"{GENAI_CONFIG}: model.decoder has neither a filename nor a pipeline",
            "epbuild builds a single decoder (model builder) or a decoder-pipeline (Olive)",
        )
    if not _plain_name(filename):
        raise LlmSourceError(
            f"{GENAI_CONFIG}: model.decoder.filename names {filename!r}, not a file of the folder"
        )
    head = decoder.get("head_size")
    if not isinstance(head, int) or isinstance(head, bool) or head < 1:
        raise LlmSourceError(f"{GENAI_CONFIG} has no positive model.decoder.head_size")
    layers = decoder.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool):
        raise LlmSourceError(
            f"{GENAI_CONFIG} has no model.decoder.num_hidden_layers",
            "genai needs it to name each layer's KV-cache inputs and outputs",
        )
    heads = decoder.get("num_key_value_heads") or decoder.get("num_attention_heads")
    kv = heads if isinstance(heads, int) else 0
    return LlmSource(DECODER, model_type, limit, (filename,), head, layers=layers, kv_heads=kv)


def _pipeline_source(
    model_type: str, limit: int, decoder: dict[str, Any], pipeline: list[Any]
) -> LlmSource:
    """A ``decoder-pipeline``: each entry one ``{name: {filename, ...}}`` stage."""
    stages: list[tuple[str, str]] = []
    for entry in pipeline:
        if not isinstance(entry, dict) or len(entry) != 1:
            raise LlmSourceError(
                f"{GENAI_CONFIG}: each model.decoder.pipeline entry must be one "
                '{"STAGE": {"filename": ...}} table'
            )
        ((name, stage),) = entry.items()
        filename = stage.get("filename") if isinstance(stage, dict) else None
        if not isinstance(filename, str) or not filename:
            raise LlmSourceError(
                f"{GENAI_CONFIG}: the model.decoder.pipeline stage {name!r} has no filename"
            )
        if not _plain_name(filename):
            raise LlmSourceError(
                f"{GENAI_CONFIG}: the stage {name!r} names {filename!r}, not a file of the folder"
            )
        if not _plain_name(name) or name in (s for s, _ in stages):
            raise LlmSourceError(f"{GENAI_CONFIG}: the stage name {name!r} is unusable or repeated")
        stages.append((name, filename))
    window = decoder.get("sliding_window", {})
    size = window.get("window_size", 0) if isinstance(window, dict) else 0
    return LlmSource(
        PIPELINE,
        model_type,
        limit,
        tuple(f for _, f in stages),
        stages=tuple(stages),
        window_size=size if isinstance(size, int) and not isinstance(size, bool) else 0,
    )


def _plain_name(name: str) -> bool:
    """A file name in the folder itself (no directory part, not hidden)."""
    return (
        bool(name)
        and not any(c in name for c in "/\\:")  # no directory part, drive or stream
        and not name.startswith(".")
    )


def static_stages(
    folder: str | Path, stages: tuple[tuple[str, str], ...]
) -> tuple[tuple[str, str], ...]:
    """The pipeline stages whose graph has static input shapes (what an NPU compiler
    takes; the others, such as a CPU ``embeddings`` or ``lm_head``, run as they are). A
    stage that cannot be read counts as static, so that compiling it says why."""
    found = []
    for stage, filename in stages:
        try:
            inputs = read_model(str(Path(folder, filename))).inputs
        except (OSError, ProtoError):
            found.append((stage, filename))
            continue
        dims = [d for i in inputs for d in (i.shape if i.shape is not None else (None,))]
        if all(isinstance(d, int) and d >= 0 for d in dims):
            found.append((stage, filename))
    return tuple(found)
