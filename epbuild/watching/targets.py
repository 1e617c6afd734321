"""What a manifest makes watch observe: the selected actions' inputs, the manifest, the
directories its model globs could match in, the source folders of its LLMs (any file there:
genai_config.json, ONNX, external data, tokenizer), the calibration samples of their
quantizations (a quantized group's samples, a quantized LLM's prompts files) and the folders
whose listing decided them, and what never counts (outputs, state, cache)."""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from epbuild._dataclass import dataclass, field
from epbuild.cache.location import resolve
from epbuild.errors import EpbuildError
from epbuild.llm.package import source_files
from epbuild.manifest.quantization import sample_files
from epbuild.planning.llms import LlmGroup
from epbuild.planning.workspace import open_workspace

if TYPE_CHECKING:
    from epbuild.manifest.load import Manifest
    from epbuild.manifest.model import Group, Quantization
    from epbuild.planning.actions import CompileAction
    from epbuild.planning.workspace import Workspace

GLOB_CHARS = re.compile(r"[*?\[]")
"""A path part with one of these is a glob."""
Sig = tuple[int, int, int, int]
"""(inode, size, mtime_ns, ctime_ns) of a file: the change time sees a rewrite whose mtime
was put back (``touch -r``), as the stat cache does for inputs."""


def under(path: str, top: str) -> bool:
    """Is ``path`` ``top`` or inside it?"""
    return path == top or path.startswith(top + os.sep)


def glob_match(rel: str, pattern: str) -> bool:
    """Does workspace-relative ``rel`` match a manifest glob (``*``, ``?``, ``[..]``, ``**``)?

    Like :func:`glob.glob`, a wildcard does not match a name that starts with a dot, so
    editors' and exporters' hidden temp files never count.
    """

    def match(parts: list[str], pats: list[str]) -> bool:
        if not pats:
            return not parts
        if pats[0] == "**":
            return any(match(parts[i:], pats[1:]) for i in range(len(parts) + 1)) and all(
                not p.startswith(".") for p in parts[: len(parts) - len(pats) + 1]
            )
        if not parts:
            return False
        name, pat = parts[0], pats[0]
        if name.startswith(".") and not pat.startswith(".") and GLOB_CHARS.search(pat):
            return False
        return fnmatchcase(name, pat) and match(parts[1:], pats[1:])

    return match(rel.split("/"), posixpath.normpath(pattern).split("/"))


def signature(path: str) -> Sig | None:
    """The file's (inode, size, mtime_ns, ctime_ns), or None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Targets:
    """What one manifest makes us watch; every path absolute unless said otherwise."""

    root: str
    manifest: str
    files: frozenset[str]
    """Inputs of the selected actions, plus the manifest."""
    patterns: tuple[str, ...]
    """The manifest's model globs (workspace-relative)."""
    excluded: tuple[str, ...]
    """Output, state and cache directories: never a trigger."""
    dirs: frozenset[tuple[str, bool]]
    """(directory, recursive) to observe."""
    inputs: dict[str, frozenset[str]]
    """Action id -> its workspace-relative inputs (models and external data)."""
    links: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """The real path of an input reached through a symlink -> the input paths that lead to
    it: its directory is observed too, and an event there counts as one on those paths."""
    folders: Mapping[str, str] = field(default_factory=dict)
    """An LLM's source folder (absolute) -> the LLM's name: a file directly in it (not a
    hidden one) is an input of the LLM's actions, and its genai_config.json is read by the
    manifest."""
    listed: frozenset[str] = frozenset()
    """The folders whose listing decided the selected actions' calibration samples (a glob's,
    a folder's): a (non-hidden) file coming or going there may change the samples, so the
    manifest is read again."""

    def in_folder(self, path: str) -> bool:
        """Is ``path`` a (non-hidden) file directly in an LLM's source folder?"""
        return os.path.dirname(path) in self.folders and not os.path.basename(path).startswith(".")

    def in_listed(self, path: str) -> bool:
        """Is ``path`` a (non-hidden) file directly in a folder that lists samples?"""
        return os.path.dirname(path) in self.listed and not os.path.basename(path).startswith(".")

    def names(self, path: str) -> frozenset[str]:
        """The watched paths an event on ``path`` is about (itself, or the symlinks to it)."""
        return self.links.get(path, frozenset()) | {path}

    def rel(self, path: str) -> str:
        """Workspace-relative POSIX form of an absolute path."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def wants(self, path: str, is_dir: bool) -> bool:
        """Is an event on ``path`` worth waking up for?"""
        if not under(path, self.root) or any(under(path, x) for x in self.excluded):
            return False
        if not is_dir:
            if path in self.files or self.in_folder(path) or self.in_listed(path):
                return True
            return any(glob_match(self.rel(path), p) for p in self.patterns)
        # a directory created, deleted or moved: a watched one (or its parent) came or went,
        # or a recursive glob may now match inside it
        return any(under(d, path) or (rec and under(path, d)) for d, rec in self.dirs)


def _tree(base: str, excluded: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Watches covering ``base`` recursively, leaving the excluded directories out."""
    if any(under(base, x) for x in excluded):
        return []
    if not any(under(x, base) for x in excluded):
        return [(base, True)]
    out = [(base, False)]
    try:
        children = [e.path for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except OSError:
        children = []
    for child in sorted(children):
        out += _tree(child, excluded)
    return out


def make_targets(
    m: Manifest, selectors: list[str] | tuple[str, ...], previous: Targets | None = None
) -> Targets:
    """Work out the inputs of the selected actions and which directories to observe."""
    ws = open_workspace(m.root, None, selectors, loaded=m)
    root = str(m.root)
    folders: dict[str, str] = {}
    inputs = _action_inputs(ws, root, folders, previous)
    manifest = os.path.abspath(m.path)
    files = {manifest} | {os.path.join(root, p) for s in inputs.values() for p in s}

    wsc = m.workspace
    excluded = [wsc.out_dir, wsc.state_dir]
    cache = resolve(None, base=root, manifest_value=wsc.cache, manifest_root=root)
    if cache is not None:
        excluded.append(cache.local)
    excl = tuple(os.path.normpath(os.path.join(root, x)) for x in excluded)
    # An LLM's prepared graphs are inputs made by the build (in the state directory): never
    # a trigger, so not watched.
    files = {f for f in files if f == manifest or not any(under(f, x) for x in excl)}
    dirs: set[tuple[str, bool]] = {(os.path.dirname(f), False) for f in files}
    listed = {
        os.path.normpath(os.path.join(root, folder))
        for recipe in _recipes(m, ws.actions)
        for folder in recipe.listed
    }
    listed = {d for d in listed if not any(under(d, x) for x in excl)}
    dirs |= {(d, False) for d in listed}
    links: dict[str, set[str]] = {}
    for f in files:
        real = os.path.realpath(f)
        if real != f:
            links.setdefault(real, set()).add(f)
            dirs.add((os.path.dirname(real), False))
    patterns = tuple(p for g in m.groups.values() for p in g.patterns)
    for pat in patterns:
        parts = pat.split("/")
        first = next(i for i, p in enumerate(parts) if GLOB_CHARS.search(p))
        base = os.path.join(root, *parts[:first]) if first else root
        if first == len(parts) - 1:
            dirs.add((base, False))
        else:
            dirs.update(_tree(base, excl))
    return Targets(
        root,
        manifest,
        frozenset(files),
        patterns,
        excl,
        frozenset(dirs),
        inputs,
        {real: frozenset(paths) for real, paths in links.items()},
        folders,
        frozenset(listed),
    )


def _action_inputs(
    ws: Workspace, root: str, folders: dict[str, str], previous: Targets | None
) -> dict[str, frozenset[str]]:
    """Each selected action's input files: its models, their external data (what
    ``previous`` knew of a model missing or half-written now) and an LLM's sources."""
    externals: dict[tuple[str, str | None], set[str]] = {}
    inputs: dict[str, frozenset[str]] = {}
    samples: dict[str, frozenset[str]] = {}
    for action in ws.actions:
        mine = _llm_inputs(action, root, folders) | samples_of(ws.manifest, action.group, samples)
        folder = action.compile.external_data_folder
        for model in action.models:
            if (model, folder) not in externals:
                try:
                    externals[model, folder] = set(ws.keys.model_inputs(model, folder)[1])
                except EpbuildError:  # missing or half-written: keep what we knew
                    old = previous.inputs.get(action.id, frozenset()) if previous else set()
                    externals[model, folder] = {p for p in old if p not in action.models}
            mine |= {model, *externals[model, folder]}
        inputs[action.id] = frozenset(mine)
    return inputs


def _llm_inputs(action: CompileAction, root: str, folders: dict[str, str]) -> set[str]:
    """The source files of an LLM action (its folder joins ``folders``); none for others."""
    group = action.group
    if not isinstance(group, LlmGroup) or group.llm is None:
        return set()
    folders[os.path.join(root, group.llm.source)] = group.llm.name
    return {*group.source_inputs, *source_files(root, group.llm)}


def recipe_of(m: Manifest, group: Group) -> Quantization | None:
    """The ``[quantization.<name>]`` that quantizes the models of ``group`` (a quantized
    group's, a quantized LLM's); None when they are compiled as they are."""
    if isinstance(group, LlmGroup):
        llm = m.llms.get(group.name)
        name = llm.quantize if llm is not None else None
    else:
        found = m.groups.get(group.name)
        name = found.quantize if found is not None else None
    return m.quantization.get(name) if name is not None else None


def samples_of(
    m: Manifest, group: Group, memo: dict[str, frozenset[str]] | None = None
) -> frozenset[str]:
    """The workspace-relative calibration samples the quantization of ``group`` reads (a
    test-data folder with its ``input_K.pb`` files); none for a group compiled as it is.
    ``memo`` keeps each recipe's across the calls of one pass (a recipe may have thousands
    of samples, and hundreds of actions)."""
    recipe = recipe_of(m, group)
    if recipe is None:
        return frozenset()
    if memo is not None and recipe.name in memo:
        return memo[recipe.name]
    found = set(recipe.calibration)
    for sample in recipe.calibration:
        try:
            found.update(sample_files(str(m.root), sample))
        except OSError:  # a folder going away: its files are gone too
            pass
    if memo is not None:
        memo[recipe.name] = frozenset(found)
    return frozenset(found)


def _recipes(m: Manifest, actions: list[CompileAction]) -> list[Quantization]:
    """The quantizations of the selected actions, each once."""
    found: dict[str, Quantization] = {}
    for action in actions:
        recipe = recipe_of(m, action.group)
        if recipe is not None:
            found[recipe.name] = recipe
    return list(found.values())
