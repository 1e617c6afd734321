"""The state journal's file: its header, the encoding of one line, and appending a line.

Kept apart from ``journal`` (which reads the journal into records and states) and cheap to
import (``os``, ``json``, ``errno`` and ``fs``).
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from epbuild.fs import open_nofollow

HEADER = {"epbuild_state": 1}
HEADER_LINE = json.dumps(HEADER, separators=(",", ":")).encode() + b"\n"


def encode_line(data: dict[str, Any]) -> bytes:
    """One journal line: compact JSON with sorted keys, newline-terminated."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``; a short write (the file-size limit reached) raises EFBIG."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        view = view[written:]


def append(path: str, data: dict[str, Any], *, sync: bool = True) -> None:
    """Append one record to the journal at ``path`` (the header first into an empty file;
    callers hold the state lock). A record cut short by a full disk or a file-size limit is
    taken back, so the journal keeps ending with a whole line. A link at ``path`` is refused
    (`fs.LinkedPathError`), never appended to."""
    line = encode_line(data)
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND
    try:
        fd = open_nofollow(path, flags)
    except FileNotFoundError:  # the state directory is made with the first record
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = open_nofollow(path, flags)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            line = HEADER_LINE + line
        else:
            # A crash mid-append leaves a line without its newline: end it first so this
            # record does not merge into the damaged one (O_APPEND writes at the end
            # wherever the offset is).
            os.lseek(fd, size - 1, os.SEEK_SET)
            if os.read(fd, 1) != b"\n":
                line = b"\n" + line
        try:
            write_all(fd, line)
        except OSError as exc:
            os.ftruncate(fd, size)
            raise OSError(exc.errno, exc.strerror, path) from exc
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync(path: str) -> None:
    """Make every appended record durable (one fsync for a batch of restores)."""
    try:
        fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin_line(action_id: str, key: str) -> dict[str, Any]:
    """The ``begin`` record of an action whose outputs are about to be replaced."""
    return {"op": "begin", "id": action_id, "key": key, "pid": os.getpid()}
