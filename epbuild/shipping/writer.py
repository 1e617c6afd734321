"""Writing a package directory: atomically, incrementally, never over a user's files.

Every run writing one package directory holds one lock, ``.<name>.epbuild.lock`` in the
directory's *real* parent, whatever spelling of the path (a symlinked parent, another
workspace) it was given. The new package is assembled in a temporary sibling
(``.<name>.epbuild-new-<pid>-<host>-<random>``), then swapped in: with
``renameat2(RENAME_EXCHANGE)`` where the kernel has it (one atomic step), else by renaming the
old package aside (``…epbuild-old-…``) and the new one in; if that second rename fails, the
old package is renamed back. A reader sees the old package or the new one, never a mix.
Temporary siblings are removed only by the run that made them, or by a later run once their
maker is provably dead (its pid, on this host, is gone); an old package a killed run left
aside is put back when nothing took its place. After the swap, the run checks (under the
lock) that the directory holds exactly what it wrote before it reports success.

Files are hard links wherever possible: a file the old package already holds with the same
size and sha256 keeps its inode; a new one is linked from the output directory; a copy
(another filesystem) is hashed and checked. A package whose files and manifests would all
stay the same is left untouched. Only a directory holding epbuild's deployment manifest (or
an empty one) is ever replaced, and only when it holds nothing but what that manifest lists
(``force`` replaces one holding other files too).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable

from epbuild._dataclass import dataclass, field
from epbuild.errors import StorageError, UnsafePathError, VerificationError
from epbuild.fs import digest_file, os_error_hint, os_error_text, remove_tree, replace_directory
from epbuild.shipping.contents import DEPLOY_NAME, ORT_MANIFEST_NAME, PackagedFile
from epbuild.state import locks

_TEMP_MARK = ".epbuild-"
"""Temporary siblings are ``.<name>.epbuild-<kind>-<pid>-<host>-<random>``."""
_TEMP_RE = re.compile(r"(new|old)-(\d+)-(?:([0-9a-f]{8})-)?[0-9a-f]{8}")
LOCK_MARK = ".epbuild.lock"
"""The lock beside a package directory ``<name>`` is ``.<name>.epbuild.lock``."""
NO_EXCHANGE_ENV = "EPBUILD_NO_RENAME_EXCHANGE"
"""Set to ``1``: swap by two renames, as where the kernel lacks ``RENAME_EXCHANGE``."""
_SHOWN_EXTRA = 5
"""How many unlisted files a refusal names."""


@dataclass
class WriteStats:
    """What writing a package did with its files."""

    kept: list[str] = field(default_factory=list)
    """Files the old package already had (same inode)."""
    linked: list[str] = field(default_factory=list)
    """Files hard-linked from the output directory."""
    copied: list[str] = field(default_factory=list)
    """Files copied (the output directory is on another filesystem)."""
    unchanged: bool = False
    """The package was already exactly this: nothing was written."""
    removed: list[str] = field(default_factory=list)
    """Files the old package held that its deployment manifest did not list (``force``)."""


@dataclass(frozen=True)
class _Wanted:
    """What a package directory is to hold: ``files`` (from the workspace at ``root``) and
    the ``generated`` manifests."""

    root: str
    files: list[PackagedFile]
    generated: dict[str, bytes]

    def source(self, f: PackagedFile) -> str:
        """Where ``f`` comes from: its output in the workspace."""
        return os.path.join(self.root, f.source)


def old_package(dest: str) -> dict[str, tuple[int, str]] | None:
    """The files (size, sha256) of the epbuild package at ``dest``; None when there is none.
    Refuses a destination epbuild must not replace (``UnsafePathError``)."""
    shown = os.path.basename(dest.rstrip(os.sep)) or dest
    if os.path.islink(dest):
        raise UnsafePathError(
            f"package directory {shown} is a symlink", hint="give a real directory"
        )
    if not os.path.lexists(dest):
        return None
    if not os.path.isdir(dest):
        raise UnsafePathError(f"package directory {shown} exists and is not a directory")
    if not os.listdir(dest):
        return None
    try:
        with open(os.path.join(dest, DEPLOY_NAME), "rb") as f:
            doc = json.loads(f.read())
        files = doc["files"]
        return {str(p): (int(v["size"]), str(v["sha256"])) for p, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UnsafePathError(
            f"{shown} is not empty and is not an epbuild package (no readable {DEPLOY_NAME}); "
            "epbuild replaces only packages it wrote",
            hint="give a new or empty directory with -o, or remove that one yourself",
        ) from None


def unlisted(dest: str, listed: set[str]) -> list[str]:
    """Entries under ``dest`` that are neither ``listed`` files, the two manifests nor a
    folder on the way to one: the user's (folders end with ``/``). Symlinks are not followed."""
    ours = listed | {DEPLOY_NAME, ORT_MANIFEST_NAME}
    folders = {"/".join(p.split("/")[:i]) for p in ours for i in range(1, p.count("/") + 1)}
    found: list[str] = []
    for top, dirs, names in os.walk(dest):
        rel = os.path.relpath(top, dest).replace(os.sep, "/")
        prefix = "" if rel == "." else rel + "/"
        for d in list(dirs):
            path = prefix + d
            if os.path.islink(os.path.join(top, d)) or path not in folders:
                found.append(path if os.path.islink(os.path.join(top, d)) else path + "/")
                dirs.remove(d)  # never descend into the user's folders or through links
        found.extend(prefix + n for n in names if prefix + n not in ours)
    return sorted(found)


def lock_path(dest: str) -> str:
    """The lock every run writing ``dest`` holds: beside it, in its parent's real path."""
    parent, name = os.path.split(os.path.abspath(dest).rstrip(os.sep))
    return os.path.join(os.path.realpath(parent), f".{name}{LOCK_MARK}")


def write_package(
    dest: str,
    root: str,
    files: list[PackagedFile],
    generated: dict[str, bytes],
    before_swap: Callable[[], None] = lambda: None,
    *,
    force: bool = False,
    lock_timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> WriteStats:
    """Make ``dest`` hold exactly ``files`` (from the workspace at ``root``) and the
    ``generated`` manifests, holding ``dest``'s lock (``lock_path``); ``before_swap`` may
    still refuse (raise) once the new package is assembled. ``force`` also replaces a package
    directory holding files its deployment manifest does not list."""
    parent = os.path.dirname(os.path.abspath(dest).rstrip(os.sep))
    what = f"epbuild package into {dest}"
    try:
        old_package(dest)  # refuse what is not epbuild's before leaving a lock beside it
        os.makedirs(parent, exist_ok=True)
        with locks.hold(lock_path(dest), what, timeout=lock_timeout, on_wait=on_wait):
            return _write_locked(dest, _Wanted(root, files, generated), before_swap, force)
    except OSError as exc:  # the lock, the old package or a leftover could not be read
        through_file, _ = os_error_hint(exc, root)  # "-o epbuild.toml/x": not "File exists"
        raise StorageError(
            f"cannot write the package: {through_file or os_error_text(exc, parent)}",
            hint="choose another package directory (-o DIR)"
            if through_file
            else "check permissions and free space; the old package is unchanged",
        ) from exc


def _write_locked(
    dest: str, wanted: _Wanted, before_swap: Callable[[], None], force: bool
) -> WriteStats:
    parent, name = os.path.split(os.path.abspath(dest).rstrip(os.sep))
    _remove_leftovers(parent, name)
    old = old_package(dest)
    extra = unlisted(dest, set(old)) if old is not None else []
    if extra and not force:
        shown = ", ".join(extra[:_SHOWN_EXTRA])
        more = f" and {len(extra) - _SHOWN_EXTRA} more" if len(extra) > _SHOWN_EXTRA else ""
        raise UnsafePathError(
            f"package directory {dest} holds {len(extra)} file(s) its {DEPLOY_NAME} does "
            f"not list: {shown}{more}; epbuild replaces the whole directory",
            hint="move them out of the package directory (keep your own files beside it), "
            "or pass --force to delete them",
        )
    if old is not None and not extra and _unchanged(dest, wanted, old):
        return WriteStats(kept=[f.path for f in wanted.files], unchanged=True)
    new = os.path.join(parent, f".{name}{_TEMP_MARK}new-{_owner_tag()}")
    try:
        stats = _assemble(new, dest, wanted, old or {})
        stats.removed = extra
        before_swap()
        _swap(new, dest)
    finally:
        remove_tree(new)
    _check_written(dest, wanted)
    return stats


def _owner_tag() -> str:
    """``<pid>-<host>-<random>``: whose temporary sibling this is."""
    return f"{os.getpid()}-{_host_tag()}-{uuid.uuid4().hex[:8]}"


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _owner_dead(pid: int, host: str | None) -> bool:
    """Whether the process that made a temporary sibling is provably gone: it ran on this
    host and no process has its pid (a live or unknown owner keeps its files)."""
    if (host is not None and host != _host_tag()) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _remove_leftovers(parent: str, name: str) -> None:
    """Temporary siblings whose makers died (under the lock, so no live epbuild run is
    writing ``name``): a new package half made is removed; an old package a run set aside
    before it died is put back if nothing took its place, else removed. Anything else named
    like them is not epbuild's to touch."""
    prefix = f".{name}{_TEMP_MARK}"
    dest = os.path.join(parent, name)
    for entry in sorted(os.listdir(parent)):
        found = _TEMP_RE.fullmatch(entry[len(prefix) :]) if entry.startswith(prefix) else None
        if found is None or not _owner_dead(int(found.group(2)), found.group(3)):
            continue
        path = os.path.join(parent, entry)
        if found.group(1) == "old" and not os.path.lexists(dest):
            try:
                os.rename(path, dest)
                continue
            except OSError:
                pass  # left where it is: the error that follows names the directory
        remove_tree(path)


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _check_written(dest: str, wanted: _Wanted) -> None:
    """Refuse to report a package written when ``dest`` does not hold it (a writer that
    ignores the lock replaced or emptied it meanwhile)."""
    try:
        with open(os.path.join(dest, DEPLOY_NAME), "rb") as fh:
            same = fh.read() == wanted.generated[DEPLOY_NAME]
    except OSError:
        same = False
    files = wanted.files
    missing = next((f.path for f in files if _size(os.path.join(dest, f.path)) != f.size), None)
    if not same or missing is not None:
        raise StorageError(
            f"the package at {dest} was changed by another process while it was written"
            + (f" ({missing} is missing or differs)" if missing else ""),
            hint="stop the other writer, then package again",
        )


def _keeps(dest: str, f: PackagedFile, old: dict[str, tuple[int, str]], source: str) -> bool:
    """Whether the old package's copy of ``f`` is ``f``: the same inode as the verified
    output, or the same size and sha256 as recorded and on disk."""
    there = os.path.join(dest, f.path)
    if old.get(f.path) != (f.size, f.sha256) or not os.path.isfile(there) or os.path.islink(there):
        return False
    if os.path.samefile(there, source):
        return True
    return os.path.getsize(there) == f.size and digest_file(there).sha256 == f.sha256


def _unchanged(dest: str, wanted: _Wanted, old: dict[str, tuple[int, str]]) -> bool:
    for path, data in wanted.generated.items():
        try:
            with open(os.path.join(dest, path), "rb") as fh:
                if fh.read() != data:
                    return False
        except OSError:
            return False
    if not all(_keeps(dest, f, old, wanted.source(f)) for f in wanted.files):
        return False
    present = {
        os.path.relpath(os.path.join(d, n), dest).replace(os.sep, "/")
        for d, _, names in os.walk(dest)
        for n in names
    }
    return present == {f.path for f in wanted.files} | set(wanted.generated)


def _assemble(new: str, dest: str, wanted: _Wanted, old: dict[str, tuple[int, str]]) -> WriteStats:
    stats = WriteStats()
    os.mkdir(new)
    for f in wanted.files:
        target = os.path.join(new, f.path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        source = wanted.source(f)
        if _keeps(dest, f, old, source):
            os.link(os.path.join(dest, f.path), target)
            stats.kept.append(f.path)
            continue
        try:
            if _try_link(source, target):
                stats.linked.append(f.path)
            else:
                _copy_checked(source, target, f)
                stats.copied.append(f.path)
        except FileNotFoundError:
            if os.path.lexists(source):
                raise
            raise VerificationError(
                f"{f.source} was removed while it was packaged (another epbuild cleaned or "
                "rebuilt its action meanwhile); the old package is unchanged",
                hint="run 'epbuild status', build, then package again",
            ) from None
    for path, data in wanted.generated.items():
        with open(os.path.join(new, path), "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    return stats


def _try_link(source: str, target: str) -> bool:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            return False
        raise
    return True


def _copy_checked(source: str, target: str, f: PackagedFile) -> None:
    shutil.copyfile(source, target)
    got = digest_file(target)
    if (got.size, got.sha256) != (f.size, f.sha256):
        raise VerificationError(
            f"{f.source} changed while it was packaged (sha256 {got.sha256[:12]}…, recorded "
            f"{f.sha256[:12]}…)",
            hint="run 'epbuild status', build, then package again",
        )


def _swap(new: str, dest: str) -> None:
    """Put ``new`` at ``dest`` (the old package set aside under a name `_remove_leftovers`
    knows, should this process die half-way)."""
    aside = new.replace(f"{_TEMP_MARK}new-", f"{_TEMP_MARK}old-")
    exchange = os.environ.get(NO_EXCHANGE_ENV) != "1"
    replace_directory(new, dest, aside=aside, exchange=exchange, what="package")
