"""What the calibrate and quantize actions do in a worker, through ONNX Runtime's
quantization tools (``onnxruntime.quantization``): calibration writes the preprocessed float
model and its tensor ranges in ORT's own calibration-cache format (``save_tensors_data``);
quantization reads both and writes the QDQ model (``quantize_static`` with
``calibration_cache_path``), so an edit of types or exclusions never calibrates again."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from epbuild._names import PROGRESS_NAME
from epbuild.errors import ModelError
from epbuild.fs import atomic_write_text, is_safe_reference
from epbuild.quant.samples import input_specs, iterate, runs_on

if TYPE_CHECKING:
    import onnx

    from epbuild.executors.job import Job

PROGRESS_EVERY = 0.2
"""Seconds between writes of a calibration's progress (a write per sample costs more than
a small model's inference)."""
MODEL = "model.onnx"
"""The preprocessed float model a calibration writes (the one its ranges are of)."""
RANGES = "ranges.json"
"""The tensor ranges, in ONNX Runtime's calibration-cache format."""
_LARGE = 1 << 30
"""Models from this size on are written with their weights in external data."""
_QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
SCRATCH = ".scratch"
"""The folder of a job's temporary files, in its staging directory."""


def versions() -> dict[str, str]:
    """The tool versions a quantization kind declares (the worker reports the same)."""
    return {
        "onnxruntime": importlib.metadata.version("onnxruntime"),
        "onnx": importlib.metadata.version("onnx"),
    }


def calibrate(job: Job, root: str) -> dict[str, Any]:
    """Preprocess the float source and calibrate it on the samples."""

    t0 = time.perf_counter()
    args = job.payload
    source = str(args["model"])
    staging = os.path.join(root, job.staging)
    model = _load(root, source)
    quantized = sorted({n.op_type for n in model.graph.node if n.op_type in _QDQ_OPS})
    if quantized:
        raise ModelError(
            f"{source}: already quantized (it has {' and '.join(quantized)} nodes)",
            hint="list a float model, or compile this one without 'quantize'",
        )
    _check_opset(model, source)
    specs = input_specs(model)
    samples = [str(s) for s in args["samples"]]
    for sample in samples[:1]:  # a wrong sample fails before the slow part
        next(iterate(root, [sample], specs))
    target = os.path.join(staging, MODEL)
    with scratch(staging) as tmp:
        path = unlinked(os.path.join(root, source), os.path.join(tmp, "source"))
        _preprocess(model, path, source, target, str(args["flavour"]))
        del model
        with progress(staging, "samples") as report:
            feeds = iterate(root, samples, specs, report)
            tensors = _calibrate(target, feeds, str(args["method"]), samples, source, tmp)
    return {
        "seconds": time.perf_counter() - t0,
        "detail": {"samples": len(samples), "tensors": tensors},
        "versions": versions(),
    }


MIN_OPSET = 13
"""The oldest ai.onnx opset quantized: ONNX Runtime's quantizer raises a graph's opset (to
21 for 16-bit types) after calibration, and older graphs gain tensors on the way (opset
13's Softmax) that have no calibrated range."""


def _check_opset(model: onnx.ModelProto, source: str) -> None:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise ModelError(
            f"{source}: opset {opset} is older than quantization takes ({MIN_OPSET} or later): "
            "ONNX Runtime's quantizer raises the opset after calibration, and this graph "
            "would change on the way",
            hint="re-export the model at opset 17 or later, or convert it first with "
            "onnx.version_converter.convert_version(model, 17) and check its outputs",
        )


def _load(root: str, rel: str) -> onnx.ModelProto:
    """The model at ``rel`` with its weights, read as ONNX Runtime reads them: ONNX's own
    loader refuses an external-data file with several hard links, which a source kept in a
    hard-linking store (DVC's ``hardlink`` cache) or restored from epbuild's cache is."""
    from epbuild.llm.sessions import load_weights, structure

    path = os.path.join(root, rel)
    try:
        return load_weights(structure(path), os.path.dirname(path))
    except Exception as exc:  # protobuf's DecodeError, a missing external-data file
        raise ModelError(f"{rel}: cannot be read as an ONNX model ({exc})") from exc


def unlinked(model_path: str, folder: str) -> str:
    """``model_path``, or where its graph and a kernel copy of its external data are put in
    ``folder`` when it has any (``stage_model``): for ONNX Runtime's quantization tools,
    which read a path with ONNX's loader, and it refuses a data file with several hard links."""
    import onnx

    model = onnx.load(model_path, load_external_data=False)
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return model_path
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, os.path.basename(model_path))
    stage_model(model, model_path, path)
    return path


def _preprocess(model: onnx.ModelProto, path: str, source: str, target: str, flavour: str) -> None:
    """The provider's preprocessing (QNN: ORT's ``qnn_preprocess_model`` of the model at
    ``path``; others: none), written to ``target`` (the source's bytes when it changes
    nothing); ``source`` names it in messages."""
    import onnx

    external = model.ByteSize() >= _LARGE if _small_enough(model) else True
    where = {"save_as_external_data": external, "external_data_location": MODEL + ".data"}
    try:
        if flavour == "qnn":
            from onnxruntime.quantization.execution_providers.qnn import qnn_preprocess_model

            # by path: given a ModelProto it moves the weights to external data in place
            if qnn_preprocess_model(path, target, **where):
                return
        onnx.save(model, target, **_save_args(external))
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(
            f"{source}: ONNX Runtime's quantization preprocessing failed: {exc}",
            hint="re-export the model with a current exporter (opset 13 or later)",
        ) from exc


def _small_enough(model: onnx.ModelProto) -> bool:
    try:
        model.ByteSize()
    except Exception:  # past protobuf's limit
        return False
    return True


def _save_args(external: bool) -> dict[str, Any]:
    if not external:
        return {}
    return {
        "save_as_external_data": True,
        "location": MODEL + ".data",
        "all_tensors_to_one_file": True,
    }


CHUNK = 16
"""Samples whose activations a calibration holds at once: it collects them chunk by chunk
(each ``collect_data`` call folds its chunk into the ranges or histograms and lets go of the
activations). ORT's own bound (``max_intermediate_outputs``) drops a full batch unseen."""


@contextmanager
def progress(staging: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A job's ``report(done, total)``: ``done/total UNIT`` written whole (by rename: the
    builder reads it) to the staging directory's progress file, at most every
    ``PROGRESS_EVERY`` seconds and at the end; the file goes when the job ends."""
    path = os.path.join(staging, PROGRESS_NAME)
    written = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - written[0] >= PROGRESS_EVERY or done == total:
            written[0] = now
            atomic_write_text(path, f"{done}/{total} {unit}", durable=False)

    try:
        yield report
    finally:
        if os.path.exists(path):
            os.unlink(path)


@contextmanager
def quantizer_errors(label: str) -> Iterator[None]:
    """ONNX Runtime's quantizer failing inside: a ``ModelError`` naming ``label`` (the model
    or graph) with what to do (``_quantize_hint``); epbuild's own ``ModelError`` passes as
    it is."""
    try:
        yield
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(
            f"{label}: ONNX Runtime's quantizer failed: {type(exc).__name__}: {exc}",
            hint=_quantize_hint(exc),
        ) from exc


@contextmanager
def scratch(staging: str) -> Iterator[str]:
    """A folder for a job's temporary files, ONNX Runtime's own included (its quantization
    tools take their temporary folders from ``tempfile``): in the staging directory, which
    the builder removes whatever ends the job and the next build removes after a killed
    one, never the system's temporary folder (an interrupt left a model-sized
    ``augmented.onnx`` there each time). A worker runs one job, so ``tempfile.tempdir`` is
    its own to point there while the job runs."""
    path = os.path.join(staging, SCRATCH)
    os.mkdir(path)
    before = tempfile.tempdir
    tempfile.tempdir = os.path.abspath(path)
    try:
        yield path
    finally:
        tempfile.tempdir = before
        shutil.rmtree(path, ignore_errors=True)


def _calibrate(
    model: str, feeds: Any, method: str, samples: Sequence[str], source: str, tmp: str
) -> int:
    """Collect the tensors' ranges over ``feeds`` (of ``samples``) and write them beside
    ``model`` (``tmp``: a folder for the augmented model). ONNX Runtime failing to run the
    model on a sample names that sample (ORT's calibrators run each feed as they take it)
    and ``source``."""
    from onnxruntime.quantization import CalibrationDataReader, save_tensors_data
    from onnxruntime.quantization.calibrate import create_calibrator

    taken = [0]

    class Chunk(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.left = CHUNK

        def get_next(self) -> Any:
            if not self.left:
                return None
            self.left -= 1
            feed = next(feeds, None)
            taken[0] += feed is not None
            return feed

    def fed() -> str | None:
        return samples[taken[0] - 1] if taken[0] else None

    calibrator = create_calibrator(
        model,
        _op_types(model),
        augmented_model_path=os.path.join(tmp, "augmented.onnx"),
        calibrate_method=_method(method),
        use_external_data_format=os.path.exists(model + ".data"),
        providers=["CPUExecutionProvider"],
    )
    for _ in range(0, len(samples), CHUNK):
        with runs_on(fed, source):
            calibrator.collect_data(Chunk())
    ranges = calibrator.compute_data()
    path = os.path.join(os.path.dirname(model), RANGES)
    save_tensors_data(ranges, path)
    _canonical(path)
    return len(ranges.data)


def _canonical(path: str) -> None:
    """Rewrite a calibration cache with its tensors in name order: ORT writes them in a
    set's order, so the same ranges would key their quantization differently each time."""
    import json

    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, sort_keys=True)
    os.chmod(path, 0o644)  # ORT wrote it through mkstemp (0600); outputs are readable


def _op_types(model: str) -> list[str]:
    """The op types whose outputs a calibration records: every op ORT's registries quantize,
    and every op type of ``model`` (the preprocessed graph): ``get_qnn_qdq_config`` and
    ``get_qdq_config`` quantize every op type a graph has, and ``quantize_static`` calibrates
    the op types it quantizes. Without them a graph with a ``Pow`` (a decomposed RMSNorm)
    calibrated no range for its output, and the quantizer failed on it."""
    import onnx
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    graph = onnx.load(model, load_external_data=False).graph
    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry) | {n.op_type for n in graph.node})


def _ort_member(enum: str, name: str) -> Any:
    """The member of ``onnxruntime.quantization.<enum>`` whose name, lower-cased, is ``name``."""
    from onnxruntime import quantization

    return {m.name.lower(): m for m in getattr(quantization, enum)}[name]


def _method(name: str) -> Any:
    """A manifest's ``method`` (``minmax``) as ONNX Runtime's ``CalibrationMethod.MinMax``."""
    return _ort_member("CalibrationMethod", name)


def _qtype(name: str) -> Any:
    """A manifest's type (``uint8``) as ONNX Runtime's ``QuantType.QUInt8``."""
    return _ort_member("QuantType", f"q{name}")


def quantize(job: Job, root: str) -> dict[str, Any]:
    """Write the QDQ model from the calibrated model and its ranges. A calibrated model
    with external data is handed to the quantizer as a copy (``stage_model``): ONNX's
    loader refuses a data file with several hard links, which a restored one is."""
    import onnx

    t0 = time.perf_counter()
    args = job.payload
    committed = os.path.join(root, str(args["calibrated"]))
    label = str(args["label"])
    try:
        model = onnx.load(committed, load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError
        raise ModelError(f"{args['calibrated']}: cannot be read as an ONNX model ({exc})") from exc
    _check_float16(model, label, args)
    names = (list(args["exclude"]), dict(args["overrides"]))
    try:
        _check_names(model, label, *names)
    except ModelError:  # the source's names explain it (read only then: a parse)
        source = onnx.load(os.path.join(root, str(args["source"])), load_external_data=False)
        _check_names(model, label, *names, source=source, shown=str(args["calibrated"]))
        raise
    external = os.path.exists(committed + ".data")
    output = os.path.join(root, job.staging, str(args["output"]))
    with scratch(os.path.join(root, job.staging)) as tmp:
        calibrated = committed
        if external:
            calibrated = os.path.join(tmp, MODEL)
            stage_model(model, committed, calibrated)
        del model
        cache = os.path.join(tmp, RANGES)  # ORT may rewrite a cache: never the committed one
        shutil.copyfile(os.path.join(os.path.dirname(committed), RANGES), cache)
        config = _config(calibrated, args)
        with quantizer_errors(label):
            _quantize(calibrated, output, cache, config, external)
    return {
        "seconds": time.perf_counter() - t0,
        "detail": {"qdq_nodes": _count_qdq(output)},
        "versions": versions(),
    }


FLOAT16_QDQ_OPSET = 19
"""The first ai.onnx opset whose QuantizeLinear/DequantizeLinear take float16 scales."""
_OPSET21_TYPES = ("uint16", "int16", "uint4", "int4")
"""Types for which ONNX Runtime's quantizer raises a graph's opset to 21."""


def _check_float16(model: onnx.ModelProto, label: str, args: Mapping[str, Any]) -> None:
    """Refuse a float16 model the quantizer would make invalid: its scales are float16, and
    below opset 19 (which the quantizer leaves as it is for 8-bit types) no
    DequantizeLinear takes them; the compile failed on the QDQ model with ONNX Runtime's
    type error, naming no source."""
    import onnx

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    types = {
        str(args["activations"]),
        str(args["weights"]),
        *map(str, dict(args["overrides"]).values()),
    }
    if opset >= FLOAT16_QDQ_OPSET or types & set(_OPSET21_TYPES):
        return
    half = onnx.TensorProto.FLOAT16
    graph = model.graph
    values = (*graph.input, *graph.output, *graph.value_info)
    if not any(t.data_type == half for t in graph.initializer) and not any(
        v.type.tensor_type.elem_type == half for v in values
    ):
        return
    raise ModelError(
        f"{label}: a float16 model at opset {opset}: ONNX Runtime's quantizer gives it float16 "
        f"scales, which QuantizeLinear/DequantizeLinear take from opset {FLOAT16_QDQ_OPSET}",
        hint="quantize the float32 model, or convert this one to opset 21 first "
        "(onnx.version_converter.convert_version(model, 21)); 16-bit activations work too "
        "(the quantizer then raises the opset to 21)",
    )


def stage_model(model: onnx.ModelProto, source: str, path: str) -> None:
    """Write ``model`` (the graph at ``source`` read without its weights) at ``path`` for
    ONNX Runtime's quantizer, which reads a path: its graph serialized, its external-data
    files beside it copies of ``source``'s, made by the kernel (neither read into the
    process nor serialized again). Not links: ONNX's loader refuses a data file with several
    hard links (a restored one) or a symbolic one."""
    import onnx

    folder, into = os.path.dirname(os.path.abspath(source)), os.path.dirname(path)
    locations = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    for location in sorted(locations):
        if not is_safe_reference(location):  # the producing kind's check refuses it first
            raise ModelError(
                f"{source}: external data {location!r} is not beside the graph",
                hint="remove the state directory and build again",
            )
        target = os.path.join(into, location)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(folder, location), target)
    onnx.save(model, path)


def _config(model: str, args: Mapping[str, Any]) -> Any:
    """ONNX Runtime's static configuration for the provider's kind of quantization."""
    activations, weights = _qtype(str(args["activations"])), _qtype(str(args["weights"]))
    overrides = {t: [{"quant_type": _qtype(q)}] for t, q in dict(args["overrides"]).items()}
    common: dict[str, Any] = {
        "calibrate_method": _method(str(args["method"])),
        "activation_type": activations,
        "weight_type": weights,
        "per_channel": bool(args["per_channel"]),
        "nodes_to_exclude": list(args["exclude"]) or None,
    }
    if args["flavour"] == "qnn":
        from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

        return get_qnn_qdq_config(model, None, init_overrides=overrides or None, **common)
    from onnxruntime.quantization import get_qdq_config

    return get_qdq_config(model, None, tensor_quant_overrides=overrides or None, **common)


def _quantize(model: str, output: str, cache: str, config: Any, external: bool) -> None:
    from onnxruntime.quantization import quantize_static

    from epbuild.quant.weights import vectorized

    with vectorized():  # ORT's per-channel weight loops, same bits without the loops
        quantize_static(
            model,
            output,
            None,
            calibrate_method=config.calibrate_method,
            quant_format=config.quant_format,
            activation_type=config.activation_type,
            weight_type=config.weight_type,
            op_types_to_quantize=config.op_types_to_quantize,
            nodes_to_quantize=config.nodes_to_quantize,
            nodes_to_exclude=config.nodes_to_exclude,
            per_channel=config.per_channel,
            reduce_range=config.reduce_range,
            use_external_data_format=external or config.use_external_data_format,
            extra_options=config.extra_options,
            calibration_cache_path=cache,
        )


def _quantize_hint(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if "ConvertError" in text or "version_converter" in text or "is undefined" in text:
        return (
            "the quantizer raises the model's opset (16-bit types need opset 21) and ONNX's "
            "version converter cannot convert this model: re-export it at opset 17 or later"
        )
    return "see the message above; 'exclude' keeps a failing node in float"


def _check_names(
    model: onnx.ModelProto,
    label: str,
    exclude: Sequence[str],
    overrides: Mapping[str, str],
    source: onnx.ModelProto | None = None,
    shown: str = "",
) -> None:
    """Every excluded node and overridden tensor is one of the model's. ``source``: the
    float model ``model`` was preprocessed from (``shown``: the preprocessed model's path),
    whose names the user sees: a name only it has was fused away by the preprocessing."""
    import difflib

    for key, names, known in (
        ("exclude", exclude, _names(model, "exclude")),
        ("overrides", overrides, _names(model, "overrides")),
    ):
        unknown = [n for n in names if n not in known]
        if not unknown:
            continue
        near = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        what = "node" if key == "exclude" else "tensor"
        hint = (
            f"did you mean {' or '.join(repr(n) for n in near)}?"
            if near
            else f"use the {what} names the model has (Netron shows them)"
        )
        if source is not None and unknown[0] in _names(source, key):
            raise ModelError(
                f"{label}: {key} names {what} {unknown[0]!r}, which ONNX Runtime's "
                "quantization preprocessing fused away (the quantizer sees the preprocessed "
                f"model {shown})",
                hint=f"name the {what} of {shown} that took its place (Netron shows them); " + hint,
            )
        raise ModelError(
            f"{label}: {key} names {what} {unknown[0]!r}, which the model does not have",
            hint=hint,
        )


def _names(model: onnx.ModelProto, key: str) -> set[str]:
    """The names ``key`` (``exclude``: nodes; ``overrides``: tensors) can give in ``model``."""
    if key == "exclude":
        return {n.name for n in model.graph.node}
    tensors = {t for n in model.graph.node for t in (*n.input, *n.output) if t}
    return tensors | {i.name for i in model.graph.input}


def _count_qdq(path: str) -> int:
    import onnx

    model = onnx.load(path, load_external_data=False)
    return sum(1 for n in model.graph.node if n.op_type in _QDQ_OPS)
