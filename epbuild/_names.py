"""Names and constants shared across layers, and the tomllib fallback. Imports nothing of
epbuild's (the no-op path and the worker import it; it must stay cheap)."""

from __future__ import annotations

import posixpath
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tomllib

__all__ = ["tomllib"]


def __getattr__(name: str) -> Any:
    """``tomllib`` (``tomli`` before Python 3.11), imported when first asked for: a worker,
    which imports this module, never reads TOML."""
    if name != "tomllib":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if sys.version_info >= (3, 11):
        import tomllib as module
    else:  # pragma: no cover - Python 3.10
        import tomli as module
    globals()["tomllib"] = module
    return module


MANIFEST_NAME = "epbuild.toml"
"""The manifest's file name, looked for in the working directory (or ``-C DIR``)."""
DEFAULT_OUT_DIR = "build"
"""``[workspace] out_dir`` when the manifest does not set it."""
DEFAULT_STATE_DIR = ".epbuild"
"""``[workspace] state_dir`` when the manifest does not set it."""


def state_dir_setting(manifest: Mapping[str, Any]) -> Any:
    """``[workspace] state_dir`` of a parsed manifest as written, else ``DEFAULT_STATE_DIR``.

    The one home of where the state directory is configured: the loader checks the value
    (``safe_relpath``), the no-op fast path (which must not import the loader) reads it here.
    """
    workspace = manifest.get("workspace")
    if not isinstance(workspace, Mapping):
        return DEFAULT_STATE_DIR
    return workspace.get("state_dir", DEFAULT_STATE_DIR)


# Files in the state directory.
JOURNAL_NAME = "state.jsonl"
"""The append-only journal of completed actions."""
SNAPSHOT_SUFFIX = ".snapshot"
"""Beside the journal (``state.jsonl.snapshot``): each action's key and outputs after its
first bytes, so that a load replays only what came after them (``state.journal``)."""
STATCACHE_NAME = "statcache.json"
"""The stat cache: (inode, size, mtime_ns) → digest."""
STATE_LOCK_NAME = "state.lock"
"""The workspace-state lock."""
LOCKS_DIR = "locks"
"""Per-action locks."""
NOOP_NAME = "noop.json"
"""The no-op fingerprint of the last all-up-to-date build."""
TRACE_NAME = "trace.json"
"""The last build's timeline (Chrome trace events)."""

# Files in the output directory.
STAGING_DIR = ".staging"
"""Where workers write, inside the output directory, before the commit."""
RESULT_NAME = ".epbuild-result.json"
"""The worker's result document, in its staging directory."""
LOG_NAME = ".epbuild-worker.log"
"""The worker's output, in its staging directory."""
PACKAGE_MANIFEST = "epbuild-package.json"
"""epbuild's deployment manifest at a package's root: marks a directory as a package epbuild
wrote (``epbuild.shipping``); model globs never look inside one."""
CACHE_LAYOUT = "v1"
"""The top folder of a directory cache (``epbuild.cache.store``): a folder holding
``v1/objects`` and ``v1/entries`` is a cache, which model globs never look inside."""
CTX_SUFFIX = "_ctx.onnx"
"""A built model is ``<model-stem>_ctx.onnx``."""


def model_stem(model: str) -> str:
    """``models/prefill.onnx`` → ``prefill``."""
    name = posixpath.basename(model)
    return name[: -len(".onnx")] if name.endswith(".onnx") else name


def ctx_name(model: str) -> str:
    """File name of the ctx model built from ``model``: ``prefill_ctx.onnx``."""
    return model_stem(model) + CTX_SUFFIX


def model_label(model: str, name: str) -> str:
    """How messages and build details name a model: its path, and its output name where
    that is not the file's stem (``models/llm.onnx (as decode)``)."""
    return model if name == model_stem(model) else f"{model} (as {name})"


def ctx_stem(path: str) -> str:
    """The model name of a ctx model path: ``out/prefill_ctx.onnx`` → ``prefill``."""
    name = posixpath.basename(path.replace("\\", "/"))
    for suffix in (CTX_SUFFIX, ".onnx"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


_LEFT = " (left in "


def left_id(action_id: str, folder: str) -> str:
    """The journal id of what ``action_id`` left in ``folder`` when a changed
    ``[workspace]`` put its outputs elsewhere (``planning.moves``): never an id of the
    graph, so an orphaned action's."""
    return f"{action_id}{_LEFT}{folder})"


def is_left(record_id: str) -> bool:
    """Whether ``record_id`` names outputs an action left behind (``left_id``)."""
    return _LEFT in record_id and record_id.endswith(")")


ACTIVATION_TYPES = ("uint8", "uint16", "int8", "int16")
"""What a quantization's ``activations`` takes: ONNX Runtime's ``QuantType`` names, lower-case."""
WEIGHT_TYPES = ("uint8", "int8", "uint16", "int16", "uint4", "int4")
"""What a quantization's ``weights`` takes."""
CALIBRATION_METHODS = ("minmax", "entropy", "percentile", "distribution")
"""What a quantization's ``method`` takes: ONNX Runtime's ``CalibrationMethod`` names."""

GENERATE_TIMEOUT = 600.0
"""Seconds one ``verify --generate`` generation (a package's or its source's, every
prompt) may take by default (``--timeout``)."""

PROGRESS_NAME = ".progress"
"""A running job's progress (``37/128 samples``), in its staging directory: a job writes it
(whole, by rename) and the building process shows it (``engine.progress``)."""
