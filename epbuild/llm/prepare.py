"""What an LLM's static preparation makes (the prepare kind, ``kinds.prepare``, runs it):
its graphs in session order, their format version, and the default ``op_affinity.json``
that every LLM action compiles with unless its provider names its own. Standard library
only."""

from __future__ import annotations

import json
import os

from epbuild.fs import atomic_write_bytes

PREP_FORMAT = 1
"""Bump when ``epbuild.llm.static`` writes other graphs from the same inputs."""
STAGES = (("context", None), ("iterator", 1))
"""The graphs, in session order, and their sequence (None: ``window_size``)."""
AFFINITY = "op_affinity.json"
AFFINITY_JSON = {"op_type": {"GroupQueryAttention": "htp"}}
"""The QNN option file every LLM action compiles with unless its provider names its own."""


def write_affinity(path: str) -> None:
    """Write the default ``op_affinity`` file at ``path`` (atomically; parents made)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, json.dumps(AFFINITY_JSON).encode())
