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
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def epbuild(ws: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the CLI in ``ws``; the process and its wall time."""
    env = {**os.environ, "EPBUILD_CACHE": "off"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(ws), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    return proc, time.perf_counter() - t0


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
        print(f"{'model':<20}{'worst output':<14}{'max_abs':>10}{'max_rel':>10}{'cosine':>11}"
              f"{'argmax':>8}{'compile s':>11}{'check s':>9}")  # fmt: skip
        for action_id in sorted(compile_s):
            proc, seconds = epbuild(ws, "verify", "--numerics", "--json", action_id)
            (check,) = json.loads(proc.stdout)["numerics"]
            name = action_id.rsplit("/", 1)[-1]
            if not check["outputs"]:
                print(f"{name:<20}{check['status']}: {check['reason']}")
                continue
            worst = max(check["outputs"], key=lambda o: o["max_rel"] or float("inf"))
            argmax = "-" if worst["argmax"] is None else f"{worst['argmax']:.2f}"
            print(
                f"{name:<20}{worst['name'][:13]:<14}{worst['max_abs']:>10.3g}"
                f"{worst['max_rel']:>10.3g}{worst['cosine']:>11.6f}{argmax:>8}"
                f"{compile_s[action_id]:>11.2f}{seconds:>9.2f}  {check['status']}"
            )


if __name__ == "__main__":
    main()
