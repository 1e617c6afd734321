"""Sample feeds for calibration and numerical checks, read in a worker (numpy + onnx) and
checked against the model's inputs: every input present and no other, each with the
model's element type and static dimensions. A sample that breaks a rule is a ``ModelError``
naming its file and what is wrong."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import ModelError
from epbuild.manifest.quantization import sample_files

if TYPE_CHECKING:
    import numpy as np
    import onnx

_HINT = (
    "a sample holds each of the model's inputs, named after it, with the model's shape and "
    "element type (an .npz file; .npy for a single-input model; or an ONNX test-data folder)"
)


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
    """One sample's feed, checked against ``specs``."""
    full = os.path.join(root, sample)
    if os.path.isdir(full):
        feed = _read_test_data(root, sample, specs)
    elif sample.endswith(".npy"):
        feed = _read_npy(full, sample, specs)
    else:
        feed = _read_npz(full, sample)
    _check(sample, feed, specs)
    return feed


def _read_npz(full: str, sample: str) -> dict[str, np.ndarray]:
    import zipfile

    import numpy as np

    if not zipfile.is_zipfile(full):  # numpy would take it for a pickle and say so
        raise ModelError(
            f"{sample}: not a readable .npz file of arrays (not a zip archive)", hint=_HINT
        )
    try:
        with np.load(full, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        why = "it holds object arrays (pickled data)" if "pickle" in str(exc) else str(exc)
        raise ModelError(
            f"{sample}: not a readable .npz file of arrays ({why})", hint=_HINT
        ) from exc


def _read_npy(full: str, sample: str, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    import numpy as np

    if len(specs) != 1:
        raise ModelError(
            f"{sample}: an .npy sample holds one array, but the model has {len(specs)} inputs "
            f"({', '.join(s.name for s in specs)})",
            hint="give one .npz file per sample, its arrays named after the inputs",
        )
    try:
        array = np.load(full, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ModelError(f"{sample}: not a readable .npy array ({exc})", hint=_HINT) from exc
    if not isinstance(array, np.ndarray):
        raise ModelError(f"{sample}: not a single array", hint=_HINT)
    return {specs[0].name: array}


def _read_test_data(root: str, sample: str, specs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """A test-data folder's ``input_K.pb`` tensors: by their names, else by position."""
    import onnx
    from onnx import numpy_helper

    feed: dict[str, np.ndarray] = {}
    for k, rel in enumerate(sample_files(root, sample)):
        tensor = onnx.TensorProto()
        try:
            with open(os.path.join(root, rel), "rb") as f:
                tensor.ParseFromString(f.read())
            array = numpy_helper.to_array(tensor)
        except Exception as exc:  # protobuf's DecodeError, onnx's own errors
            raise ModelError(f"{rel}: not a readable ONNX tensor ({exc})", hint=_HINT) from exc
        name = tensor.name or (specs[k].name if k < len(specs) else f"input_{k}")
        feed[name] = array
    return feed


def _check(sample: str, feed: dict[str, np.ndarray], specs: Sequence[InputSpec]) -> None:
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
            hint=_HINT,
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
                hint=_HINT,
            )


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
