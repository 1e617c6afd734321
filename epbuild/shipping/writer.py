"""Writing a package directory: atomically, incrementally, never over a user's directory.

The new package is assembled in a temporary directory beside the destination, then swapped
in: with ``renameat2(RENAME_EXCHANGE)`` where the kernel has it (one atomic step), else by
renaming the old package aside and the new one in. A reader sees the old package or the new
one, never a mix; a crash leaves one of them (and a temporary directory the next run
removes). Files are hard links wherever possible: a file the old package already holds with
the same size and sha256 keeps its inode; a new one is linked from the output directory; a
copy (another filesystem) is hashed and checked. A package whose files and manifests would
all stay the same is left untouched. Only a directory holding epbuild's deployment manifest
(or an empty one) is ever replaced.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from epbuild.errors import StorageError, UnsafePathError, VerificationError
from epbuild.fs import digest_file, os_error_text, remove_tree
from epbuild.shipping.contents import DEPLOY_NAME, PackagedFile
from epbuild.state import locks

_TEMP_MARK = ".epbuild-"
"""Temporary siblings are ``.<name>.epbuild-<kind>-<pid>-<random>``."""


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


def write_package(
    dest: str,
    root: str,
    files: list[PackagedFile],
    generated: dict[str, bytes],
    lock_path: str,
    before_swap: Callable[[], None] = lambda: None,
) -> WriteStats:
    """Make ``dest`` hold exactly ``files`` (from the workspace at ``root``) and the
    ``generated`` manifests, holding the lock at ``lock_path``; ``before_swap`` may still
    refuse (raise) once the new package is assembled."""
    parent, name = os.path.split(os.path.abspath(dest).rstrip(os.sep))
    os.makedirs(parent, exist_ok=True)
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with locks.hold(lock_path, "epbuild package"):
        _remove_leftovers(parent, name)
        old = old_package(dest)
        if old is not None and _unchanged(dest, root, files, generated, old):
            return WriteStats(kept=[f.path for f in files], unchanged=True)
        new = os.path.join(parent, f".{name}{_TEMP_MARK}new-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            stats = _assemble(new, dest, root, files, generated, old or {})
            before_swap()
            _swap(new, dest)
        except OSError as exc:
            raise StorageError(
                f"cannot write the package: {os_error_text(exc, parent)}",
                hint="check permissions and free space; the old package is unchanged",
            ) from exc
        finally:
            remove_tree(new)
        return stats


def _remove_leftovers(parent: str, name: str) -> None:
    """Temporary directories of earlier runs that died (we hold the lock: none is live)."""
    prefix = f".{name}{_TEMP_MARK}"
    for entry in os.listdir(parent):
        if entry.startswith(prefix):
            remove_tree(os.path.join(parent, entry))


def _keeps(dest: str, f: PackagedFile, old: dict[str, tuple[int, str]], source: str) -> bool:
    """Whether the old package's copy of ``f`` is ``f``: the same inode as the verified
    output, or the same size and sha256 as recorded and on disk."""
    there = os.path.join(dest, f.path)
    if old.get(f.path) != (f.size, f.sha256) or not os.path.isfile(there) or os.path.islink(there):
        return False
    if os.path.samefile(there, source):
        return True
    return os.path.getsize(there) == f.size and digest_file(there).sha256 == f.sha256


def _unchanged(
    dest: str,
    root: str,
    files: list[PackagedFile],
    generated: dict[str, bytes],
    old: dict[str, tuple[int, str]],
) -> bool:
    for path, data in generated.items():
        try:
            with open(os.path.join(dest, path), "rb") as fh:
                if fh.read() != data:
                    return False
        except OSError:
            return False
    if not all(_keeps(dest, f, old, os.path.join(root, f.source)) for f in files):
        return False
    present = {
        os.path.relpath(os.path.join(d, n), dest).replace(os.sep, "/")
        for d, _, names in os.walk(dest)
        for n in names
    }
    return present == {f.path for f in files} | set(generated)


def _assemble(
    new: str,
    dest: str,
    root: str,
    files: list[PackagedFile],
    generated: dict[str, bytes],
    old: dict[str, tuple[int, str]],
) -> WriteStats:
    stats = WriteStats()
    os.mkdir(new)
    for f in files:
        target = os.path.join(new, f.path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        source = os.path.join(root, f.source)
        if _keeps(dest, f, old, source):
            os.link(os.path.join(dest, f.path), target)
            stats.kept.append(f.path)
        elif _try_link(source, target):
            stats.linked.append(f.path)
        else:
            _copy_checked(source, target, f)
            stats.copied.append(f.path)
    for path, data in generated.items():
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
    """Put ``new`` at ``dest``; whatever was at ``dest`` ends up at ``new`` (or is gone)."""
    if not os.path.lexists(dest):
        os.rename(new, dest)
        return
    if _exchange(new, dest):
        return
    aside = new.replace(f"{_TEMP_MARK}new-", f"{_TEMP_MARK}old-")
    os.rename(dest, aside)
    os.rename(new, dest)
    remove_tree(aside)


def _exchange(a: str, b: str) -> bool:
    """Atomically exchange two paths (Linux ``renameat2``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b, a)
