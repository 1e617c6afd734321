"""Quantize + compile for two HTP targets: epbuild against a hand-written script (ONNX
Runtime's QNN quantization and compile API, ``quantize_by_hand.py``) and, where it is
installed in an interpreter of its own, Olive (QNNPreprocess → OnnxStaticQuantization →
EPContextBinaryGenerator, one run per target).

Steps, on the model of ``examples/quantize`` (made here if missing) with ``--samples``
calibration samples:

- cold: nothing built (epbuild: no state, no cache);
- exclude edit: ``exclude`` gains the head's Gemm (epbuild quantizes and compiles again
  without calibrating; the script and Olive run whole);
- target added: a third target, the head still excluded (epbuild compiles one action;
  the script quantizes again and compiles the new target only; Olive runs a workflow
  for it, its quantization from its cache).

    python benchmarks/bench_quantize.py [--runs 5] [--samples 32] [--olive-python PATH]

Olive's step is skipped, with a line saying so, without ``--olive-python`` or where that
interpreter cannot import olive.

Prints min / median / max wall seconds per step and tool, and the ratio of medians. After
every step each tool's ctx models for the targets it was asked for must have been written
by that step, as one EPContext node each (Olive 0.13 exits 0 when a pass fails).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quantize"
TARGETS = [("73", "60"), ("79", "69")]
THIRD = ("75", "57")
HEAD = "/head/Gemm"


def manifest(targets: list[tuple[str, str]], exclude: bool) -> str:
    lines = ['[workspace]\nout_dir = "build"\n']
    for arch, soc in targets:
        lines.append(f'[providers.v{arch}]\nep = "qnn"\noptions = {{ htp_arch = "{arch}", '
                     f'soc_model = "{soc}" }}\n')  # fmt: skip
    lines.append('[quantization.w8a16]\ncalibration = "calib/*.npz"\nactivations = "uint16"\n'
                 + (f'exclude = ["{HEAD}"]\n' if exclude else ""))  # fmt: skip
    providers = ", ".join(f'"v{a}"' for a, _ in targets)
    lines.append(f'[groups.vision]\nmodels = ["models/*.onnx"]\nproviders = [{providers}]\n'
                 'quantize = "w8a16"\n')  # fmt: skip
    return "\n".join(lines)


def workspace(where: Path, samples: int) -> Path:
    """The example's model and ``samples`` calibration samples in a fresh folder."""
    if not (EXAMPLE / "models" / "classifier.onnx").exists():
        subprocess.run([sys.executable, "make_example.py"], cwd=EXAMPLE, check=True)
    ws = where / "ws"
    (ws / "models").mkdir(parents=True)
    shutil.copy(EXAMPLE / "models" / "classifier.onnx", ws / "models")
    (ws / "calib").mkdir()
    rng = np.random.default_rng(0)
    for i in range(samples):
        image = rng.standard_normal((1, 3, 32, 32), dtype=np.float32)
        np.savez(ws / "calib" / f"s{i:04d}.npz", image=image)
    return ws


def timed(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
    return seconds


def check_ctx(paths: list[Path], since: float, tool: str) -> None:
    """Each of ``paths`` written at ``since`` or later, a ctx model of one EPContext node."""
    for path in paths:
        if not path.is_file() or path.stat().st_mtime < since - 1:
            raise SystemExit(f"{tool}: {path} was not written by this step")
        ops = [n.op_type for n in onnx.load(path, load_external_data=False).graph.node]
        if ops != ["EPContext"]:
            raise SystemExit(f"{tool}: {path} is not one EPContext node: {ops}")


def epbuild_steps(ws: Path) -> dict[str, float]:
    run = [sys.executable, "-m", "epbuild", "build", "--no-cache"]
    for folder in ("build", ".epbuild"):
        shutil.rmtree(ws / folder, ignore_errors=True)
    found: dict[str, float] = {}
    steps = [("cold", TARGETS, False, TARGETS), ("exclude edit", TARGETS, True, TARGETS),
             ("target added", [*TARGETS, THIRD], True, [THIRD])]  # fmt: skip
    for step, targets, exclude, written in steps:
        (ws / "epbuild.toml").write_text(manifest(targets, exclude))
        since = time.time()
        found[step] = timed(run, ws)
        ctx = [ws / "build" / "vision" / f"v{a}" / "classifier_ctx.onnx" for a, _ in written]
        check_ctx(ctx, since, "epbuild")
    return found


def hand_steps(ws: Path) -> dict[str, float]:
    script = [sys.executable, str(ROOT / "benchmarks" / "quantize_by_hand.py"),
              "models/classifier.onnx", "calib", "hand"]  # fmt: skip
    found: dict[str, float] = {}
    steps = [("cold", TARGETS, []), ("exclude edit", TARGETS, [f"--exclude={HEAD}"]),
             ("target added", [THIRD], [f"--exclude={HEAD}"])]  # fmt: skip
    for step, targets, extra in steps:
        shutil.rmtree(ws / "hand", ignore_errors=True)
        since = time.time()
        found[step] = timed([*script, *[f"--target={a}:{s}" for a, s in targets], *extra], ws)
        check_ctx([ws / "hand" / f"v{a}" / "model_ctx.onnx" for a, _ in targets], since, "by hand")
    return found


# Olive 0.13 queues a telemetry heartbeat before it reads OLIVE_DISABLE_TELEMETRY (or
# --disable_telemetry) and waits for its upload when it exits: ~8 s a run on a machine that
# cannot reach the network. Only a CI variable skips the heartbeat (Olive reads CI for
# nothing else).
OLIVE_ENV = {**os.environ, "OLIVE_DISABLE_TELEMETRY": "1", "CI": "1"}

OLIVE_DATA = """
import glob
import numpy as np
from olive.data.registry import Registry

@Registry.register_dataloader()
def calib_loader(dataset, batch_size=1, **kwargs):
    for path in sorted(glob.glob("calib/*.npz")):
        with np.load(path) as data:
            yield {"image": data["image"]}, 0
"""


def olive_config(target: tuple[str, str], exclude: bool) -> dict[str, object]:
    quant: dict[str, object] = {"type": "OnnxStaticQuantization", "data_config": "calib_data",
                                "activation_type": "uint16", "precision": "uint8"}  # fmt: skip
    if exclude:
        quant["nodes_to_exclude"] = [HEAD]
    return {
        "input_model": {"type": "ONNXModel", "model_path": "models/classifier.onnx"},
        "systems": {"local": {"type": "LocalSystem", "accelerators": [
            {"device": "npu", "execution_providers": ["QNNExecutionProvider"]}]}},
        "data_configs": [{"name": "calib_data", "user_script": "olive_data.py",
                          "load_dataset_config": {"type": "simple_dataset"},
                          "dataloader_config": {"type": "calib_loader"}}],
        "passes": {
            "preprocess": {"type": "QNNPreprocess"},
            "quantize": quant,
            "context": {"type": "EPContextBinaryGenerator",
                        "provider_options": {"htp_arch": target[0], "soc_model": target[1],
                                             # as epbuild and the script: the graph's Q and
                                             # DQ in the context binary, not left to the CPU
                                             "offload_graph_io_quantization": "0"}},
        },
        "host": "local", "target": "local", "evaluate_input_model": False,
        "output_dir": f"olive/v{target[0]}", "log_severity_level": 3,
    }  # fmt: skip


def olive_steps(ws: Path, python: str) -> dict[str, float]:
    """Olive runs one workflow per target; its cache lives in the workspace."""
    (ws / "olive_data.py").write_text(OLIVE_DATA)
    # On a host without the QNN EP's hardware Olive refuses its context pass unless the
    # package config says the pass need not run on the target.
    found = subprocess.run(
        [python, "-c", "import olive, os; print(os.path.dirname(olive.__file__))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    package = json.loads((Path(found.stdout.strip()) / "olive_config.json").read_text())
    package["passes"]["EPContextBinaryGenerator"]["run_on_target"] = False
    (ws / "olive_package.json").write_text(json.dumps(package))

    def run(targets: list[tuple[str, str]], exclude: bool) -> float:
        total = 0.0
        for target in targets:
            path = ws / f"olive-v{target[0]}.json"
            path.write_text(json.dumps(olive_config(target, exclude)))
            command = [python, "-m", "olive", "run", "--config", str(path),
                       "--package-config", "olive_package.json"]  # fmt: skip
            shutil.rmtree(ws / "olive" / f"v{target[0]}", ignore_errors=True)  # not its cache
            since = time.time()
            total += timed(command, ws, env=OLIVE_ENV)
            check_ctx([ws / "olive" / f"v{target[0]}" / "model.onnx"], since, "olive")
        return total

    shutil.rmtree(ws / "olive", ignore_errors=True)
    shutil.rmtree(ws / ".olive-cache", ignore_errors=True)
    return {"cold": run(TARGETS, False), "exclude edit": run(TARGETS, True),
            "target added": run([THIRD], True)}  # fmt: skip


def olive_version(python: str) -> str | None:
    """olive-ai's version in interpreter ``python``; None when it cannot import olive."""
    code = "import olive; from importlib.metadata import version; print(version('olive-ai'))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    except OSError:
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def series(
    tools: dict[str, Callable[[Path], dict[str, float]]], samples: int, runs: int
) -> dict[str, dict[str, list[float]]]:
    """Each tool's seconds per step; the tools take turns within a run (a busy machine's
    slow minute falls on all of them), each in a fresh workspace."""
    found: dict[str, dict[str, list[float]]] = {name: {} for name in tools}
    for _ in range(runs):
        for name, make in tools.items():
            with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
                ws = workspace(Path(tmp), samples)
                for step, seconds in make(ws).items():
                    found[name].setdefault(step, []).append(seconds)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--olive-python", help="an interpreter with olive-ai installed")
    args = parser.parse_args()
    tools: dict[str, Callable[[Path], dict[str, float]]] = {
        "epbuild": epbuild_steps, "by hand": hand_steps}  # fmt: skip
    olive = olive_version(args.olive_python) if args.olive_python else None
    if olive:
        print(f"olive: olive-ai {olive}")
        tools["olive"] = lambda ws: olive_steps(ws, args.olive_python)
    elif args.olive_python:
        print(f"olive: skipped ({args.olive_python} cannot import olive)")
    else:
        print("olive: skipped (give --olive-python PATH of an interpreter with olive-ai)")
    results = series(tools, args.samples, args.runs)
    print(f"{args.samples} calibration samples, {args.runs} runs, wall seconds min / median / max")
    for step in ("cold", "exclude edit", "target added"):
        hand = statistics.median(results["by hand"][step])
        for name, found in results.items():
            med = statistics.median(found[step])
            print(f"  {step:<13} {name:<8} {min(found[step]):6.2f} {med:6.2f} "
                  f"{max(found[step]):6.2f}   {med / hand:4.2f}x the script")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("EPBUILD_CACHE", "off")
    main()
