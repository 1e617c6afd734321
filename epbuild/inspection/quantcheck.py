"""``verify --numerics`` of a quantized group's ctx model, in the loader process: the ctx
model and its QDQ model (on the CPU EP) are both compared with the *float* source, on the
recipe's validation samples (``epbuild.quant.samples``), so quantization error and EP error
can be told apart; and each activation of the QDQ model is compared with the float model's
(ONNX Runtime's ``qdq_loss_debug``), worst first: the layers to give ``overrides`` or
``exclude``. The samples stream through (running sums, one sample held at a time), and the
temporary files live in the check's staging directory (``job["scratch"]``)."""

from __future__ import annotations

import functools
import math
import os
import tempfile
from typing import Any

from epbuild._dataclass import replace
from epbuild.errors import EpbuildError, ModelError, ProviderUnavailableError
from epbuild.inspection.loadcheck import (
    _NUMPY_TYPES,
    NO_COMPILE,
    Figures,
    _explain,
    answer,
    reference,
)
from epbuild.providers.contract import ProviderConfig
from epbuild.quant.samples import InputSpec, read_sample, runs_on
from epbuild.quant.work import stage_model, unlinked
from epbuild.runtime import open_models

LAYERS = 10
"""The worst layers a check reports."""
_EPS = 2.220446049250313e-16
"""``numpy.finfo(float).eps``: the least norm ``qdq_loss_debug``'s SQNR divides by."""


def check_quantized(job: dict[str, Any]) -> dict[str, Any]:
    """The loader's result for a quantized model: the ctx model's figures against the
    float source, ``qdq`` (the QDQ model's on the CPU) and ``layers``. The samples stream
    through: each is read, run through every model and folded into running sums before
    the next is read, so memory does not grow with their number. A bad sample (unreadable,
    of another shape, not finite) is ``bad_input``: the user's to fix, not the build's."""
    import onnxruntime as ort

    quant = job["quantized"]
    config = ProviderConfig.from_json(job["provider"])
    config = replace(config, session_options={**config.session_options, **NO_COMPILE})
    cpu, names = reference(ort, job)
    specs = _specs(cpu)
    qdq = ort.InferenceSession(quant["qdq"], providers=["CPUExecutionProvider"])
    ctx_figures, qdq_figures = Figures(names), Figures(names)
    before = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="epbuild-layers-", dir=job.get("scratch")) as tmp:
        # ONNX Runtime's quantization tools make temporary folders of their own: in the
        # check's staging directory too (this process runs this one job)
        tempfile.tempdir = os.path.abspath(tmp)
        try:
            with open_models([job["ctx"]], config) as built:
                layers = LayerErrors(quant["float"], quant["qdq"], tmp)
                for sample in quant["samples"]:
                    feed = read_sample(".", sample, specs)
                    with runs_on(functools.partial(str, sample), str(job["source"])):
                        want = cpu.run(None, feed)
                    ctx_figures.add(built.run(built.names[0], feed), want)
                    qdq_figures.add(qdq.run(None, feed), want)
                    layers.add(feed)
                    del feed, want
        except ProviderUnavailableError as exc:
            return {"outcome": "not_loadable_here", "message": exc.message}
        except ModelError as exc:  # a sample's: the user's input
            bad = {"message": exc.message, "hint": exc.hint}
            return {"outcome": "failed", "message": exc.message, "bad_input": bad}
        except EpbuildError as exc:
            return {"outcome": "failed", "message": _explain(exc.message)}
        finally:
            tempfile.tempdir = before
    return passed(ctx_figures, qdq_figures, layers)


def passed(ctx: Figures, qdq: Figures, layers: LayerSums) -> dict[str, Any]:
    """The loader's result for a quantized model that ran: the ctx model's figures against
    the float source, the QDQ model's beside them (``qdq``) and the worst ``layers``."""
    return {
        **ctx.result(),
        "outcome": "passed",
        "message": "",
        "qdq": qdq.result()["outputs"],
        "layers": layers.worst(),
    }


def _specs(session: Any) -> list[Any]:
    """The inputs a sample must give the float source (``quant.samples.InputSpec``)."""
    import numpy as np

    return [
        InputSpec(i.name, np.dtype(_NUMPY_TYPES.get(i.type, "float32")), tuple(i.shape))
        for i in session.get_inputs()
    ]


class LayerSums:
    """Each activation of a QDQ model against its float model's, matched by name as ONNX
    Runtime's ``qdq_loss_debug`` matches them, as running sums over the samples: the
    signal's energy and the difference's, per tensor. The SQNR of a tensor over all
    samples is their ratio (``qdq_loss_debug`` concatenates every sample's activations
    first, which held them all at once)."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}
        """Per tensor: the float activation's energy, the difference's."""

    def fold(self, qdq: dict[str, list[Any]], floats: dict[str, list[Any]]) -> None:
        """One sample's activations (by tensor name, as ``collect_activations`` names
        them), folded into the sums."""
        import numpy as np
        from onnxruntime.quantization.qdq_loss_debug import create_activation_matching

        matched = create_activation_matching(qdq, floats)
        for tensor, match in matched.items():
            if "float" not in match:
                continue
            left = np.asarray(match["float"][0], np.float64).ravel()
            right = np.asarray(match["post_qdq"][0], np.float64).ravel()
            if left.shape != right.shape:
                continue
            sums = self._sums.setdefault(tensor, [0.0, 0.0])
            with np.errstate(invalid="ignore", over="ignore"):
                sums[0] += float(np.dot(left, left))
                sums[1] += float(np.dot(left - right, left - right))

    def worst(self) -> list[Any]:
        """``[tensor, SQNR dB]``, the ``LAYERS`` worst first (ties by name)."""
        floor = _EPS * _EPS
        scored = []
        for tensor, (signal, noise) in self._sums.items():
            if not (math.isfinite(signal) and math.isfinite(noise)):
                continue
            if signal == 0.0 and noise == 0.0:  # zeros both (an empty KV cache): no figure
                continue
            db = 10.0 * math.log10(max(signal, floor) / max(noise, floor))
            scored.append([tensor, db])
        return sorted(scored, key=lambda t: (t[1], t[0]))[:LAYERS]


class LayerErrors(LayerSums):
    """``LayerSums`` of a QDQ model and its float model, each run by ONNX Runtime's
    ``qdq_loss_debug`` (augmented to output every activation)."""

    def __init__(self, float_model: str, qdq_model: str, tmp: str) -> None:
        super().__init__()
        import onnxruntime as ort
        from onnxruntime.quantization.qdq_loss_debug import (
            modify_model_output_intermediate_tensors,
        )

        so = ort.SessionOptions()  # as qdq_loss_debug.collect_activations runs them
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self._sessions = {}
        typed = _typed(qdq_model, os.path.join(tmp, "typed.onnx"))
        float_model = unlinked(float_model, os.path.join(tmp, "float"))
        for name, model in (("float", float_model), ("qdq", typed)):
            augmented = os.path.join(tmp, f"{name}.onnx")
            modify_model_output_intermediate_tensors(model, augmented)
            self._sessions[name] = ort.InferenceSession(
                augmented, so, providers=["CPUExecutionProvider"]
            )

    def add(self, feed: dict[str, Any]) -> None:
        """One sample's activations, folded into the sums."""
        found = {name: self._activations(session, feed) for name, session in self._sessions.items()}
        self.fold(found["qdq"], found["float"])

    @staticmethod
    def _activations(session: Any, feed: dict[str, Any]) -> dict[str, list[Any]]:
        """The augmented model's saved activations by tensor name (as ``collect_activations``
        names them), one sample's each."""
        from onnxruntime.quantization import qdq_loss_debug

        suffix = qdq_loss_debug._TENSOR_SAVE_POSTFIX
        outputs = session.run(None, feed)
        return {
            o.name[: -len(suffix)]: [value]
            for o, value in zip(session.get_outputs(), outputs, strict=True)
            if o.name.endswith(suffix)
        }


def _typed(qdq_model: str, path: str) -> str:
    """The QDQ model with a float type on each DequantizeLinear output (its scale's: a
    float16 model's are float16): ONNX's shape inference does not know the com.microsoft
    Q/DQ ops that 16-bit types use, and ``qdq_loss_debug`` saves only tensors whose type it
    knows."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(qdq_model, load_external_data=False)
    known = {v.name for v in (*model.graph.value_info, *model.graph.output)}
    scales = {t.name: t.data_type for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            scale = node.input[1] if len(node.input) > 1 else ""
            elem = scales.get(scale, TensorProto.FLOAT)
            for out in node.output:
                if out not in known:
                    model.graph.value_info.append(helper.make_tensor_value_info(out, elem, None))
    stage_model(model, qdq_model, path)  # its weights copied beside it
    return path


def main() -> None:
    """Entry point: the loader of a quantized model (as ``inspection.loadcheck``)."""
    answer(check_quantized)


if __name__ == "__main__":
    main()
