"""``epbuild add``: edit ``epbuild.toml`` in place, keeping the user's comments and layout.

Every edit is made on a tomlkit document (``manifest.tomledit``), and the edited text is
checked by the real loader (``load_manifest(path, text=...)``) before it atomically
replaces the file: a bad edit raises the loader's own message and leaves the file
byte-identical. Paths given here are relative to ``directory`` (the CLI's ``-C``) and are
written relative to the manifest's directory.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epbuild._names import DEFAULT_STATE_DIR, LOCKS_DIR, state_dir_setting, tomllib
from epbuild.errors import ManifestError, UnsafePathError, UserError
from epbuild.fs import atomic_write_bytes, safe_relpath
from epbuild.manifest.load import find_manifest, load_manifest, read_document
from epbuild.manifest.locate import Locator
from epbuild.manifest.tomledit import (
    add_table,
    append_unique,
    parse_document,
    render_value,
    table_text,
)
from epbuild.providers import known_kinds
from epbuild.providers.qnn import WELL_KNOWN_TARGETS, well_known_target
from epbuild.state import locks

if TYPE_CHECKING:
    from tomlkit import TOMLDocument
    from tomlkit.items import AoT, Array, Table

    from epbuild.manifest.model import Manifest

__all__ = ["EditResult", "add_models", "add_provider", "add_target", "write_checked"]

_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class EditResult:
    """What an edit did: one line per change, one per thing left alone, and whether the
    file was written (nothing is written when there was nothing to change)."""

    path: str
    changes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def written(self) -> bool:
        """Whether the manifest was rewritten."""
        return bool(self.changes)


@dataclass
class _Session:
    """One edit under way: the file, its bytes as read, the document, the parsed data the
    edited text must parse to (``data``: every edit applies itself to it too) and what
    changed."""

    path: Path
    before: bytes
    doc: TOMLDocument
    data: dict[str, Any]
    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    appended: list[str] = field(default_factory=list)

    def table(self, family: str, name: str) -> Table | None:
        """``[family.name]`` when the manifest has it."""
        parent = self.doc.get(family)
        value = parent.get(name) if parent is not None else None
        return value

    def names(self, family: str) -> list[str]:
        """Names of the family's tables, in file order."""
        return list(self.data.get(family) or {})

    def line_of(self, family: str, name: str) -> str:
        """``epbuild.toml:7`` for a table of the file as read."""
        line = Locator(self.before.decode("utf-8")).line((family, name))
        return f"{self.path}:{line}" if line else str(self.path)

    def add_table(
        self, family: str, name: str, values: dict[str, Any], comment: str | None = None
    ) -> None:
        """A new ``[family.name]``: placed in the document where its form allows, else
        appended at the end of the file."""
        if not add_table(self.doc, family, name, values, comment):
            self.appended.append(table_text(family, name, values, comment))
        self.data.setdefault(family, {})[name] = values

    def text(self) -> str:
        """The edited text, in the file's line endings."""
        text = _dumps(self.doc)
        for table in self.appended:
            text = text.rstrip("\n") + "\n\n" + table + "\n"
        raw = self.before.decode("utf-8")
        if "\r\n" in raw and raw.count("\n") == raw.count("\r\n"):  # a CRLF file stays one
            text = re.sub(r"(?<!\r)\n", "\r\n", text)
        return text

    def finish(self, check: Sequence[str] = ()) -> EditResult:
        """Validate and write (when anything changed); ``check``: models that must exist."""
        if self.changes:
            text = self.text()
            if _parsed(text) != self.data:
                raise UserError(
                    f"cannot edit {self.path} in place: the way it is written would make the "
                    "edit change other keys; nothing written",
                    hint="write each provider and group as a [providers.NAME] / "
                    "[groups.NAME] table, or make this edit by hand",
                )
            write_checked(self.path, self.before, text, check)
        return EditResult(str(self.path), tuple(self.changes), tuple(self.notes))


def _parsed(text: str) -> dict[str, Any] | None:
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError):
        return None


@contextmanager
def _editing(
    directory: str | os.PathLike[str], manifest: str | os.PathLike[str] | None
) -> Iterator[_Session]:
    """The manifest opened for one edit, under the manifest lock: two edits at once take
    turns (each reads what the other wrote), so neither is lost."""
    from tomlkit.exceptions import TOMLKitError

    path = find_manifest(directory, os.fspath(manifest) if manifest else None)
    with manifest_lock(path, "epbuild add"):
        s = _open(path)
        try:
            yield s
        except TOMLKitError as exc:  # a layout tomlkit cannot edit: nothing was written
            raise UserError(
                f"cannot edit {path} in place ({exc}); nothing written",
                hint="write each provider and group as a [providers.NAME] / [groups.NAME] "
                "table, or make this edit by hand",
            ) from exc


@contextmanager
def manifest_lock(path: Path, what: str) -> Iterator[None]:
    """The lock every edit of the manifest at ``path`` holds from reading (or finding it
    missing) to writing: ``add``, ``init`` and ``init --from`` take turns on one file."""
    with locks.hold(_lock_path(path), what):
        yield


def _lock_path(manifest: Path) -> str:
    """The lock edits of ``manifest`` take, in its workspace's state directory (the default
    one where the manifest names none that can be used)."""
    root = os.path.dirname(os.path.realpath(manifest))
    data = _parsed((_read_or_none(str(manifest)) or b"").decode("utf-8", "replace"))
    name = state_dir_setting(data or {})
    try:
        name = safe_relpath(name, what="state_dir") if isinstance(name, str) else None
    except UserError:
        name = None
    return os.path.join(root, name or DEFAULT_STATE_DIR, LOCKS_DIR, "manifest.lock")


def _open(path: Path) -> _Session:
    """Read the manifest for an edit: a file the loader refuses (invalid TOML, a key of the
    wrong type) is not edited, with the loader's message."""
    before = path.read_bytes()
    try:
        text = before.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError("is not UTF-8 text", file=str(path)) from exc
    try:
        data = read_document(path, text)
    except ManifestError as exc:
        raise UserError(f"{exc.message}; fix this first (nothing written)", hint=exc.hint) from exc
    return _Session(path, before, parse_document(path, text), data)


def _dumps(doc: TOMLDocument) -> str:
    import tomlkit

    return tomlkit.dumps(doc)


def write_checked(
    path: Path, before: bytes | None, text: str, models: Sequence[str] = ()
) -> Manifest:
    """Check ``text`` with the loader as the manifest at ``path``, then write it atomically.

    ``before``: the bytes the edit started from (the file must still hold them; None: the
    file must not exist). ``models``: paths the edit added, which must exist. A refusal
    leaves the file as it was.
    """
    try:
        loaded = load_manifest(path, text=text)
        for model in models:
            _check_source(loaded, model)
    except ManifestError as exc:
        _refuse_already_broken(path, before, exc)
        raise UserError(f"{_without_line(exc)}; {path} left unchanged", hint=exc.hint) from exc
    target = os.path.realpath(path)  # a symlinked manifest: edit the file it points to
    now = _read_or_none(target)
    if now != before:
        what = "was created" if before is None else "changed"
        raise UserError(
            f"{path} {what} while it was being edited; nothing written",
            hint="run the command again",
        )
    mode = stat.S_IMODE(os.stat(target).st_mode) if before is not None else None
    atomic_write_bytes(target, text.encode("utf-8"), mode=mode, leftovers=True)
    return loaded


def _refuse_already_broken(path: Path, before: bytes | None, exc: ManifestError) -> None:
    """Say so when the file as it is has the error the edited text has: the edit did not
    cause it (the message then names the line of the file as it is)."""
    if before is None:
        return
    try:
        load_manifest(path, text=before.decode("utf-8"))
    except ManifestError as old:
        if _without_line(old) == _without_line(exc):
            raise UserError(
                f"{old.message}; fix this first (nothing written)", hint=old.hint
            ) from exc


def _check_source(loaded: Manifest, model: str) -> None:
    """A model an edit adds exists and is not one of epbuild's own outputs."""
    for what, directory in (
        ("output", loaded.workspace.out_dir),
        ("state", loaded.workspace.state_dir),
    ):
        if model == directory or model.startswith(directory + "/"):
            raise UserError(
                f"{model!r} is inside the {what} directory {directory!r}",
                hint="add the source model; epbuild writes and removes files there",
            )
    if model in loaded.problems:
        raise loaded.problems[model]


def _read_or_none(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None  # missing, or not a file: the caller's own checks say which


def _without_line(exc: ManifestError) -> str:
    """The loader's message without its line number: the line is one of the edited text,
    which was not written."""
    if exc.line is None or not exc.file:
        return exc.message
    numbered = f"{exc.file}:{exc.line}"
    return (
        exc.file + exc.message[len(numbered) :] if exc.message.startswith(numbered) else exc.message
    )


def manifest_relative(directory: str | os.PathLike[str], manifest: Path, value: str) -> str:
    """A path given relative to ``directory`` (or absolute), as the manifest writes it:
    relative to the manifest's directory, POSIX separators. Refuses one outside it."""
    if not value or "\x00" in value:
        raise UserError(f"{value!r} is not a path")
    root = os.path.abspath(manifest.parent)
    full = os.path.abspath(os.path.join(directory, value))
    rel = os.path.relpath(full, root)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise UnsafePathError(
            f"{value!r} is outside the workspace ({root})",
            hint="models must be under the manifest's directory: move or copy the file there "
            "(a symlink inside the workspace pointing to it is fine)",
        )
    return posixpath.normpath(rel.replace(os.sep, "/"))


def add_models(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    models: Sequence[str],
    group: str | None = None,
    providers: Sequence[str] = (),
    share_weights: bool = False,
    quantize: str | None = None,
) -> EditResult:
    """Add models to a group, creating the group when it does not exist; ``quantize`` names
    the ``[quantization.*]`` recipe the group's models are quantized with.

    ``models`` are relative to ``directory`` (globs allowed). An existing group's
    ``models`` list gets the ones it lacks (a model it lists, or one of its patterns
    matches, is skipped and said so); ``providers`` are added to its list. A new group
    needs ``providers``, or the manifest's only provider.
    """
    if not models:
        raise UserError("no model given", hint="epbuild add model PATH... --group NAME")
    with _editing(directory, manifest) as s:
        wanted = list(dict.fromkeys(_entry(directory, s.path, m) for m in models))
        name = group or _only(s, "groups", "--group", "the group to add to")
        table = s.table("groups", name)
        if table is None:
            _new_group(s, name, wanted, providers, share_weights)
            added = wanted
        else:
            added = _extend_group(s, name, table, wanted, providers, share_weights)
        if quantize is not None and s.data["groups"][name].get("quantize") != quantize:
            s.table("groups", name)["quantize"] = quantize  # type: ignore[index]
            s.data["groups"][name]["quantize"] = quantize
            s.changes.append(f"group {name} is now quantized with {quantize}")
        return s.finish(check=[m for m in added if not any(c in m for c in _GLOB_CHARS)])


def _entry(directory: str | os.PathLike[str], manifest: Path, value: str) -> str:
    """A model argument as the manifest lists it: a file that exists is that file (its
    ``*?[`` escaped, so the loader does not read them as a pattern); else a pattern."""
    import glob

    rel = manifest_relative(directory, manifest, value)
    if any(c in rel for c in _GLOB_CHARS) and os.path.isfile(os.path.join(directory, value)):
        return glob.escape(rel)
    return rel


def _new_group(
    s: _Session, name: str, models: list[str], providers: Sequence[str], share: bool
) -> None:
    chosen = list(dict.fromkeys(providers)) or [_only(s, "providers", "--provider", "a provider")]
    values: dict[str, Any] = {"models": models, "providers": chosen}
    if share:
        values["share_weights"] = True
    s.add_table("groups", name, values)
    s.changes.append(f"added group {name} ({len(models)} model(s), for {', '.join(chosen)})")


def _extend_group(
    s: _Session,
    name: str,
    table: Table,
    models: list[str],
    providers: Sequence[str],
    share: bool,
) -> list[str]:
    from tomlkit.items import AoT

    listed = _array(s, table, name, "models")
    data = s.data["groups"][name]
    fresh = []
    for model in models:
        reason = _already_covered(s.path.parent, listed, model)
        if reason:
            s.notes.append(f"skipped {model}: {reason} in group {name}")
        else:
            fresh.append(model)
    for model in _append_models(listed, fresh):
        data["models"].append({"path": model} if isinstance(listed, AoT) else model)
        s.changes.append(f"added {model} to group {name}")
    if providers:
        for p in append_unique(_array(s, table, name, "providers"), providers):
            data["providers"].append(p)
            s.changes.append(f"group {name} is now also built for {p}")
    if share and table.get("share_weights") is not True:
        table["share_weights"] = True
        data["share_weights"] = True
        s.changes.append(f"group {name} now shares weights")
    return fresh


def _append_models(listed: Array | AoT, models: list[str]) -> list[str]:
    """Append to a ``models`` list, or to ``[[groups.NAME.models]]`` tables (``path = ...``)."""
    import tomlkit
    from tomlkit.items import AoT

    if not isinstance(listed, AoT):
        return append_unique(listed, models)
    for model in models:
        entry = tomlkit.table()
        entry["path"] = model
        listed.append(entry)
    return models


def _array(s: _Session, table: Table, group: str, key: str) -> Array | AoT:
    """The group's ``key`` list, to append to (``models`` may be ``[[groups.NAME.models]]``
    tables); an error when it is missing or not a list."""
    from tomlkit.items import AoT, Array

    value = table.get(key)
    if not isinstance(value, (Array, AoT) if key == "models" else Array):
        raise ManifestError(
            "is missing" if value is None else "must be a list",
            file=str(s.path),
            key=f"groups.{group}.{key}",
            hint=f'write e.g. {key} = ["..."] in [groups.{group}]',
        )
    return value


def _already_covered(root: Path, listed: Iterable[Any], model: str) -> str | None:
    """Why ``model`` need not be added to a group listing ``listed``, else None."""
    import glob

    for entry in listed:
        path = entry.get("path") if isinstance(entry, Mapping) else entry
        if not isinstance(path, str):
            continue
        norm = posixpath.normpath(path)
        if norm == model:
            return "already listed"
        if any(c in norm for c in _GLOB_CHARS) and model in {
            posixpath.normpath(p.replace(os.sep, "/"))
            for p in glob.glob(norm, root_dir=root, recursive=True)
        }:
            return f"already matched by {path!r}"
    return None


def _only(s: _Session, family: str, option: str, what: str) -> str:
    """The one table of ``family``; else an error saying to pass ``option``."""
    names = s.names(family)
    if len(names) == 1:
        return names[0]
    if not names and family == "providers":
        raise UserError(
            "the manifest defines no provider",
            hint="add one first: epbuild add target snapdragon-8-gen-3 (or epbuild add "
            "provider NAME --ep qnn --option htp_arch=75 --option soc_model=57)",
        )
    choice = ", ".join(names) if names else "none yet"
    raise UserError(f"pass {option} to name {what}", hint=f"defined {family}: {choice}")


def add_provider(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    name: str,
    ep: str,
    options: Mapping[str, Any] | None = None,
    replace: bool = False,
    toolchain: Mapping[str, Any] | None = None,
) -> EditResult:
    """Add ``[providers.NAME]`` (``ep``, ``options`` and ``toolchain``: ``{"requirements":
    [...]}`` or ``{"python": ...}``); an existing one only with ``replace``, which rewrites
    its ``ep`` and ``options`` and drops its other keys."""
    extra = {"toolchain": dict(toolchain)} if toolchain else {}
    with _editing(directory, manifest) as s:
        _define_provider(
            s, name, ep, dict(options or {}), replace=replace, comment=None, extra=extra
        )
        return s.finish()


def _define_provider(
    s: _Session,
    name: str,
    ep: str,
    options: dict[str, Any],
    *,
    replace: bool,
    comment: str | None,
    extra: Mapping[str, Any] | None = None,
) -> bool:
    """Write the provider (``extra``: further keys, e.g. its toolchain); returns False when
    an identical one exists (nothing to do)."""
    _check_ep(ep)
    values: dict[str, Any] = {"ep": ep, "options": options} if options else {"ep": ep}
    values.update(extra or {})
    existing = s.table("providers", name)
    if existing is None:
        s.add_table("providers", name, values, comment)
        s.changes.append(f"added provider {name} ({ep}{_options_text(options)})")
        return True
    same_extra = all(existing.get(k) == v for k, v in (extra or {}).items())
    if _same_provider(existing, ep, options) and same_extra:
        s.notes.append(f"provider {name} already exists with these options")
        return False
    if not replace:
        raise UserError(
            f"provider {name!r} already exists ({s.line_of('providers', name)})",
            hint="pass --replace to overwrite it, or choose another name",
        )
    import tomlkit

    for key in [k for k in existing if k not in values]:
        del existing[key]
    s.data["providers"][name] = values
    existing["ep"] = ep
    if options:
        existing["options"] = tomlkit.parse(f"v = {_inline(options)}")["v"]
    for key, value in (extra or {}).items():
        existing[key] = tomlkit.parse(f"v = {_inline(value)}")["v"]
    s.changes.append(f"replaced provider {name} ({ep}{_options_text(options)})")
    return True


def _inline(options: Mapping[str, Any]) -> str:
    return render_value(options)


def _options_text(options: Mapping[str, Any]) -> str:
    return "".join(f", {k}={v}" for k, v in options.items())


def _same_provider(table: Table, ep: str, options: Mapping[str, Any]) -> bool:
    """Same EP and the same options as strings (``75`` and ``"75"`` are one value to ORT)."""

    def text(v: Any) -> str:
        return ("1" if v else "0") if isinstance(v, bool) else str(v)

    have = table.get("options") or {}
    if table.get("ep") != ep or set(have) != set(options):
        return False
    return all(text(have[k]) == text(v) for k, v in options.items())


def _check_ep(ep: str) -> None:
    kinds = known_kinds()
    if ep not in kinds:
        raise UserError(
            f"--ep {ep!r} is not a known provider adapter", hint="known: " + ", ".join(kinds)
        )


def add_target(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    target: str,
    ep: str | None = None,
    options: Mapping[str, Any] | None = None,
    to: Sequence[str] = (),
    name: str | None = None,
    replace: bool = False,
) -> EditResult:
    """Compile groups for one more target: define the provider and add it to the groups.

    ``target`` is a well-known SoC (``snapdragon-8-gen-3``, ``sm8650``: QNN with its
    ``htp_arch`` and ``soc_model``, ``options`` on top), or a provider name described by
    ``ep`` and ``options``. The provider is named ``name`` (default ``target``); an
    identical existing provider is reused. ``to``: the groups (default: every group).
    """
    soc = well_known_target(target)
    opts = dict(options or {})
    if soc is not None:
        if ep not in (None, "qnn"):
            raise UserError(f"{target} is a Qualcomm SoC: its provider is qnn, not {ep!r}")
        ep, opts = "qnn", {"htp_arch": soc.htp_arch, "soc_model": soc.soc_model, **opts}
    elif ep is None:
        raise UserError(
            f"{target!r} is not a target epbuild knows",
            hint="known: " + ", ".join(WELL_KNOWN_TARGETS) + "; or describe it: "
            f"epbuild add target {target} --ep qnn --option htp_arch=75 --option soc_model=57",
        )
    with _editing(directory, manifest) as s:
        groups = list(dict.fromkeys(to)) or s.names("groups")
        for group in groups:
            if s.table("groups", group) is None:
                raise UserError(
                    f"group {group!r} is not defined",
                    hint="defined groups: " + (", ".join(s.names("groups")) or "none"),
                )
        provider = name or target
        comment = f"{soc.title}: HTP v{soc.htp_arch}" if soc is not None else None
        _define_provider(s, provider, ep, opts, replace=replace, comment=comment)
        for group in groups:
            table = s.table("groups", group)
            assert table is not None
            if append_unique(_array(s, table, group, "providers"), [provider]):
                s.data["groups"][group]["providers"].append(provider)
                s.changes.append(f"group {group} is now also built for {provider}")
            else:
                s.notes.append(f"group {group} is already built for {provider}")
        if not groups:
            s.notes.append("no groups yet: add models with epbuild add model PATH... --group NAME")
        return s.finish()
