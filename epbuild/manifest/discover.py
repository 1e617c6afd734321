"""Find the models under a directory and group them, for ``epbuild init --from DIR``.

Models that reference the same external-data file (read with ``onnx.proto``, without
importing onnx) form one weight-sharing group: they were exported together, and compiling
them as one session group gives one shared context binary. Every other model goes into a
group per directory. A directory holding ``genai_config.json`` is an onnxruntime-genai
model folder: it becomes an LLM entry, and its ONNX files no group's. EPContext models
(``*_ctx.onnx``, or any model with EPContext nodes), hidden directories and the output and
state directories are skipped.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path

from epbuild._dataclass import dataclass
from epbuild._names import CTX_SUFFIX, DEFAULT_OUT_DIR, DEFAULT_STATE_DIR, model_stem
from epbuild.fs import reference_problem
from epbuild.llm.genai_schema import GENAI_CONFIG, LlmSourceError
from epbuild.llm.source import LlmSource, read_source
from epbuild.onnx.proto import ProtoError, read_model

__all__ = ["Discovered", "FoundGroup", "FoundLlm", "discover"]


@dataclass(frozen=True)
class FoundGroup:
    """A group to write: its name, models (relative to the workspace) and, for a sharing
    group, the external-data files its models share."""

    name: str
    models: tuple[str, ...]
    shared_data: tuple[str, ...] = ()

    @property
    def share_weights(self) -> bool:
        """Whether the models share weights (one session group)."""
        return bool(self.shared_data)


@dataclass(frozen=True)
class FoundLlm:
    """An onnxruntime-genai model folder to write as ``[llms.NAME]``."""

    name: str
    folder: str
    """Relative to the workspace."""
    source: LlmSource


@dataclass(frozen=True)
class Discovered:
    """What was found: the groups, the LLM folders, and a line for each file or folder
    left out and why."""

    groups: tuple[FoundGroup, ...]
    skipped: tuple[str, ...]
    llms: tuple[FoundLlm, ...] = ()


def discover(root: str, source: str) -> Discovered:
    """Group the ``*.onnx`` under ``source`` (a directory relative to ``root``, the
    workspace) into sharing groups and per-directory groups, in path order."""
    data_of: dict[str, set[str]] = {}
    skipped: list[str] = []
    genai: list[str] = []
    for model in _onnx_files(root, source, genai):
        refs = _external_data(root, model)
        if isinstance(refs, str):
            skipped.append(f"{model}: {refs}")
        else:
            data_of[model] = refs
    components = _sharing_components(data_of)
    names: set[str] = set()
    sharing: list[FoundGroup] = []
    lone: dict[str, list[str]] = {}
    for models in components:
        if len(models) > 1:
            shared = sorted(set.intersection(*(data_of[m] for m in models)) or data_of[models[0]])
            name = _unique(model_stem(shared[0]).split(".")[0] or "shared", names)
            sharing.append(FoundGroup(name, tuple(models), tuple(shared)))
        else:
            lone.setdefault(posixpath.dirname(models[0]), []).append(models[0])
    per_dir = [
        FoundGroup(_unique(_dir_name(d), names), tuple(ms)) for d, ms in sorted(lone.items())
    ]
    llms = []
    for folder in genai:
        try:
            found = read_source(Path(root, folder))
        except LlmSourceError as exc:
            skipped.append(f"{folder}: {exc.message}")
            continue
        llms.append(FoundLlm(_unique(_dir_name(posixpath.basename(folder)), names), folder, found))
    groups = tuple(sorted(sharing + per_dir, key=lambda g: g.models))
    return Discovered(groups, tuple(skipped), tuple(llms))


def _onnx_files(root: str, source: str, genai: list[str]) -> Iterator[str]:
    """``*.onnx`` under ``source``, workspace-relative, sorted; skipping the output and
    state directories, hidden directories and ``*_ctx.onnx``. A genai model folder is
    appended to ``genai`` instead, and nothing under it is listed."""
    excluded = {DEFAULT_OUT_DIR, DEFAULT_STATE_DIR}
    for directory, dirs, files in os.walk(os.path.join(root, source)):
        rel_dir = posixpath.normpath(os.path.relpath(directory, root).replace(os.sep, "/"))
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and posixpath.normpath(f"{rel_dir}/{d}") not in excluded
        )
        if GENAI_CONFIG in files:
            genai.append(rel_dir)
            dirs[:] = []
            continue
        for name in sorted(files):
            if name.endswith(".onnx") and not name.endswith(CTX_SUFFIX):
                yield posixpath.normpath(f"{rel_dir}/{name}")


def _external_data(root: str, model: str) -> set[str] | str:
    """The workspace-relative external-data files ``model`` references, or why it is
    left out (unreadable, an EPContext model, a reference leaving the workspace)."""
    try:
        info = read_model(os.path.join(root, model))
    except (OSError, ProtoError) as exc:
        return f"not a readable ONNX model ({exc})"
    if info.context_nodes:
        return "already an EPContext model"
    files = set()
    for ref in info.external_refs:
        problem = reference_problem(ref.location)
        if problem is not None:
            return f"external-data location {problem}"
        files.add(posixpath.normpath(posixpath.join(posixpath.dirname(model), ref.location)))
    return files


def _sharing_components(data_of: dict[str, set[str]]) -> list[list[str]]:
    """Models connected by a shared external-data file, each component in path order."""
    parent = {m: m for m in data_of}

    def find(m: str) -> str:
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    owner: dict[str, str] = {}
    for model in sorted(data_of):
        for data in data_of[model]:
            first = owner.setdefault(data, model)
            parent[find(model)] = find(first)
    components: dict[str, list[str]] = {}
    for model in sorted(data_of):
        components.setdefault(find(model), []).append(model)
    return list(components.values())


def _dir_name(directory: str) -> str:
    """A group name for the models of ``directory`` (``main`` for the workspace itself)."""
    if directory in ("", "."):
        return "main"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", directory.replace("/", "-")).lstrip("._-") or "main"


def _unique(name: str, taken: set[str]) -> str:
    """``name``, made a valid group name and unlike any in ``taken`` (which it joins)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip("._-") or "group"
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}-{n}", n + 1
    taken.add(candidate)
    return candidate
