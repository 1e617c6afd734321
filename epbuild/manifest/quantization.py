"""The ``[quantization.<name>]`` tables and the groups that name them (``quantize = ...``):
calibration and validation samples found here (globs and folders expanded, in order), types
checked against the providers of every group that uses the table, so that a recipe epbuild
cannot build ends in one message naming the manifest's line and key."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Collection
from pathlib import Path
from typing import Any

from epbuild.llm.prompts import PROMPT_SUFFIX, PromptError, read_prompts
from epbuild.manifest.expand import is_pattern
from epbuild.manifest.locate import Where
from epbuild.manifest.model import Group, QuantCheck, Quantization
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig

SAMPLE_SUFFIXES = (".npz", ".npy")
"""Sample files: an ``.npz`` of the model's inputs by name, an ``.npy`` of its one input."""
TEST_DATA_PREFIX = "test_data_set_"
"""An ONNX test-data folder (the ONNX model zoo's): ``test_data_set_N/input_K.pb``."""
QUANTIZED = "quantized"
"""The folder of a group's QDQ models: ``<out_dir>/<group>/quantized/``."""


def load_quantization(
    where: Where,
    root: Path,
    tables: dict[str, Any],
    excluded: tuple[str, ...],
    text: Collection[str] = (),
) -> dict[str, Quantization]:
    """Every ``[quantization.*]`` table, validated against the schema already; samples are
    never looked for inside ``excluded`` (the output and state directories). The tables
    named in ``text`` (an ``[llms]`` entry's) take text prompts instead: ``.txt`` files,
    each read now (``llm.prompts``)."""
    found = {}
    for name, table in tables.items():
        base = ("quantization", name)
        prompts = name in text
        calibration, listed = _samples(
            where, root, (*base, "calibration"), table, excluded, prompts
        )
        validation: tuple[str, ...] = ()
        if "validation" in table:
            validation, more = _samples(
                where, root, (*base, "validation"), table, excluded, prompts
            )
            listed = (*listed, *(d for d in more if d not in listed))
        check = table.get("check", {})
        found[name] = Quantization(
            name=name,
            calibration=calibration,
            activations=table.get("activations", "uint8"),
            weights=table.get("weights", "uint8"),
            per_channel=table.get("per_channel", False),
            method=table.get("method", "minmax"),
            exclude=tuple(dict.fromkeys(table.get("exclude", []))),
            overrides=dict(table.get("overrides", {})),
            validation=validation,
            check=QuantCheck(
                min_sqnr_db=float(check.get("min_sqnr_db", QuantCheck.min_sqnr_db)),
                top1=check.get("top1"),
            ),
            listed=listed,
            text=prompts,
        )
    return found


def check_quantized_groups(
    where: Where,
    groups: dict[str, Group],
    tables: dict[str, Quantization],
    providers: dict[str, ProviderConfig],
) -> None:
    """Each group's ``quantize`` names a table, its providers take one kind of quantization
    (``BaseProvider.quantization``) and the table's types, and none of them is named like
    the folder of the QDQ models."""
    for name, group in groups.items():
        if group.quantize is None:
            continue
        at = ("groups", name, "quantize")
        recipe = tables.get(group.quantize)
        if recipe is None:
            defined = ", ".join(tables) or "none"
            raise where.error(
                at,
                f"no [quantization.{group.quantize}] table",
                f"add one with its calibration samples (defined: {defined})",
            )
        if recipe.text:
            raise where.error(
                at,
                f"[quantization.{group.quantize}] calibrates an [llms] entry on text prompts; "
                "a group's models need samples of their inputs",
                "give the group a [quantization] table of its own",
            )
        if QUANTIZED in group.providers:
            raise where.error(
                ("groups", name, "providers"),
                f"a provider named {QUANTIZED!r} would write into the folder of the group's "
                "quantized models",
                "rename the provider",
            )
        _check_providers(where, name, group, recipe, providers)


def _check_providers(
    where: Where,
    name: str,
    group: Group,
    recipe: Quantization,
    providers: dict[str, ProviderConfig],
) -> None:
    """The group's providers take one kind of quantization, and the recipe's types."""
    adapters = {p: get_provider(providers[p].ep) for p in group.providers}
    kinds = {a.quantization for a in adapters.values()}
    if len(kinds) > 1:
        raise where.error(
            ("groups", name, "quantize"),
            "its providers need different quantization ("
            + ", ".join(f"{p}: {a.quantization}" for p, a in adapters.items())
            + "); one quantized model feeds every provider of a group",
            "put the providers in groups of their own, one per kind",
        )
    for p, adapter in adapters.items():
        refused = adapter.refuse_quantization(
            recipe.activations, recipe.weights, recipe.per_channel, recipe.overrides
        )
        if refused is not None:
            key, why, hint = refused
            raise where.error(
                ("quantization", recipe.name, key),
                f"provider {p!r} ({providers[p].ep}) cannot run it: {why} (group {name!r} "
                "compiles for it)",
                hint,
            )


def _samples(
    where: Where,
    root: Path,
    at: tuple[str, ...],
    table: dict[str, Any],
    excluded: tuple[str, ...],
    prompts: bool = False,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The samples one key names, in order, and the folders whose listing decided them
    (``prompts``: text prompts files, each read and checked now)."""
    raw = table[at[-1]]
    entries = [raw] if isinstance(raw, str) else list(raw)
    samples: list[str] = []
    listed: list[str] = []
    for i, entry in enumerate(entries):
        here = at if isinstance(raw, str) else (*at, f"[{i}]")
        rel = where.relpath(here, entry, "a sample")
        if any(rel == d or rel.startswith(d + "/") for d in excluded):
            raise where.error(
                here,
                f"{entry!r} is inside epbuild's own directories ({', '.join(excluded)})",
                "keep calibration samples beside the models",
            )
        if prompts:
            found, folders = _expand_text(where, here, root, rel, excluded)
        else:
            found, folders = _expand(root, rel, excluded)
        if not found:
            raise where.error(
                here,
                f"{entry!r} names no .txt files of prompts"
                if prompts
                else f"{entry!r} names no samples",
                _PROMPTS_HINT
                if prompts
                else "give .npz files (arrays named after the model's inputs), .npy files (a "
                "single-input model) or ONNX test-data folders (test_data_set_N/input_K.pb); "
                "paths are relative to the manifest",
            )
        samples.extend(s for s in found if s not in samples)
        listed.extend(d for d in folders if d not in listed)
    return tuple(samples), tuple(listed)


def _expand(root: Path, rel: str, excluded: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The samples ``rel`` names (a glob, a folder or a file) and the folders listed."""
    if is_pattern(rel):
        import glob

        head = rel.partition("*")[0].partition("?")[0].partition("[")[0]
        base = posixpath.dirname(head)
        folders = [base or "."]
        if "**" in rel:
            folders = [
                posixpath.relpath(d, root).replace(os.sep, "/") for d, _, _ in os.walk(root / base)
            ]
        found = []
        for match in sorted(glob.glob(rel, root_dir=str(root), recursive=True)):
            match = posixpath.normpath(match.replace(os.sep, "/"))
            if any(match == d or match.startswith(d + "/") for d in excluded):
                continue
            if _is_test_data(root / match):
                found.append(match)
                folders.append(match)
            elif match.endswith(SAMPLE_SUFFIXES) and (root / match).is_file():
                found.append(match)
        return found, folders
    full = root / rel
    if not full.is_dir():
        named = full.is_file() and rel.endswith(SAMPLE_SUFFIXES)
        return ([rel] if named or not full.exists() else []), []  # a missing one: its key says
    if _is_test_data(full):
        return [rel], [rel]
    names = sorted(os.listdir(full))
    sets = [n for n in names if n.startswith(TEST_DATA_PREFIX) and _is_test_data(full / n)]
    if sets:
        return [posixpath.join(rel, n) for n in sets], [
            rel,
            *(posixpath.join(rel, n) for n in sets),
        ]
    files = [n for n in names if n.endswith(SAMPLE_SUFFIXES) and (full / n).is_file()]
    return [posixpath.join(rel, n) for n in files], [rel]


def _expand_text(
    where: Where, at: tuple[str, ...], root: Path, rel: str, excluded: tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """The prompts files ``rel`` names (a glob, a folder or a file), each one readable,
    UTF-8 and holding a prompt, and the folders listed."""
    if is_pattern(rel):
        import glob

        head = rel.partition("*")[0].partition("?")[0].partition("[")[0]
        folders = [posixpath.dirname(head) or "."]
        if "**" in rel:
            folders = [
                posixpath.relpath(d, root).replace(os.sep, "/")
                for d, _, _ in os.walk(root / folders[0])
            ]
        matches = sorted(glob.glob(rel, root_dir=str(root), recursive=True))
        found = [posixpath.normpath(m.replace(os.sep, "/")) for m in matches]
        found = [
            m
            for m in found
            if m.endswith(PROMPT_SUFFIX)
            and not any(m == d or m.startswith(d + "/") for d in excluded)
        ]
    elif (root / rel).is_dir():
        folders = [rel]
        found = [
            posixpath.join(rel, n)
            for n in sorted(os.listdir(root / rel))
            if n.endswith(PROMPT_SUFFIX) and (root / rel / n).is_file()
        ]
    else:
        folders, found = [], [rel]
    for file in found:
        try:
            read_prompts(str(root / file), file)
        except PromptError as exc:
            raise where.error(at, exc.message, _PROMPTS_HINT) from exc
    return found, folders


_PROMPTS_HINT = (
    "an [llms] entry calibrates on text: .txt files in UTF-8, one prompt a line, relative "
    "to the manifest"
)


def _is_test_data(path: Path) -> bool:
    """Whether ``path`` is an ONNX test-data folder (holds ``input_K.pb`` files)."""
    try:
        return path.is_dir() and any(
            n.startswith("input_") and n.endswith(".pb") for n in os.listdir(path)
        )
    except OSError:
        return False


def sample_files(root: str, sample: str) -> list[str]:
    """The files one sample is read from, workspace-relative: itself, or a test-data
    folder's ``input_K.pb`` files in K order."""
    full = os.path.join(root, sample)
    if not os.path.isdir(full):
        return [sample]
    names = [n for n in os.listdir(full) if n.startswith("input_") and n.endswith(".pb")]
    return [posixpath.join(sample, n) for n in sorted(names, key=_input_index)]


def _input_index(name: str) -> tuple[int, str]:
    digits = name[len("input_") : -len(".pb")]
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)
