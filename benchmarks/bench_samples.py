"""Calibration and validation samples at scale, on a tiny model (x[1, 8] @ W → Relu → @ V):

- expansion: the time ``status`` takes with 40,000 and 100,000 ``.npy`` calibration
  samples (a glob over one folder; every command lists and de-duplicates them), beside the
  time the manifest's sample expansion alone takes (``manifest.quantization``);
- numerics: the peak resident memory of ``verify --numerics``'s loader process (where the
  validation samples are read and run) with 100 and 3,000 validation samples, and their
  ratio (streaming: it does not grow with their number), on an 8×8-pixel CNN.

    python benchmarks/bench_samples.py [--counts 40000 100000] [--numerics 100 3000]
                                       [--skip-status] [--skip-numerics]

The numerics step builds the model with the real QNN EP (quantized, for one HTP target),
then runs the loader process ``verify --numerics`` runs on the job it would get, which
reports its own ``ru_maxrss``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
N = 8


def tiny_model() -> onnx.ModelProto:
    """x[1, N] @ W → Relu → @ V, opset 17."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, N), dtype=np.float32) * 0.3
    v = rng.standard_normal((N, N), dtype=np.float32) * 0.3
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "V"], ["y"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def cnn_model() -> onnx.ModelProto:
    """An 8×8-pixel CNN: x[1, 3, 8, 8] → Conv 32 → Relu → Conv 32 → Relu → global average
    → Gemm 10, opset 17 (its activations, 8 KiB a tensor, are what a check that holds every
    sample's would pile up)."""
    rng = np.random.default_rng(0)
    inits = {
        "W1": rng.standard_normal((32, 3, 3, 3), dtype=np.float32) * 0.3,
        "W2": rng.standard_normal((32, 32, 3, 3), dtype=np.float32) * 0.1,
        "G": rng.standard_normal((32, 10), dtype=np.float32) * 0.3,
    }
    pad = {"pads": [1, 1, 1, 1]}
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W1"], ["c1"], **pad),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "W2"], ["c2"], **pad),
            helper.make_node("Relu", ["c2"], ["r2"]),
            helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
            helper.make_node("Flatten", ["p"], ["f"]),
            helper.make_node("Gemm", ["f", "G"], ["y"]),
        ],
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def workspace(where: Path, calibration: int, validation: int = 0, *, cnn: bool = False) -> Path:
    """A workspace of the tiny model (or the CNN) in a quantized group for HTP v73,
    ``calibration`` samples under ``calib/`` and ``validation`` under ``valid/``."""
    ws = where / f"ws-{calibration}-{validation}"
    (ws / "models").mkdir(parents=True)
    onnx.save(cnn_model() if cnn else tiny_model(), ws / "models" / "tiny.onnx")
    shape = (1, 3, 8, 8) if cnn else (1, N)
    rng = np.random.default_rng(1)
    for folder, count in (("calib", calibration), ("valid", validation)):
        (ws / folder).mkdir()
        for i in range(count):
            np.save(ws / folder / f"s{i:06d}.npy", rng.standard_normal(shape, dtype=np.float32))
    recipe = 'calibration = "calib/*.npy"\n' + (
        'validation = "valid/*.npy"\n' if validation else ""
    )
    (ws / "epbuild.toml").write_text(
        '[workspace]\nout_dir = "build"\n\n'
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n\n'
        f"[quantization.q]\n{recipe}\n"
        '[groups.g]\nmodels = ["models/*.onnx"]\nproviders = ["htp"]\nquantize = "q"\n'
    )
    return ws


def epbuild(ws: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the CLI in ``ws``; the process and its wall time."""
    env = {**os.environ, "EPBUILD_CACHE": "off", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    command = [sys.executable, "-m", "epbuild", "-C", str(ws), *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    return proc, time.perf_counter() - t0


def expansion(ws: Path) -> float:
    """Seconds the manifest's sample expansion takes for ``ws`` (in this process)."""
    sys.path.insert(0, str(ROOT))
    from epbuild.manifest.locate import Where
    from epbuild.manifest.quantization import load_quantization

    where = Where(ws / "epbuild.toml", (ws / "epbuild.toml").read_text())
    t0 = time.perf_counter()
    found = load_quantization(where, ws, {"q": {"calibration": "calib/*.npy"}}, (".epbuild",))
    seconds = time.perf_counter() - t0
    assert len(found["q"].calibration) > 0
    return seconds


def bench_status(counts: list[int], where: Path) -> None:
    """``status`` in a workspace that has a state directory (so that the stat cache keeps
    the samples' digests, as in any workspace built before): the first run hashes every
    sample, the next ones only stat them."""
    base = workspace(where, 1)
    (base / ".epbuild").mkdir()
    epbuild(base, "status")
    _, empty = epbuild(base, "status")
    print(f"status with 1 sample: {empty:.2f} s (the floor)")
    for count in counts:
        ws = workspace(where, count)
        (ws / ".epbuild").mkdir()
        proc, first = epbuild(ws, "status")  # exit 1: stale
        if proc.returncode not in (0, 1):
            raise SystemExit(f"status failed ({proc.returncode}): {proc.stderr}")
        _, second = epbuild(ws, "status")
        print(
            f"{count:>7} samples: expansion {expansion(ws):.2f} s; "
            f"status {first:.2f} s (first), {second:.2f} s (again)"
        )


LOADER = (
    "import json, resource, sys; del sys.path[0]; from epbuild.inspection.loadcheck import main; "
    "main(); print(json.dumps({'peak_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), "
    "file=sys.stderr)"
)
"""The loader process ``verify --numerics`` runs, reporting its own peak resident memory."""


def loader_job(ws: Path) -> dict[str, object]:
    """The loader job ``verify --numerics`` gives the built ctx model of ``ws``."""
    sys.path.insert(0, str(ROOT))
    from epbuild.inspection.loading import load_spec
    from epbuild.kinds.check import CheckAction, loader_extra
    from epbuild.planning.workspace import open_workspace

    graph = open_workspace(ws, numerics=True).graph
    check = next(a for a in graph if isinstance(a, CheckAction))
    spec = load_spec(check.compile, 0, loader_extra(str(ws), check.compile, 0))
    return dict(spec["job"])


def bench_numerics(counts: list[int], where: Path) -> None:
    """The loader's peak RSS with each count of validation samples (the model built once
    per count, with 16 calibration samples)."""
    peaks = []
    for count in counts:
        ws = workspace(where, 16, count, cnn=True)
        proc, _ = epbuild(ws, "build")
        if proc.returncode != 0:
            raise SystemExit(f"build failed ({proc.returncode}): {proc.stderr}")
        job = loader_job(ws)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        command = [sys.executable, "-c", LOADER]
        run = subprocess.run(
            command, input=json.dumps(job), cwd=ws, capture_output=True, text=True, env=env
        )
        seconds = time.perf_counter() - t0
        result = json.loads(run.stdout.splitlines()[-1])
        peak = json.loads(run.stderr.strip().splitlines()[-1])["peak_kib"]
        peaks.append(peak)
        said = f"{result['outcome']} {result.get('message', '')}".strip()
        print(
            f"{count:>7} validation samples: loader {seconds:.1f} s, "
            f"peak RSS {peak / 1024:.1f} MiB ({said})"
        )
    if len(peaks) >= 2:
        print(f"peak ratio {peaks[-1] / peaks[0]:.2f} (streaming: within 1.5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[40_000, 100_000])
    parser.add_argument("--numerics", type=int, nargs="+", default=[100, 3_000])
    parser.add_argument("--skip-status", action="store_true")
    parser.add_argument("--skip-numerics", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-samples-") as tmp:
        if not args.skip_status:
            bench_status(args.counts, Path(tmp))
        if not args.skip_numerics:
            bench_numerics(args.numerics, Path(tmp))


if __name__ == "__main__":
    main()
