"""Sample feeds for calibration and numerical checks, read in a worker (numpy + onnx) and
checked against the model's inputs: every input present and no other, each with the
model's element type and static dimensions (from the files' headers, before their data is
read: ``quant.arrays``), and every value finite. A sample that breaks a rule is a
``ModelError`` naming its file (and the input) and what is wrong."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import ModelError
from epbuild.manifest.quantization import sample_files
from epbuild.quant.arrays import HINT, Header, open_regular, read_npy, read_npz
from epbuild.quant.pbheader import PbError, TensorFields, tensor_fields

if TYPE_CHECKING:
    import numpy as np
    import onnx


@dataclass(frozen=True)
class InputSpec:
    """One graph input a feed must give: its name, numpy dtype and dimensions (an int is
    fixed; a name or None is free)."""

    name: str
    dtype: Any
    shape: tuple[int | str | None, ...]

    def describe(self) -> str:
        dims = ", ".join("?" if not isinstance(d, int) else str(d) for d in self.shape)
        return f"{self.name} [{dims}] {self.dtype}"


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a feed must give: graph inputs that no initializer provides."""
    from onnx import helper

    inits = {i.name for i in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        tensor = value.type.tensor_type
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        )
        specs.append(InputSpec(value.name, helper.tensor_dtype_to_np_dtype(tensor.elem_type), dims))
    return specs


def read_sample(root: str, sample: str, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """One sample's feed, checked against ``specs``: names, element types and shapes from
    the files' headers before any data is read, then every value finite."""
    full = os.path.join(root, sample)
    if os.path.isdir(full):
        feed = _read_test_data(root, sample, specs)
    elif sample.endswith(".npy"):
        feed = _read_npy(full, sample, specs)
    else:
        feed = read_npz(full, sample, lambda headers: _check(sample, headers, specs))
    _check_finite(sample, feed)
    return feed


def _read_npy(full: str, sample: str, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    if len(specs) != 1:
        raise ModelError(
            f"{sample}: an .npy sample holds one array, but the model has {len(specs)} inputs "
            f"({', '.join(s.name for s in specs)})",
            hint="give one .npz file per sample, its arrays named after the inputs",
        )
    name = specs[0].name
    array = read_npy(full, sample, lambda header: _check(sample, {name: header}, specs))
    return {name: array}


def _read_test_data(root: str, sample: str, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """A test-data folder's ``input_K.pb`` tensors: by their names, else by position."""
    from onnx import helper

    files = sample_files(root, sample)
    found: list[tuple[str, str, TensorFields]] = []
    headers: dict[str, Header] = {}
    for k, rel in enumerate(files):
        fields = _tensor_fields(root, rel)
        name = fields.name or (specs[k].name if k < len(specs) else f"input_{k}")
        try:
            dtype = helper.tensor_dtype_to_np_dtype(fields.data_type)
        except (KeyError, ValueError) as exc:
            why = f"element type {fields.data_type} is not one of ONNX's"
            raise ModelError(f"{rel}: not a readable ONNX tensor ({why})", hint=HINT) from exc
        headers[name] = Header(dtype, fields.dims)
        found.append((rel, name, fields))
    _check(sample, headers, specs)
    return {name: _read_tensor(root, rel, headers[name]) for rel, name, _ in found}


def _tensor_fields(root: str, rel: str) -> TensorFields:
    """An ``input_K.pb`` file's name, element type and dimensions, its data not read."""
    with open_regular(os.path.join(root, rel), rel) as f:
        try:
            fields = tensor_fields(f, os.fstat(f.fileno()).st_size)
        except PbError as exc:
            raise ModelError(f"{rel}: not a readable ONNX tensor ({exc})", hint=HINT) from exc
    if fields.external:
        raise ModelError(
            f"{rel}: its data is in an external file; a sample holds its own data",
            hint="save the tensor with its data (onnx.numpy_helper.from_array)",
        )
    return fields


def _read_tensor(root: str, rel: str, header: Header) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    tensor = onnx.TensorProto()
    with open_regular(os.path.join(root, rel), rel) as f:
        try:
            tensor.ParseFromString(f.read())
            array = numpy_helper.to_array(tensor)
        except Exception as exc:  # protobuf's DecodeError, onnx's own errors
            raise ModelError(f"{rel}: not a readable ONNX tensor ({exc})", hint=HINT) from exc
    if tuple(array.shape) != header.shape or array.dtype != header.dtype:
        raise ModelError(
            f"{rel}: not a readable ONNX tensor (its data holds {list(array.shape)} "
            f"{array.dtype}, its fields say {list(header.shape)} {header.dtype})",
            hint=HINT,
        )
    return array


def _check(sample: str, feed: Mapping[str, Header], specs: Sequence[InputSpec]) -> None:
    """The arrays' headers against the model's inputs: every input, no other, each with
    the input's element type and fixed dimensions."""
    wanted = {s.name: s for s in specs}
    missing = [name for name in wanted if name not in feed]
    extra = [name for name in feed if name not in wanted]
    if missing or extra:
        said = []
        if missing:
            said.append(f"misses input {', '.join(repr(n) for n in missing)}")
        if extra:
            said.append(f"has {', '.join(repr(n) for n in extra)}, which the model does not take")
        raise ModelError(
            f"{sample}: {' and '.join(said)} (the model's inputs: "
            f"{'; '.join(s.describe() for s in specs)})",
            hint=HINT,
        )
    for spec in specs:
        array = feed[spec.name]
        if array.dtype != spec.dtype:
            raise ModelError(
                f"{sample}: input {spec.name!r} is {array.dtype}, the model takes {spec.dtype}",
                hint=f"save it as {spec.dtype} (e.g. array.astype(numpy.{spec.dtype}))",
            )
        fixed = len(array.shape) == len(spec.shape) and all(
            not isinstance(d, int) or d == n for d, n in zip(spec.shape, array.shape, strict=True)
        )
        if not fixed:
            raise ModelError(
                f"{sample}: input {spec.name!r} has shape {list(array.shape)}, the model "
                f"takes {spec.describe()}",
                hint=HINT,
            )


def _check_finite(sample: str, feed: Mapping[str, np.ndarray]) -> None:
    """Every value of every floating-point input is finite: a NaN calibrates to nothing and
    an infinity to a scale of inf (a "quantized" model that no EP compiles)."""
    import numpy as np

    for name, array in feed.items():
        if not np.issubdtype(array.dtype, np.inexact):
            continue
        finite = np.isfinite(array)
        if finite.all():
            continue
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        value = array[where]
        what = "NaN" if np.isnan(value) else "an infinity"
        count = int(finite.size - np.count_nonzero(finite))
        raise ModelError(
            f"{sample}: input {name!r} holds {what} at {list(where)} ({count} value(s) not finite)",
            hint="calibration and validation samples must be finite: fix or drop the sample",
        )


ORT_ERRORS = "onnxruntime.capi.onnxruntime_pybind11_state"
"""The module of the exceptions ONNX Runtime's sessions raise (``Fail``,
``InvalidArgument``...)."""


@contextmanager
def runs_on(sample: Callable[[], str | None], model: str) -> Iterator[None]:
    """ONNX Runtime failing to run the float ``model`` on the CPU inside: a ``ModelError``
    naming the sample that was fed (``sample()``: its path, None when none was yet) and the
    model, the user's to fix (a token id past the vocabulary, an empty dimension the graph
    cannot take); other exceptions pass as they are."""
    try:
        yield
    except Exception as exc:
        fed = sample()
        if type(exc).__module__ != ORT_ERRORS or fed is None:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"{fed}: {model} fails on this sample in ONNX Runtime: {first}",
            hint="the float model runs on the CPU on each sample: fix the sample's values "
            "(token ids within the vocabulary, dimensions the graph takes) or drop it",
        ) from exc


def iterate(
    root: str,
    samples: Sequence[str],
    specs: Sequence[InputSpec],
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """The samples' feeds one at a time (a calibration holds only its own statistics),
    reporting ``progress(done, total)`` after each."""
    for i, sample in enumerate(samples):
        feed = read_sample(root, sample, specs)
        yield feed
        if progress is not None:
            progress(i + 1, len(samples))
