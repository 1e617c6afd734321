"""Figures of ``verify --numerics`` for OpenVINO CPU blobs (run with the standalone
``openvino`` package, since the onnxruntime-openvino Linux wheel cannot load them): per
model, the errors against ORT's CPU EP and the check's time beside the compile's.

    python benchmarks/bench_numerics_openvino.py

Builds the exporter corpus (``tests/corpus``) and the two light CNNs of
``examples/multi-vendor`` for an ``intel-cpu`` provider whose toolchain holds
onnxruntime-openvino and openvino (made once per machine, like any toolchain), then checks
each model alone with ``verify --numerics --json <action>`` and prints a table.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from bench_numerics import epbuild, print_checks

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
LIGHT = ROOT / "examples" / "multi-vendor" / "models"
MODELS = {
    "mlp_unnamed": CORPUS / "mlp_unnamed.onnx",
    "cnn_torchscript": CORPUS / "cnn_torchscript.onnx",
    "cnn_qdq": CORPUS / "cnn_qdq.onnx",
    "bert_torchscript": CORPUS / "bert_torchscript.onnx",
    "llama_torchscript": CORPUS / "llama_torchscript.onnx",
    "gpt2_dynamo": CORPUS / "gpt2_dynamo.onnx",
    "squeezenet": LIGHT / "squeezenet.onnx",
    "shufflenet": LIGHT / "shufflenet.onnx",
}
MANIFEST = """
[providers.intel-cpu]
ep = "openvino"
options = { device_type = "CPU" }
toolchain = { requirements = ["onnxruntime-openvino==1.24.1", "openvino==2025.4.1"] }

[groups.m]
models = [MODELS]
providers = ["intel-cpu"]
free_dimensions = { batch = 1, sequence_length = 8 }
numerics = { int_range = [0, 128] }
"""


def main() -> None:
    """Entry point."""
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ov"
        (ws / "models").mkdir(parents=True)
        for name, path in MODELS.items():
            shutil.copy(path, ws / "models" / f"{name}.onnx")
            if (path.parent / f"{path.name}.data").exists():
                shutil.copy(path.parent / f"{path.name}.data", ws / "models")
        listed = ", ".join(f'"models/{n}.onnx"' for n in MODELS)
        (ws / "epbuild.toml").write_text(MANIFEST.replace("MODELS", listed))
        proc, _ = epbuild(ws, "build", "-j", "1")
        if proc.returncode != 0:
            print(f"build: some actions failed:\n{proc.stdout}{proc.stderr}")
        detail = json.loads(epbuild(ws, "status", "--detail", "--json")[0].stdout)
        compile_s = {a["id"]: a["seconds"] for a in detail["actions"] if a["seconds"]}
        print_checks(ws, compile_s)


if __name__ == "__main__":
    main()
