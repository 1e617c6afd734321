"""The filesystem rules: manifest paths stay relative and inside the workspace; epbuild never
writes or deletes through a symlink that leads out of its own directories, nor through any
link inside them (it makes none there); writes are atomic.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from collections import namedtuple
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, BinaryIO

from epbuild.errors import StorageError, UnsafePathError

if TYPE_CHECKING:
    from collections.abc import Callable
    from hashlib import _Hash

_own_sha256: Callable[[], _Hash] | None
try:  # the interpreter's own sha256 (Python 3.12 on: _sha2), which loads no OpenSSL
    from _sha2 import sha256 as _own_sha256  # type: ignore[import-not-found,no-redef]
except ImportError:
    try:
        from _sha256 import sha256 as _own_sha256  # type: ignore[import-not-found,no-redef]
    except ImportError:  # an interpreter built without it: hashlib's alone
        _own_sha256 = None

CHUNK = 1 << 20
"""Files are read in pieces of this size: memory stays flat whatever the model size."""
_own_budget = 1 << 20
"""Bytes left to hash with the interpreter's own sha256. ``hashlib``'s is OpenSSL's,
several times faster, but loading OpenSSL costs about 3 ms, as much as hashing a MiB the
slower way: a process that hashes less (a restore of small models, a status) never loads
it, and one that hashes more loses at most that."""


def new_sha256(size: int) -> _Hash:
    """A sha256 hash object for ``size`` bytes to come: the interpreter's own while
    `_own_budget` lasts, then OpenSSL's (the digest is the same)."""
    global _own_budget
    if size <= _own_budget and _own_sha256 is not None:
        _own_budget -= size  # threads may race here: the budget is a bound, not a count
        return _own_sha256()
    import hashlib

    return hashlib.sha256()


def sha256_hex(data: bytes | memoryview) -> str:
    """The sha256 hex digest of ``data`` (`new_sha256`)."""
    h = new_sha256(len(data))
    h.update(data)
    return h.hexdigest()


class FileDigest(namedtuple("FileDigest", "size sha256 found", defaults=(None,))):
    """A file's size and sha256, and the first of the searched strings it contains (a named
    tuple: this module stays cheap to import, on the fast restore path too; made by
    ``collections``, as ``typing.NamedTuple`` compiles each annotation)."""

    __slots__ = ()
    size: int
    sha256: str
    found: bytes | None


def digest_file(path: str, needles: Sequence[bytes] = ()) -> FileDigest:
    """Hash ``path`` in `CHUNK` pieces, searching for ``needles`` across piece boundaries
    on the way (one read serves both)."""
    size, found = 0, None
    keep = max((len(n) for n in needles), default=1) - 1
    tail = b""
    with open(path, "rb") as f:
        h = new_sha256(os.fstat(f.fileno()).st_size)
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
            if needles and found is None:
                window = tail + chunk
                found = next((n for n in needles if n in window), None)
                tail = window[len(window) - keep :] if keep else b""
    return FileDigest(size, h.hexdigest(), found)


def temp_name(path: str) -> str:
    """A sibling temp path unique to this process and call:
    ``<path>.tmp-<pid>-<host tag>-<random>`` (see `remove_dead_temps`)."""
    return f"{path}.tmp-{os.getpid()}-{_host_tag()}-{os.urandom(4).hex()}"


_host: list[str] = []


def _host_tag() -> str:
    """Eight hex digits naming this host in temp names: on a filesystem several hosts share,
    a temp whose writer runs elsewhere is never taken for a dead one's."""
    if not _host:
        _host.append(sha256_hex(os.uname().nodename.encode())[:8])
    return _host[0]


def remove_dead_temps(path: str) -> None:
    """Remove the temp siblings of ``path`` (`temp_name`) whose writers died on this host: a
    process killed mid-write leaves its temp behind, and nothing else would ever remove it
    from a user's folder. Temps of live processes, other hosts and other names are kept."""
    directory, name = os.path.split(path)
    prefix = f"{name}.tmp-"
    try:
        entries = [e for e in os.listdir(directory or ".") if e.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        pid, _, rest = entry[len(prefix) :].partition("-")
        host, _, rand = rest.partition("-")
        if not pid.isdigit() or host != _host_tag() or len(rand) != 8 or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not a file: left alone
            os.unlink(os.path.join(directory, entry))


def _alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (this one included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's
    return True


# -- writing files: the one API ----------------------------------------------------------
#
# Every file epbuild writes appears whole or not at all: it is written under a sibling temp
# name and renamed over the target. ``durable=True`` also fsyncs the file before the rename
# and its directory after it, so the new name survives a power cut; ``durable=False`` is
# for what is cheap to lose (a hint, a result read at once, a copy that is re-checked).


@contextlib.contextmanager
def atomic_output(
    path: str,
    *,
    mode: int | None = None,
    durable: bool,
    within: str | None = None,
    leftovers: bool = False,
) -> Iterator[str]:
    """Yield a sibling temp path to write; on a clean exit it replaces ``path`` (with
    ``mode``, the file gets it before it appears; a link at ``path`` is replaced, never
    followed). On an error ``path`` is as it was and no temp is left behind; an OS error
    about the temp names ``path``. ``within``: the directory epbuild owns that ``path`` is
    in (a cache): a link between it and ``path`` raises `LinkedPathError`. ``leftovers``:
    first remove the temps of earlier writers of ``path`` that were killed
    (`remove_dead_temps`; for a file in a user's folder)."""
    directory = os.path.dirname(path) or "."
    if within is not None:
        refuse_links(within, directory)
    os.makedirs(directory, exist_ok=True)
    if leftovers:
        remove_dead_temps(path)
    tmp = temp_name(path)
    try:
        yield tmp
        if durable:
            _fsync_path(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        # A full disk or a file-size limit: leave the old file as it was and no temp behind.
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            raise OSError(exc.errno, exc.strerror, path) from exc  # name the file meant
        raise
    if durable:
        fsync_dir(directory)


def atomic_write_bytes(
    path: str,
    data: bytes,
    *,
    mode: int | None = None,
    durable: bool = True,
    within: str | None = None,
    leftovers: bool = False,
) -> None:
    """Write ``data`` to ``path``: all or nothing (see `atomic_output`)."""
    with (
        atomic_output(path, mode=mode, durable=durable, within=within, leftovers=leftovers) as tmp,
        open(tmp, "wb") as f,
    ):
        f.write(data)


def atomic_write_text(
    path: str, text: str, *, mode: int | None = None, durable: bool = True
) -> None:
    """Write ``text`` (UTF-8) to ``path``: all or nothing (see `atomic_output`)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode, durable=durable)


def atomic_copy(
    src: str,
    dest: str,
    *,
    mode: int | None = None,
    durable: bool = False,
    within: str | None = None,
) -> None:
    """Copy ``src``'s bytes to ``dest`` (in pieces: a large file is never held in memory):
    all or nothing (see `atomic_output`)."""
    import shutil

    with atomic_output(dest, mode=mode, durable=durable, within=within) as tmp:
        shutil.copyfile(src, tmp)


_FICLONE = 0x40049409  # Linux ioctl: share the source's extents (btrfs, XFS, ...)


def link_or_copy(src: str, dest: str) -> str:
    """Put ``src``'s bytes at the new path ``dest``: a hard link, else a reflink, else a copy;
    says which (``link``, ``reflink``, ``copy``). A missing ``src`` raises
    ``FileNotFoundError``."""
    try:
        os.link(src, dest)
        return "link"
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise
    if _reflink(src, dest):
        return "reflink"
    import shutil

    shutil.copyfile(src, dest)
    return "copy"


def _reflink(src: str, dest: str) -> bool:
    try:
        import fcntl
    except ImportError:  # not on this platform
        return False
    try:
        with open(src, "rb") as s, open(dest, "wb") as d:
            fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
        return True
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest)
        return False


_NOT_IN_KERNEL = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF})
"""``copy_file_range`` errors that mean "not between these files": copy by reading instead."""


def copy_range(src: int, dest: int, start: int, length: int, at: int) -> int:
    """Copy ``length`` bytes of the open file ``src`` from offset ``start`` into ``dest`` at
    offset ``at`` (file descriptors; their positions are not used): in the kernel where it
    can (``copy_file_range``, several times faster than reading and writing the bytes through
    Python), else in pieces of 64 MiB. Returns the bytes copied: fewer than ``length``
    when ``src`` ends before."""
    done = 0
    kernel = hasattr(os, "copy_file_range")
    while done < length:
        if kernel:
            try:
                n = os.copy_file_range(src, dest, length - done, start + done, at + done)
            except OSError as exc:
                if exc.errno not in _NOT_IN_KERNEL:
                    raise
                kernel = False
                continue
        else:
            n = _copy_piece(src, dest, start + done, min(length - done, 64 * CHUNK), at + done)
        if not n:
            break
        done += n
    return done


def same_bytes(a: int, a_at: int, b: int, b_at: int, length: int) -> bool:
    """Whether the open files ``a`` and ``b`` hold the same ``length`` bytes at ``a_at`` and
    ``b_at`` (file descriptors; their positions are not used). Reads, never writes: a
    comparison of two files in the page cache costs a fraction of writing one of them."""
    done = 0
    while done < length:
        size = min(length - done, CHUNK)  # 1 MiB: 3x faster than 16 (the CPU cache)
        piece = read_at(a, size, a_at + done)
        if len(piece) != size or piece != read_at(b, size, b_at + done):
            return False
        done += size
    return True


def zeros(fd: int, at: int, length: int) -> bool:
    """Whether the open file ``fd`` holds ``length`` zero bytes at ``at``."""
    piece = read_at(fd, length, at)
    return len(piece) == length and not piece.strip(b"\0")


def read_at(fd: int, size: int, at: int) -> bytes:
    """Up to ``size`` bytes of the open file ``fd`` at offset ``at`` (fewer at its end)."""
    if hasattr(os, "pread"):
        return os.pread(fd, size, at)
    os.lseek(fd, at, os.SEEK_SET)  # Windows has no pread
    return os.read(fd, size)


def _copy_piece(src: int, dest: int, start: int, size: int, at: int) -> int:
    """Copy up to ``size`` bytes of ``src`` at ``start`` to ``dest`` at ``at`` by reading
    them (any platform); returns how many (0: ``src`` ends at ``start``)."""
    view = memoryview(read_at(src, size, start))
    os.lseek(dest, at, os.SEEK_SET)
    written = 0
    while written < len(view):
        written += os.write(dest, view[written:])
    return written


def fsync_dir(directory: str) -> None:
    """Make the names in ``directory`` durable (a no-op where the platform cannot)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # Windows cannot open a directory; its renames are journaled by NTFS
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def new_directory(final: str, *, temp: str | None = None) -> Iterator[str]:
    """Yield a sibling temp directory (``temp``, by default `temp_name`) to fill; on a clean
    exit it is renamed to ``final``, or dropped when another process made ``final`` first.
    On an error it is removed."""
    tmp = temp if temp is not None else temp_name(final)
    os.makedirs(tmp)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:  # another process made it first
            if not os.path.isdir(final):
                raise
    finally:
        if os.path.lexists(tmp):
            remove_tree(tmp)


def replace_directory(
    new: str, dest: str, *, aside: str, exchange: bool = True, what: str = "directory"
) -> None:
    """Put directory ``new`` at ``dest`` in one step where the platform allows (Linux
    ``renameat2``), else by moving the old one to ``aside`` first; whatever was at
    ``dest`` is removed. On failure ``dest`` holds what it held before."""
    if not os.path.lexists(dest):
        os.rename(new, dest)
        return
    if exchange and _exchange(new, dest):
        remove_tree(new)
        return
    os.rename(dest, aside)
    try:
        os.rename(new, dest)
    except OSError as exc:
        try:
            os.rename(aside, dest)
        except OSError:
            raise StorageError(
                f"cannot write the {what}: {os_error_text(exc)}; the old {what} could not be "
                f"put back either and is at {aside}",
                hint=f"rename {aside} back to {dest}",
            ) from exc
        raise
    remove_tree(aside)


def _exchange(a: str, b: str) -> bool:
    """Atomically exchange two paths (Linux ``renameat2``); False where unsupported."""
    import ctypes

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


def os_error_text(exc: OSError, root: str | None = None) -> str:
    """``path: reason`` of an OS error (``src → dst: reason`` for a rename), with paths
    relative to ``root`` where they are inside it; never a Python repr."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    paths = [p for p in (exc.filename, exc.filename2) if p is not None]
    if not paths:
        return reason
    return " → ".join(_shown(os.fsdecode(p), root) for p in paths) + f": {reason}"


def os_error_hint(exc: OSError, root: str | None = None) -> tuple[str | None, str]:
    """What to say about an OS error no layer expected: a clearer reason where the error's
    own misleads (``File exists`` for a path through a file), and a hint fitting its errno."""
    name = os.fsdecode(exc.filename) if exc.filename is not None else None
    if exc.errno in (errno.EEXIST, errno.ENOTDIR) and name:
        while name and not os.path.isfile(name) and os.path.dirname(name) != name:
            name = os.path.dirname(name)
        if name and os.path.isfile(name):
            shown = _shown(os.path.abspath(name), root)
            return f"{shown} is a file, so nothing can be created under it", "choose another path"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None, "free disk space, or raise the file-size limit (ulimit -f)"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return None, "check the permissions of that path (and that its file system is writable)"
    return None, "check permissions, free space and the file-size limit (ulimit -f)"


def _shown(path: str, root: str | None) -> str:
    if root is not None and os.path.isabs(path):
        rel = os.path.relpath(path, root)
        if rel != ".." and not rel.startswith(".." + os.sep):
            return rel.replace(os.sep, "/")
    return path


# -- links epbuild did not make ------------------------------------------------------------
#
# epbuild makes no symbolic link in the directories it owns: a cache directory, the state
# directory, an output directory. One found there was planted (by another user of a shared
# cache, say) and is damage: named in a warning or an error, never followed. Files there are
# opened with ``O_NOFOLLOW`` (an lstat first where the OS lacks it), trees are walked without
# following links, and a path is refused when a directory between the owned root and it is
# a link. The owned root itself is the user's choice and may be one.

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LinkedPathError(UnsafePathError, OSError):
    """A path inside a directory epbuild owns is (or leads through) a symbolic link epbuild
    did not make: refused, never followed. An ``OSError`` too, so that a cache that cannot be
    used this way is a warning where any unusable cache is, and an ``UnsafePathError`` (exit
    2, naming the link) where it escapes."""

    def __init__(self, path: str) -> None:
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        reason = f"a symbolic link epbuild did not make (to {target}); not followed"
        UnsafePathError.__init__(
            self,
            f"{path} is {reason}",
            hint="remove the link: epbuild makes none in its cache, state and output "
            "directories, and never writes or deletes through one there",
        )
        OSError.__init__(self, errno.ELOOP, reason, path)


def is_link(path: str) -> bool:
    """Whether ``path`` itself is a symbolic link (or a Windows junction)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return _is_link_stat(path, st)


_isjunction = getattr(os.path, "isjunction", None)  # Python 3.12+


def _is_link_stat(path: str, st: os.stat_result) -> bool:
    if stat.S_ISLNK(st.st_mode):
        return True
    return bool(_isjunction is not None and stat.S_ISDIR(st.st_mode) and _isjunction(path))


def refuse_links(root: str, path: str) -> None:
    """Raise `LinkedPathError` for the first symbolic link among the existing components of
    ``path`` below the directory ``root`` (``path`` itself included, ``root`` not: the user
    chose it)."""
    current = root[:-1] if root.endswith(os.sep) else root
    for part in _parts_below(root, path):
        current = f"{current}{os.sep}{part}"
        try:
            st = os.lstat(current)
        except (FileNotFoundError, NotADirectoryError):
            return  # what is missing is made by epbuild, as a directory or by a rename
        if _is_link_stat(current, st):
            raise LinkedPathError(current)


def _parts_below(root: str, path: str) -> list[str]:
    """The components of ``path`` below the directory ``root`` (none for ``root`` itself),
    as ``os.path.relpath`` finds them; ``ValueError`` when ``path`` is not under ``root``.
    On POSIX a test of the absolute paths' prefix: every write and every restored file asks
    it of each directory on its way, and ``relpath`` is most of that."""
    if os.sep != "/":  # Windows compares without case: relpath's rules
        rel = os.path.relpath(path, root)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            raise ValueError(f"{path} is not under {root}")
        return [] if rel == os.curdir else rel.split(os.sep)
    base, full = os.path.abspath(root), os.path.abspath(path)
    if full == base:
        return []
    head = base if base.endswith("/") else base + "/"
    if not full.startswith(head):
        raise ValueError(f"{path} is not under {root}")
    return full[len(head) :].split("/")


def open_nofollow(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a link at ``path`` itself (`LinkedPathError`)."""
    if not _NOFOLLOW and is_link(path):
        raise LinkedPathError(path)
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)
    except OSError as exc:
        # Linux and macOS say ELOOP for a link under O_NOFOLLOW, FreeBSD EMLINK
        if exc.errno in (errno.ELOOP, errno.EMLINK) and is_link(path):
            raise LinkedPathError(path) from None
        raise


def open_read(path: str) -> BinaryIO:
    """Open ``path`` for reading in binary, refusing a link at ``path`` (`LinkedPathError`)."""
    return os.fdopen(open_nofollow(path, os.O_RDONLY), "rb")


def regular_file(root: str, path: str) -> os.stat_result:
    """The stat of ``path``, a regular file reached from ``root`` through no link; raises
    `LinkedPathError` for a link, ``FileNotFoundError`` for anything else that is not a
    regular file there."""
    refuse_links(root, path)
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
    return st


def walk_files(top: str, links: list[str]) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file under the directory ``top`` with its lstat, without following a
    link: each link met (``top`` included) is appended to ``links`` and not entered."""
    if is_link(top):
        links.append(top)
        return
    pending = [top]
    while pending:
        directory = pending.pop()
        try:
            found = os.scandir(directory)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with found:
            for entry in found:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if _is_link_stat(entry.path, st):
                    links.append(entry.path)
                elif stat.S_ISDIR(st.st_mode):
                    pending.append(entry.path)
                elif stat.S_ISREG(st.st_mode):
                    yield entry.path, st


def remove_tree(path: str) -> None:
    """Remove a directory tree without following symlinks out of it."""
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        try:
            os.rmdir(path)  # most often empty (a committed staging directory): no shutil
        except OSError:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def safe_relpath(value: str, *, what: str) -> str:
    """Normalise a manifest path to a POSIX relative path inside the workspace.

    Refuses absolute paths, drive letters, backslashes and ``..`` that climbs out.
    """
    if not value or "\x00" in value:
        raise UnsafePathError(f"{what}: empty or invalid path {value!r}")
    if value.startswith(("/", "\\")) or (len(value) > 1 and value[1] == ":"):
        raise UnsafePathError(
            f"{what}: {value!r} is absolute",
            hint="use a path relative to the manifest's directory",
        )
    if "\\" in value:
        raise UnsafePathError(f"{what}: {value!r} contains a backslash", hint="use '/'")
    norm = posixpath.normpath(value)
    if norm == ".." or norm.startswith("../"):
        raise UnsafePathError(
            f"{what}: {value!r} leaves the workspace",
            hint="keep models and directories inside the manifest's directory "
            "(a symlinked model file is fine)",
        )
    return norm


def reference_problem(value: str) -> str | None:
    """Why a path stored in a model (location, ep_cache_context) is not relative and tame.

    The one spelling of that rule: ``epbuild.onnx.context`` adds "inside the output
    directory, exists" on top; the journal, stat cache and executors use the predicate.
    """
    if not value:
        return "is empty"
    if "\x00" in value:
        return f"{value!r} contains a NUL byte"
    if value.startswith("/") or "\\" in value or (len(value) > 1 and value[1] == ":"):
        return f"{value!r} is absolute (must be relative to the model)"
    if ".." in value.split("/"):
        return f"{value!r} contains '..'"
    return None


def is_safe_reference(value: str) -> bool:
    """Whether a path stored in a model (location, ep_cache_context) is relative and tame
    (``reference_problem`` finds nothing; spelled out here: the journal and the stat cache
    ask it of every path they load)."""
    return (
        bool(value)
        and "\x00" not in value
        and value[0] != "/"
        and "\\" not in value
        and value[1:2] != ":"
        and (".." not in value or ".." not in value.split("/"))
    )


def inside(path: str, directory: str) -> bool:
    """Whether the real location of ``path`` is inside the real ``directory``."""
    real = os.path.realpath(path)
    base = os.path.realpath(directory)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def ensure_dir_inside(path: str, root: str, *, what: str) -> None:
    """Create ``path`` (a directory under ``root``) and refuse one that resolves outside it.

    epbuild never writes or deletes through a symlink that leads out of its own directories.
    """
    if os.path.isdir(path) and inside(path, root):
        return  # there already, and inside: nothing to create (each commit asks again)
    refuse_outward(path, root, what=what)  # before creating anything through a link
    os.makedirs(path, exist_ok=True)
    if not inside(path, root):
        raise UnsafePathError(
            f"{what} {path!r} resolves to {os.path.realpath(path)!r}, outside the workspace",
            hint="remove the symlink or point it inside the workspace",
        )


def refuse_outward(path: str, root: str, *, what: str) -> None:
    """Refuse ``path`` when it, or its nearest existing ancestor, resolves outside ``root``."""
    existing = path
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not inside(existing, root):
        raise UnsafePathError(
            f"{what} {path!r} resolves to "
            f"{os.path.join(os.path.realpath(existing), os.path.relpath(path, existing))!r}"
            ", outside the workspace",
            hint="remove the symlink or point it inside the workspace",
        )


def format_bytes(n: float) -> str:
    """1.5 GB, 300 MB, 12 kB."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
