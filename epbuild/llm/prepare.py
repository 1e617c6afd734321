"""The static preparation as a planned step: where an LLM's prepared graphs live, keyed by
what they are made from, and making them (once, under a lock, atomically) in a child
process, so that the compile actions that read them go through the ordinary machinery.

Prepared graphs live in ``<state_dir>/llm/<name>/<key>/`` (``context.onnx``,
``iterator.onnx``, their external data, and the default ``op_affinity.json``). The key holds
the source decoder's digests (and its external data's), ``window_size``,
``context_length``, ``head_size`` and the preparation's format: a change of any of them
names other files, so the compile actions see other models; an edit of the source's
``genai_config.json`` that does not change ``head_size`` (search options, token ids) keys
nothing. Standard library only: the child imports onnx.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import sys
from collections.abc import Mapping

from epbuild.errors import ModelError
from epbuild.fs import new_directory
from epbuild.state import locks

PREP_FORMAT = 1
"""Bump when ``epbuild.llm.static`` writes other graphs from the same inputs."""
STAGES = (("context", None), ("iterator", 1))
"""The graphs, in session order, and their sequence (None: ``window_size``)."""
AFFINITY = "op_affinity.json"
AFFINITY_JSON = {"op_type": {"GroupQueryAttention": "htp"}}
"""The QNN option file every LLM action compiles with unless its provider names its own."""


def prep_key(source_digests: Mapping[str, str], window: int, context: int, head_size: int) -> str:
    """The content key of one LLM's prepared graphs."""
    blob = json.dumps(
        {
            "format": PREP_FORMAT,
            "inputs": dict(source_digests),
            "window_size": window,
            "context_length": context,
            "head_size": head_size,
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def prep_dir(state_dir: str, name: str, key: str) -> str:
    """Workspace-relative folder of the prepared graphs."""
    return posixpath.join(state_dir, "llm", name, key)


def ensure_prepared(
    root: str,
    folder: str,
    *,
    model: str,
    window: int,
    context: int,
    head_size: int,
    lock_timeout: float | None = None,
) -> None:
    """Make ``folder`` (workspace-relative) from the source decoder ``model`` unless it
    exists; two builds at once make it once. Raises ``ModelError`` with the reason."""
    final = os.path.join(root, folder)
    if os.path.isdir(final):
        return
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    what = "epbuild build (preparing an LLM)"
    with locks.hold(final + ".lock", what, timeout=lock_timeout or 600.0):
        if os.path.isdir(final):
            return
        prefix = f".prep-{os.path.basename(final)}-"
        for name in os.listdir(parent):  # a killed run's (this key's lock is ours)
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        temp = os.path.join(parent, f"{prefix}{os.getpid()}")
        with new_directory(final, temp=temp) as tmp:
            args = {
                "model": os.path.join(root, model),
                "out": tmp,
                "window": window,
                "context": context,
                "head_size": head_size,
            }
            proc = subprocess.run(
                [sys.executable, "-I", "-m", "epbuild.llm.prepare_child"],
                input=json.dumps(args),
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                last = lines[-1] if lines else f"exit {proc.returncode}"
                raise ModelError(
                    f"{model}: static preparation failed: {last}",
                    hint="epbuild prepares decoders as genai's model builder writes them",
                )
            write_affinity(os.path.join(tmp, AFFINITY))


def write_affinity(path: str) -> None:
    """Write the default ``op_affinity`` file at ``path`` (atomically; parents made)."""
    from epbuild.fs import atomic_write_bytes

    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, json.dumps(AFFINITY_JSON).encode())
