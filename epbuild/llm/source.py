"""What an onnxruntime-genai model folder holds, read from its ``genai_config.json`` alone.

Standard library only: the manifest reads it on every load, and the no-op path must not
import onnx or onnxruntime. ``read_source`` accepts the two shapes epbuild builds from (one
dynamic-shape ``decoder``, as genai's model builder writes it, or a ``decoder-pipeline``, as
Olive writes it) and refuses anything else with a ``LlmSourceError`` naming what it found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENAI_CONFIG = "genai_config.json"
"""The file that makes a folder an onnxruntime-genai model."""

DECODER = "decoder"
"""A single dynamic-shape decoder model (``model.decoder.filename``)."""
PIPELINE = "decoder-pipeline"
"""Static stages already (``model.decoder.pipeline``)."""

# Model parts that make a genai model something other than a decoder-only LLM.
_NOT_DECODER = ("encoder", "vision", "speech", "audio", "embedding", "image_encoder")


class LlmSourceError(Exception):
    """A folder epbuild cannot build an LLM package from; ``message`` says what was found,
    ``hint`` what to do."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


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
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        raise LlmSourceError(f"{GENAI_CONFIG} has no 'model' table")
    return _decoder_source(model)


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
        files = [
            stage.get("filename")
            for entry in pipeline
            if isinstance(entry, dict)
            for stage in entry.values()
            if isinstance(stage, dict)
        ]
        if not files or not all(isinstance(f, str) and f for f in files):
            raise LlmSourceError(f"{GENAI_CONFIG}: a model.decoder.pipeline stage has no filename")
        return LlmSource(PIPELINE, model_type, limit, tuple(str(f) for f in files))
    filename = decoder.get("filename")
    if not isinstance(filename, str) or not filename:
        raise LlmSourceError(
            f"{GENAI_CONFIG}: model.decoder has neither a filename nor a pipeline",
            "epbuild builds a single decoder (model builder) or a decoder-pipeline (Olive)",
        )
    head = decoder.get("head_size")
    if not isinstance(head, int) or isinstance(head, bool) or head < 1:
        raise LlmSourceError(f"{GENAI_CONFIG} has no positive model.decoder.head_size")
    return LlmSource(DECODER, model_type, limit, (filename,), head)
