"""What a team writes without epbuild: ONNX Runtime's QNN quantization, then a compile per
HTP target through the compile API and the onnxruntime-qnn plugin. The baseline of
``bench_quantize.py``.

    python benchmarks/quantize_by_hand.py MODEL CALIB_DIR OUT_DIR [--target ARCH:SOC ...]
        [--exclude NODE ...]
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any

import numpy as np
import onnxruntime as ort
import onnxruntime_qnn
from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
from onnxruntime.quantization.execution_providers.qnn import (
    get_qnn_qdq_config,
    qnn_preprocess_model,
)


class Samples(CalibrationDataReader):  # type: ignore[misc]
    def __init__(self, folder: str) -> None:
        self.files = iter(sorted(glob.glob(os.path.join(folder, "*.npz"))))

    def get_next(self) -> Any:
        path = next(self.files, None)
        if path is None:
            return None
        with np.load(path) as data:
            return {name: data[name] for name in data.files}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("calib")
    parser.add_argument("out")
    parser.add_argument("--target", action="append", default=[])
    parser.add_argument("--exclude", action="append", default=[])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pre = os.path.join(args.out, "preprocessed.onnx")
    source = pre if qnn_preprocess_model(args.model, pre) else args.model
    qdq = os.path.join(args.out, "model.qdq.onnx")
    config = get_qnn_qdq_config(
        source,
        Samples(args.calib),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QUInt8,
        nodes_to_exclude=args.exclude or None,
    )
    quantize(source, qdq, config)
    ort.register_execution_provider_library(
        "QNNExecutionProvider", onnxruntime_qnn.get_library_path()
    )
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    for target in args.target or ["73:60"]:
        arch, soc = target.split(":")
        so = ort.SessionOptions()
        so.add_provider_for_devices(
            devices,
            {
                "backend_type": "htp",
                "htp_arch": arch,
                "soc_model": soc,
                "offload_graph_io_quantization": "0",
            },
        )
        out = os.path.join(args.out, f"v{arch}")
        os.makedirs(out, exist_ok=True)
        compiler = ort.ModelCompiler(so, qdq, embed_compiled_data_into_model=False)
        compiler.compile_to_file(os.path.join(out, "model_ctx.onnx"))


if __name__ == "__main__":
    main()
