"""Benchmark model-zoo builds: full build, no-op build, and a hand-written compile loop.

    python benchmarks/bench_build.py [--runs 10] [--noop-only]

Reports (in one run, on this machine):
- the full model-zoo build (18 compiles) with epbuild at -j 1 and -j 2, through the compile
  API (the default), and at -j 1 and -j 2 again with ``compiler = "session"`` in each provider;
- the same 18 compiles by a hand-written loop in one Python process with plain onnxruntime
  (what a user would otherwise write);
- the no-op build time and its ratio to ``python -c "import onnx"`` (target ≤ 0.5).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "examples" / "model-zoo"

HAND_LOOP = r"""
import os, sys, tomllib, glob
import onnxruntime as ort, onnxruntime_qnn
ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
manifest = tomllib.load(open("epbuild.toml", "rb"))
models = sorted(glob.glob("models/*.onnx"))
for name, prov in manifest["providers"].items():
    os.makedirs(f"hand/{name}", exist_ok=True)
    for model in models:
        so = ort.SessionOptions()
        so.add_session_config_entry("ep.context_enable", "1")
        stem = os.path.basename(model)[:-5]
        so.add_session_config_entry("ep.context_file_path", f"hand/{name}/{stem}_ctx.onnx")
        so.add_session_config_entry("ep.context_embed_mode", "0")
        so.add_provider_for_devices(devices, {"backend_type": "htp", **prov["options"]})
        ort.InferenceSession(model, so)
"""


# Compiles are measured, not cache restores; bytecode is written as an installed package has it.
ENV = {**os.environ, "EPBUILD_CACHE": "off"}
ENV.pop("PYTHONDONTWRITEBYTECODE", None)


def timed(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=ENV)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def median_time(cmd: list[str], cwd: Path, runs: int) -> float:
    timed(cmd, cwd)  # warm the page cache and the bytecode cache
    return statistics.median(timed(cmd, cwd) for _ in range(runs))


def use_compiler(ws: Path, compiler: str | None) -> None:
    """Set (or, with None, drop) ``compiler`` in every provider table of the manifest."""
    lines = [
        line
        for line in (ZOO / "epbuild.toml").read_text().splitlines()
        if not line.startswith("compiler =")
    ]
    out: list[str] = []
    for line in lines:
        out.append(line)
        if compiler is not None and line.startswith("[providers."):
            out.append(f'compiler = "{compiler}"')
    (ws / "epbuild.toml").write_text("\n".join(out) + "\n")


def fresh(ws: Path) -> None:
    for d in ("build", ".epbuild", "hand"):
        shutil.rmtree(ws / d, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10, help="runs per no-op measurement")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--noop-only", action="store_true", help="build once, then time only the no-op figures"
    )
    args = parser.parse_args()
    py = sys.executable
    epbuild = [py, "-m", "epbuild"]
    subprocess.run([py, "-m", "compileall", "-q", str(ROOT / "epbuild")], check=True, env=ENV)
    with tempfile.TemporaryDirectory(prefix="epbuild-bench-") as tmp:
        ws = Path(tmp) / "model-zoo"
        ws.mkdir()
        shutil.copy(ZOO / "epbuild.toml", ws)
        subprocess.run([py, str(ZOO / "fetch_models.py")], check=True, capture_output=True)
        shutil.copytree(ZOO / "models", ws / "models")

        if args.noop_only:
            hand = full_j1 = full_j2 = session_j1 = session_j2 = float("nan")
            timed([*epbuild, "build", "-j", "2"], ws)
        else:
            hand = timed([py, "-c", HAND_LOOP], ws)
            use_compiler(ws, "session")
            fresh(ws)
            session_j1 = timed([*epbuild, "build", "-j", "1"], ws)
            fresh(ws)
            session_j2 = timed([*epbuild, "build", "-j", "2"], ws)
            use_compiler(ws, None)  # the default: the compile API
            fresh(ws)
            full_j1 = timed([*epbuild, "build", "-j", "1"], ws)
            fresh(ws)
            full_j2 = timed([*epbuild, "build", "-j", "2"], ws)
        noop = median_time([*epbuild, "build"], ws, args.runs)
        status = median_time([*epbuild, "status"], ws, args.runs)
        import_onnx = median_time([py, "-c", "import onnx"], ws, args.runs)
        python_bare = median_time([py, "-c", "pass"], ws, args.runs)

    figures = {
        "actions": 18,
        "hand_loop_s": round(hand, 2),
        "full_j1_s": round(full_j1, 2),
        "full_j2_s": round(full_j2, 2),
        "j1_vs_hand": round(full_j1 / hand, 3),
        "j2_vs_hand": round(full_j2 / hand, 3),
        "session_j1_s": round(session_j1, 2),
        "session_j2_s": round(session_j2, 2),
        "noop_s": round(noop, 4),
        "status_s": round(status, 4),
        "import_onnx_s": round(import_onnx, 4),
        "python_startup_s": round(python_bare, 4),
        "noop_vs_import_onnx": round(noop / import_onnx, 3),
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"model-zoo: 9 CNNs x 2 HTP targets = 18 compiles ({os.cpu_count()} CPUs)")
    print(f"  hand-written loop, one process    {hand:7.2f} s")
    print(f"  epbuild build -j 1 (compile API)  {full_j1:7.2f} s  ({full_j1 / hand:.2f}x the loop)")
    print(f"  epbuild build -j 2 (compile API)  {full_j2:7.2f} s  ({full_j2 / hand:.2f}x the loop)")
    print(f"  epbuild build -j 1 (sessions)     {session_j1:7.2f} s")
    print(f"  epbuild build -j 2 (sessions)     {session_j2:7.2f} s")
    print(f"  no-op epbuild build (median)      {noop * 1000:7.1f} ms")
    print(f"  epbuild status (median)           {status * 1000:7.1f} ms")
    print(f"  python -c 'import onnx' (median)  {import_onnx * 1000:7.1f} ms")
    print(f"  python -c 'pass' (median)         {python_bare * 1000:7.1f} ms")
    print(f"  no-op / import onnx               {noop / import_onnx:7.2f}   (target <= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
