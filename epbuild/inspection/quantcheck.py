"""``verify --numerics`` of a quantized group's ctx model, in the loader process: the ctx
model and its QDQ model (on the CPU EP) are both compared with the *float* source, on the
recipe's validation samples (``epbuild.quant.samples``), so quantization error and EP error
can be told apart; and each activation of the QDQ model is compared with the float model's
(ONNX Runtime's ``qdq_loss_debug``), worst first: the layers to give ``overrides`` or
``exclude``."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from typing import Any

from epbuild.inspection.loadcheck import (
    _NUMPY_TYPES,
    NO_COMPILE,
    Figures,
    _explain,
    answer,
    reference,
)

LAYERS = 10
"""The worst layers a check reports."""


def check_quantized(job: dict[str, Any]) -> dict[str, Any]:
    """The loader's result for a quantized model: the ctx model's figures against the
    float source, ``qdq`` (the QDQ model's on the CPU) and ``layers``."""
    import onnxruntime as ort

    from epbuild.errors import EpbuildError, ProviderUnavailableError
    from epbuild.providers.contract import ProviderConfig
    from epbuild.runtime import open_models

    quant = job["quantized"]
    config = ProviderConfig.from_json(job["provider"])
    config = replace(config, session_options={**config.session_options, **NO_COMPILE})
    cpu, names = reference(ort, job)
    feeds = _feeds(cpu, quant["samples"])
    qdq = ort.InferenceSession(quant["qdq"], providers=["CPUExecutionProvider"])
    ctx_figures, qdq_figures = Figures(names), Figures(names)
    try:
        with open_models([job["ctx"]], config) as built:
            for feed in feeds:
                want = cpu.run(None, feed)
                ctx_figures.add(built.run(built.names[0], feed), want)
                qdq_figures.add(qdq.run(None, feed), want)
    except ProviderUnavailableError as exc:
        return {"outcome": "not_loadable_here", "message": exc.message}
    except EpbuildError as exc:
        return {"outcome": "failed", "message": _explain(exc.message)}
    return {
        **ctx_figures.result(),
        "outcome": "passed",
        "message": "",
        "qdq": qdq_figures.result()["outputs"],
        "layers": layer_sqnr(quant["float"], quant["qdq"], feeds),
    }


def _feeds(session: Any, samples: list[str]) -> list[dict[str, Any]]:
    import numpy as np

    from epbuild.quant.samples import InputSpec, read_sample

    specs = [
        InputSpec(i.name, np.dtype(_NUMPY_TYPES.get(i.type, "float32")), tuple(i.shape))
        for i in session.get_inputs()
    ]
    return [read_sample(".", sample, specs) for sample in samples]


def layer_sqnr(float_model: str, qdq_model: str, feeds: list[dict[str, Any]]) -> list[Any]:
    """``[tensor, SQNR dB]`` of the QDQ model's activations against the float model's, the
    ``LAYERS`` worst first."""
    import math

    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        compute_activation_error,
        create_activation_matching,
        modify_model_output_intermediate_tensors,
    )

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.left = iter(feeds)

        def get_next(self) -> Any:
            return next(self.left, None)

    with tempfile.TemporaryDirectory(prefix="epbuild-layers-") as tmp:
        found = {}
        typed = _typed(qdq_model, os.path.join(tmp, "typed.onnx"))
        for name, model in (("float", float_model), ("qdq", typed)):
            augmented = os.path.join(tmp, f"{name}.onnx")
            modify_model_output_intermediate_tensors(model, augmented)
            found[name] = collect_activations(
                augmented, Reader(), execution_providers=["CPUExecutionProvider"]
            )
    matched = create_activation_matching(found["qdq"], found["float"])
    errors = compute_activation_error(matched)
    scored = [
        [tensor, float(e["xmodel_err"])]
        for tensor, e in errors.items()
        if "xmodel_err" in e and math.isfinite(float(e["xmodel_err"]))
    ]
    return sorted(scored, key=lambda t: (t[1], t[0]))[:LAYERS]


def _typed(qdq_model: str, path: str) -> str:
    """The QDQ model with a float type on each DequantizeLinear output: ONNX's shape
    inference does not know the com.microsoft Q/DQ ops that 16-bit types use, and
    ``qdq_loss_debug`` saves only tensors whose type it knows."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(qdq_model)
    known = {v.name for v in (*model.graph.value_info, *model.graph.output)}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            for out in node.output:
                if out not in known:
                    model.graph.value_info.append(
                        helper.make_tensor_value_info(out, TensorProto.FLOAT, None)
                    )
    onnx.save(model, path)
    return path


def main() -> None:
    """Entry point: the loader of a quantized model (as ``inspection.loadcheck``)."""
    answer(check_quantized)


if __name__ == "__main__":
    main()
