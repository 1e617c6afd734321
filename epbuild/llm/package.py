"""The genai package of a built LLM: ``<out_dir>/<llm>/<provider>/`` holds the compiled
``context``/``iterator`` ctx models (or a pipeline source's compiled stages: the compile
actions' outputs) and the package action's (``kinds.package``): the ``genai_config.json``
of type ``decoder-pipeline`` (relative file names) made here from the source's, and the
source's other files genai needs (tokenizer, chat template, a pipeline's stages that run as
they are), copied. Standard library only.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable
from typing import Any

from epbuild._dataclass import dataclass
from epbuild._names import CTX_SUFFIX
from epbuild.fs import reference_problem
from epbuild.llm.genai_config import (
    CONTEXT,
    EMBEDDINGS,
    ITERATOR,
    pipeline_config,
    stages_config,
)
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.llm.parts import EMBEDDING_FILES, PARTS_JSON, part_name, part_stages
from epbuild.llm.source import PIPELINE, static_stages
from epbuild.manifest.model import Llm
from epbuild.onnx.proto import read_external_refs
from epbuild.providers.contract import ProviderConfig

GENAI_PROVIDER = {"qnn": "qnn"}
"""Adapter → the ``provider_options`` key genai selects its EP by."""


def genai_options(cfg: ProviderConfig, file_options: Iterable[str]) -> dict[str, dict[str, str]]:
    """The provider's options in genai's form, without the compile-time files."""
    name = GENAI_PROVIDER.get(cfg.ep, cfg.ep)
    skip = set(file_options)
    return {name: {k: v for k, v in sorted(cfg.options.items()) if k not in skip}}


@dataclass(frozen=True)
class PackagePlan:
    """What a package's files must hold, read from the source folder now."""

    config: bytes
    """The package's ``genai_config.json``."""
    copies: dict[str, str]
    """Package file name → the workspace-relative source file it is a copy of."""


def package_plan(
    root: str,
    llm: Llm,
    provider: ProviderConfig,
    file_options: Iterable[str],
    prepared: str = "",
) -> PackagePlan:
    """The package's config, and the source files it copies as they are (tokenizer files,
    templates, a pipeline's CPU stages and their external data; for a decoder in parts,
    the ``embeddings`` stage from ``prepared``, the workspace-relative folder of its
    preparation)."""
    source = os.path.join(root, llm.source)
    with open(os.path.join(source, GENAI_CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    options = genai_options(provider, file_options)
    copied: list[str] = []
    if llm.form == PIPELINE:
        compiled = {stage: stage + CTX_SUFFIX for stage, _ in static_stages(source, llm.stages)}
        package = stages_config(config, compiled=compiled, provider_options=options)
        copied = _stage_files(source, [f for s, f in llm.stages if s not in compiled])
    elif llm.parts == 1:
        package = pipeline_config(
            config,
            files={CONTEXT: CONTEXT + CTX_SUFFIX, ITERATOR: ITERATOR + CTX_SUFFIX},
            provider_options=options,
            context_length=llm.context_length,
            window_size=llm.window_size,
        )
    else:
        package, embedding = _parts_config(root, llm, config, options, prepared)
    names = [*_companions(source, llm.files), *copied]
    copies = {name: posixpath.join(llm.source, name) for name in names}
    if llm.form != PIPELINE and llm.parts > 1:
        copies.update({name: posixpath.join(prepared, name) for name in embedding})
    return PackagePlan((json.dumps(package, indent=4) + "\n").encode(), copies)


def _parts_config(
    root: str,
    llm: Llm,
    config: dict[str, Any],
    options: dict[str, dict[str, str]],
    prepared: str,
) -> tuple[dict[str, Any], list[str]]:
    """The config of a decoder in parts (each stage's inputs and outputs as the
    preparation's ``parts.json`` lists them), and the CPU stage's files it copies."""
    folder = os.path.join(root, prepared)
    with open(os.path.join(folder, PARTS_JSON), encoding="utf-8") as f:
        described = json.load(f)
    io = {stage: (found["inputs"], found["outputs"]) for stage, found in described.items()}
    if list(io) != [EMBEDDINGS, *(part_name(i) for i in range(1, llm.parts + 1))]:
        raise ValueError(f"{prepared}/{PARTS_JSON} does not list the {llm.parts} parts")
    embedding = EMBEDDING_FILES[0]
    files = {EMBEDDINGS: embedding} | {s: s + CTX_SUFFIX for s, _ in part_stages(llm.parts)}
    package = pipeline_config(
        config,
        files=files,
        provider_options=options,
        context_length=llm.context_length,
        window_size=llm.window_size,
        parts=io,
    )
    return package, _stage_files(folder, [embedding])


def _stage_files(source: str, models: list[str]) -> list[str]:
    """The pipeline stages run as they are (CPU stages) and their external-data files."""
    found: list[str] = []
    for model in models:
        found.append(model)
        for ref in read_external_refs(os.path.join(source, model)):
            problem = reference_problem(ref.location)
            if problem is not None:
                raise ValueError(f"{model}: external-data location {problem}")
            data = posixpath.normpath(posixpath.join(posixpath.dirname(model), ref.location))
            if data not in found:
                found.append(data)
    return found


def source_files(root: str, llm: Llm) -> list[str]:
    """Workspace-relative paths of the source files ``package_plan`` reads (the config,
    the companions and a pipeline's copied stages), whether or not they exist now."""
    return [posixpath.join(llm.source, n) for n in (GENAI_CONFIG, *_copied(root, llm))]


def _copied(root: str, llm: Llm) -> list[str]:
    """Names of the files copied from the source folder as they are."""
    source = os.path.join(root, llm.source)
    try:
        names = _companions(source, llm.files)
        if llm.form == PIPELINE:
            compiled = {stage for stage, _ in static_stages(source, llm.stages)}
            names += _stage_files(source, [f for s, f in llm.stages if s not in compiled])
    except (OSError, ValueError):
        return []
    return names


def package_files(root: str, llm: Llm, out_dir: str) -> list[str]:
    """Workspace-relative paths of the files ``write_package`` writes (config and
    companions), whether or not they exist now."""
    names = [GENAI_CONFIG, *_copied(root, llm)]
    if llm.form != PIPELINE and llm.parts > 1:
        names += EMBEDDING_FILES
    return [posixpath.join(out_dir, n) for n in names]


def _companions(source: str, models: Iterable[str]) -> list[str]:
    """The source folder's plain files genai reads besides the ONNX models it names (and
    their external data) and the config: tokenizer files, templates, processor configs."""
    skip = {GENAI_CONFIG, *models}
    return sorted(
        name
        for name in os.listdir(source)
        if name not in skip
        and not name.startswith(".")
        and not name.endswith((".onnx", ".onnx.data", ".data"))
        and os.path.isfile(os.path.join(source, name))
    )
