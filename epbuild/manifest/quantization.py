"""The ``[quantization.<name>]`` tables and the groups that name them (``quantize = ...``):
calibration and validation samples found here (globs and folders expanded, in order), types
checked against the providers of every group that uses the table, so that a recipe epbuild
cannot build ends in one message naming the manifest's line and key."""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any

from epbuild.llm.prompts import PROMPT_SUFFIX, PromptError, read_prompts
from epbuild.manifest.expand import is_pattern
from epbuild.manifest.globwalk import FILE, FOLDER, OTHER, folder_kinds, glob_kinds
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
            listed = tuple(dict.fromkeys((*listed, *more)))
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
                min_token_agreement=float(
                    check.get("min_token_agreement", QuantCheck.min_token_agreement)
                ),
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
    for p in adapters:
        check_provider_runs(where, recipe, p, providers[p], f"group {name!r}")


def check_provider_runs(
    where: Where, recipe: Quantization, name: str, config: ProviderConfig, user: str
) -> None:
    """Provider ``name`` takes the recipe's types (its adapter's ``refuse_quantization``);
    ``user``: what compiles for it, as the message names it (``group 'g'``, ``llms.x``)."""
    refused = get_provider(config.ep).refuse_quantization(
        recipe.activations, recipe.weights, recipe.per_channel, recipe.overrides
    )
    if refused is not None:
        key, why, hint = refused
        raise where.error(
            ("quantization", recipe.name, key),
            f"provider {name!r} ({config.ep}) cannot run it: {why} ({user} compiles for it)",
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
    """The samples one key names, in order, each once, and the folders whose listing
    decided them (dicts keep the order: a list's ``in`` made 40,000 samples take minutes;
    ``prompts``: text prompts files, each read and checked now)."""
    raw = table[at[-1]]
    entries = [raw] if isinstance(raw, str) else list(raw)
    samples: dict[str, None] = {}
    listed: dict[str, None] = {}
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
            found, folders, special = _expand(root, rel, excluded)
            if special:
                path, kind = special[0]
                raise where.error(
                    here,
                    f"{path!r} is {kind}, not a regular file",
                    "samples are read from regular files only: replace it with the sample's file "
                    "(a FIFO or a device would never end)",
                )
        if not found and not prompts and rel.endswith(PROMPT_SUFFIX):
            raise where.error(
                here,
                f"{entry!r} names no samples: text prompts, which only an [llms] entry "
                f'calibrates on, and no [llms] entry has quantize = "{at[1]}"',
                f'give the [llms] entry quantize = "{at[1]}", or remove [quantization.{at[1]}] '
                "(a [groups] entry calibrates on .npz, .npy or test-data samples)",
            )
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
        samples.update(dict.fromkeys(found))
        listed.update(dict.fromkeys(folders))
    return tuple(samples), tuple(listed)


def _expand(
    root: Path, rel: str, excluded: tuple[str, ...]
) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """The samples ``rel`` names (a glob, a folder or a file), the folders listed, and the
    special files (FIFOs, devices, links to one) among them, each with what it is."""
    base_dir = str(root)
    found: list[str] = []
    special: list[tuple[str, str]] = []
    if is_pattern(rel):
        folders = _pattern_folders(root, rel)
        for match, kind in glob_kinds(base_dir, rel):
            if any(match == d or match.startswith(d + "/") for d in excluded):
                continue
            _classify(base_dir, match, kind, found, folders, special)
        return found, folders, special
    full = os.path.join(base_dir, rel)
    if not os.path.isdir(full):
        if not os.path.lexists(full):
            return [rel], [], []  # a missing one: its key says
        _classify(base_dir, rel, OTHER, found, [], special, folders_too=False)
        return found, [], special
    if _is_test_data(full):
        _classify(base_dir, rel, FOLDER, found, [], special)
        return found, [rel], special
    names = folder_kinds(full)
    sets = [(n, k) for n, k in names if n.startswith(TEST_DATA_PREFIX) and k == FOLDER]
    sets = [(n, k) for n, k in sets if _is_test_data(os.path.join(full, n))]
    folders = [rel]
    for name, kind in sets or names:
        path = posixpath.join(rel, name)
        _classify(base_dir, path, kind, found, folders, special, folders_too=bool(sets))
    return found, folders, special


def _classify(
    root: str,
    rel: str,
    kind: str,
    found: list[str],
    folders: list[str],
    special: list[tuple[str, str]],
    *,
    folders_too: bool = True,
) -> None:
    """Add ``rel`` (``kind``: what its folder's listing says it is, ``globwalk``'s; OTHER
    when unknown) to ``found`` if it is a sample (a sample file, or with ``folders_too`` a
    test-data folder, then also to ``folders``), or to ``special`` if it is a sample file
    that is no regular file or a test-data folder holding one. A regular file costs
    nothing more; a test-data folder its listing."""
    full = os.path.join(root, rel)
    if kind == FOLDER:
        if folders_too and _is_test_data(full):
            found.append(rel)
            folders.append(rel)
            for name in sample_files(root, rel):
                what = special_kind(os.path.join(root, name))
                if what is not None:
                    special.append((name, what))
        return
    if not rel.endswith(SAMPLE_SUFFIXES):
        return
    if kind == FILE:
        found.append(rel)
        return
    what = special_kind(full)
    if what is None and os.path.isfile(full):
        found.append(rel)
    elif what is not None and what != "a folder":
        special.append((rel, what))


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is where it is no regular file (``a FIFO (named pipe)``, ``a
    character device (through a link)``), None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else _describe(path, mode)


def _describe(path: str | os.PathLike[str], mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    )
    kind = next((what for test, what in kinds if test(mode)), "a special file")
    return kind + (" (through a link)" if os.path.islink(path) else "")


def _pattern_folders(root: Path, pattern: str) -> list[str]:
    """The folders whose listing decides what ``pattern`` matches: the one its fixed head
    names, and for ``**`` every folder below it (walked without following links)."""
    head = pattern.partition("*")[0].partition("?")[0].partition("[")[0]
    base = posixpath.dirname(head)
    if "**" not in pattern:
        return [base or "."]
    return [posixpath.relpath(d, root).replace(os.sep, "/") for d, _, _ in os.walk(root / base)]


def _expand_text(
    where: Where, at: tuple[str, ...], root: Path, rel: str, excluded: tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """The prompts files ``rel`` names (a glob, a folder or a file), each one readable,
    UTF-8 and holding a prompt, and the folders listed."""
    if is_pattern(rel):
        folders = _pattern_folders(root, rel)
        found = [
            m
            for m, kind in glob_kinds(str(root), rel)
            if kind != FOLDER
            and m.endswith(PROMPT_SUFFIX)
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


def _is_test_data(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an ONNX test-data folder (holds ``input_K.pb`` files)."""
    try:
        return os.path.isdir(path) and any(
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
