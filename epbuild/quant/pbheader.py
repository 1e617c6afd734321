"""An ONNX ``TensorProto`` file's name, element type and dimensions, read from its
protobuf fields without reading its data (``raw_data`` and the typed data fields are
skipped by their lengths), so that a test-data sample of the wrong shape is refused before
its data is read."""

from __future__ import annotations

from typing import IO

from epbuild._dataclass import dataclass

_DIMS, _DATA_TYPE, _NAME, _DATA_LOCATION = 1, 2, 8, 14
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class PbError(ValueError):
    """The file is no ``TensorProto`` this reader can follow."""


@dataclass(frozen=True)
class TensorFields:
    """What a ``TensorProto`` says of itself besides its data."""

    name: str
    data_type: int
    dims: tuple[int, ...]
    external: bool
    """Its data lives in another file (``data_location = EXTERNAL``)."""


def tensor_fields(f: IO[bytes], size: int) -> TensorFields:
    """The fields of the ``TensorProto`` that is the whole of ``f`` (``size`` bytes)."""
    name, data_type, dims, location = "", 0, [], 0
    while f.tell() < size:
        tag = _varint(f)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise PbError("a field numbered 0")
        if wire == _VARINT:
            value = _varint(f)
            if field == _DIMS:
                dims.append(_int64(value))
            elif field == _DATA_TYPE:
                data_type = value
            elif field == _DATA_LOCATION:
                location = value
        elif wire == _LEN:
            length = _varint(f)
            if f.tell() + length > size:
                raise PbError(f"field {field} runs past the end of the file")
            if field == _NAME:
                name = f.read(length).decode("utf-8", "replace")
            elif field == _DIMS:  # packed
                end = f.tell() + length
                while f.tell() < end:
                    dims.append(_int64(_varint(f)))
            else:
                f.seek(length, 1)
        elif wire in (_I64, _I32):
            f.seek(8 if wire == _I64 else 4, 1)
        else:
            raise PbError(f"field {field} has wire type {wire}")
    if f.tell() != size:
        raise PbError("the last field runs past the end of the file")
    if any(d < 0 for d in dims):
        raise PbError(f"negative dimensions {dims}")
    return TensorFields(name, data_type, tuple(dims), location == 1)


def _varint(f: IO[bytes]) -> int:
    value = shift = 0
    while True:
        byte = f.read(1)
        if not byte:
            raise PbError("the file ends inside a field")
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
        if shift >= 70:
            raise PbError("a number longer than ten bytes")


def _int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
