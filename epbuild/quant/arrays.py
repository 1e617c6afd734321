"""Sample files read as hostile input: only regular files are opened (a FIFO, a device or
a link to one is refused before it can block or never end), and each array's element type
and shape are read from its header (``.npy``: ``numpy.lib.format``; ``.npz``: each zip
member's ``.npy`` header; ``.pb``: the ``TensorProto``'s fields before its data) so that a
sample of the wrong shape is refused before its data is read, and a header that claims more
data than its file holds is refused before anything is allocated. Every malformed archive,
array or header is a ``ModelError`` naming the file."""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import ModelError
from epbuild.manifest.quantization import special_kind

if TYPE_CHECKING:
    import numpy as np

HINT = (
    "a sample holds each of the model's inputs, named after it, with the model's shape and "
    "element type (an .npz file; .npy for a single-input model; or an ONNX test-data folder)"
)
DEFLATE_RATIO = 1032
"""The most a deflate stream can expand (zlib's own figure): a member that claims more
than its compressed size times this is lying."""
_BAD_ZIP = (
    zipfile.BadZipFile,
    zlib.error,  # a corrupt deflate block
    EOFError,
    OSError,
    ValueError,
    RuntimeError,  # an encrypted member
    NotImplementedError,  # a compression zipfile does not know
    KeyError,
)


@dataclass(frozen=True)
class Header:
    """What a sample file says of one array before its data is read."""

    dtype: Any
    shape: tuple[int, ...]
    fortran: bool = False

    @property
    def nbytes(self) -> int:
        """The bytes of its data."""
        count = 1
        for d in self.shape:
            count *= d
        return count * int(self.dtype.itemsize)


@contextmanager
def open_regular(path: str, shown: str) -> Iterator[IO[bytes]]:
    """``path`` opened for reading if it is a regular file, else a ``ModelError`` naming
    ``shown``: checked before opening, and again on the open file (it may have been
    replaced meanwhile), which is opened non-blocking so that a FIFO cannot block."""
    kind = special_kind(path)
    if kind is not None:
        raise _special(shown, kind)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ModelError(f"{shown}: cannot be read ({exc.strerror})", hint=HINT) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _special(shown, special_kind(path) or "no regular file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def _special(shown: str, kind: str) -> ModelError:
    return ModelError(
        f"{shown}: {kind}, not a regular file",
        hint="samples are read from regular files only: replace it with the sample's file",
    )


def npy_header(f: IO[bytes], shown: str) -> Header:
    """The header of the ``.npy`` array ``f`` is at (left at the start of its data)."""
    import numpy as np
    from numpy.lib import format as npformat

    try:
        version = npformat.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npformat.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = npformat.read_array_header_2_0(f)
        else:  # 3.0 (a utf-8 header): numpy has no public reader for it
            shape, fortran, dtype = npformat._read_array_header(f, version)  # type: ignore[attr-defined]
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
        raise ModelError(f"{shown}: not a readable .npy array ({exc})", hint=HINT) from exc
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ModelError(
            f"{shown}: not a readable .npy array (it holds object arrays (pickled data))",
            hint=HINT,
        )
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ModelError(f"{shown}: not a readable .npy array (shape {shape})", hint=HINT)
    return Header(dtype, tuple(shape), bool(fortran))


def read_data(f: IO[bytes], header: Header, shown: str, room: int) -> np.ndarray:
    """The array ``header`` describes, read from ``f`` (at the start of its data);
    ``room``: the bytes ``f`` holds from there, which must be exactly the data's."""
    import numpy as np

    if room != header.nbytes:
        raise ModelError(
            f"{shown}: its header says {list(header.shape)} {header.dtype} ({header.nbytes} "
            f"bytes), but {room} bytes of data follow it",
            hint=HINT,
        )
    try:
        buf = bytearray(header.nbytes)
    except MemoryError as exc:
        raise ModelError(f"{shown}: {header.nbytes} bytes do not fit in memory") from exc
    view = memoryview(buf)
    done = 0
    while done < len(buf):
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            raise ModelError(f"{shown}: its data ends after {done} bytes", hint=HINT)
        done += n
    if f.read(1):  # also where a zip member's checksum is checked
        raise ModelError(f"{shown}: more data than its header says", hint=HINT)
    array = np.frombuffer(buf, dtype=header.dtype)
    return array.reshape(header.shape, order="F" if header.fortran else "C")


def read_npy(path: str, shown: str, check: Callable[[Header], None]) -> np.ndarray:
    """The array of an ``.npy`` file, ``check``ed from its header before its data is read."""
    with open_regular(path, shown) as f:
        header = npy_header(f, shown)
        check(header)
        room = os.fstat(f.fileno()).st_size - f.tell()
        return read_data(f, header, shown, room)


def read_npz(
    path: str, shown: str, check: Callable[[dict[str, Header]], None]
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by name, ``check``ed from their headers before any
    data is read."""
    with open_regular(path, shown) as f:
        if not zipfile.is_zipfile(f):  # numpy would take it for a pickle and say so
            why = "not a zip archive"
            raise ModelError(f"{shown}: not a readable .npz file of arrays ({why})", hint=HINT)
        size = os.fstat(f.fileno()).st_size
        try:
            with zipfile.ZipFile(f) as archive:
                members = _members(archive, shown, size)
                headers = {}
                for name, info in members.items():
                    with archive.open(info) as member:
                        headers[name] = npy_header(member, f"{shown}: {info.filename}")
                check(headers)
                arrays = {}
                for name, info in members.items():
                    with archive.open(info) as member:
                        header = npy_header(member, f"{shown}: {info.filename}")
                        room = info.file_size - member.tell()
                        arrays[name] = read_data(member, header, f"{shown}: {info.filename}", room)
                return arrays
        except ModelError:
            raise
        except _BAD_ZIP as exc:
            why = f"{exc}" or type(exc).__name__
            raise ModelError(
                f"{shown}: not a readable .npz file of arrays ({why})", hint=HINT
            ) from exc


def _members(archive: zipfile.ZipFile, shown: str, size: int) -> dict[str, zipfile.ZipInfo]:
    """An archive's arrays by name (``x.npy`` holds ``x``), each a plain or deflated
    member that claims no more data than its compressed bytes can hold."""
    members = {}
    for info in archive.infolist():
        if info.is_dir():
            continue
        if not info.filename.endswith(".npy"):
            raise ModelError(
                f"{shown}: member {info.filename!r} is not an array (an .npz holds .npy "
                "members only)",
                hint=HINT,
            )
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ModelError(
                f"{shown}: member {info.filename!r} is compressed with method "
                f"{info.compress_type} (numpy writes stored or deflated members)",
                hint="save it with numpy.savez or numpy.savez_compressed",
            )
        most = info.compress_size * (
            1 if info.compress_type == zipfile.ZIP_STORED else DEFLATE_RATIO
        )
        if info.compress_size > size or info.file_size > most + 1024:
            raise ModelError(
                f"{shown}: member {info.filename!r} claims {info.file_size} bytes, more than "
                f"its {info.compress_size} stored bytes can hold (a damaged or crafted archive)",
                hint=HINT,
            )
        members[info.filename[: -len(".npy")]] = info
    return members
