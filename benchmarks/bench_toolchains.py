"""Benchmark per-provider toolchains: making one, a mixed QNN + OpenVINO build, the no-op.

    python benchmarks/bench_toolchains.py [--runs 3] [--cold-runs 1] [--noop-runs 10]
                                          [--no-uv] [--json]

Models: the ONNX "light" squeezenet, shufflenet and inception_v1 shipped inside the onnx
wheel. Providers: QNN HTP v73 (soc 60) and v75 (soc 69) in epbuild's own environment, and
OpenVINO on CPU (``ep = "openvino"``, ``device_type = "CPU"``) in a toolchain epbuild makes
from ``requirements = ["onnxruntime-openvino==1.24.1"]``. Everything happens under one
temporary directory (``EPBUILD_TOOLCHAINS`` points into it), removed at the end. Each command
is a fresh ``python -m epbuild`` process; the cache is off, so compiles are measured.

Measured (medians of ``--runs`` unless said otherwise):
1. Making the toolchain: ``epbuild build`` of squeezenet for OpenVINO with an empty
   toolchain directory, through pip (``--cold-runs``, default 1: it downloads ~90 MB from
   PyPI each time, pip's cache pointed at an empty directory), with the environment already
   there (a fresh workspace: what every later build of another workspace pays), and, unless
   ``--no-uv``, through uv (installed with pip into a scratch directory and put on PATH for
   that measurement only) with an empty uv cache and with uv's cache filled. epbuild's own
   "ready in" figure is shown beside each whole build.
2. The mixed build (3 models x 3 providers = 9 compiles, ``build -j 2 --no-cache``) vs the
   sum of a QNN-only build (6) and an OpenVINO-only build (3), each ``-j 2 --no-cache``, the
   toolchain already made.
3. The no-op build (``--noop-runs``, interleaved) with two toolchains (the OpenVINO one and
   the QNN providers pointed at this interpreter with ``toolchain = { python = ... }``),
   and for reference the QNN providers alone with that ``python`` toolchain and without
   any, each as a ratio to ``python -c "import onnx"`` (target <= 0.5), with whether epbuild
   recorded its no-op fingerprint (``.epbuild/noop.json``: the fast path) for it.

Timings are wall-clock on whatever machine runs it; nothing here asserts a timing. The script
exits non-zero only when a build fails or does not do what was asked (compile everything, or
nothing on a no-op).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("light_squeezenet", "light_shufflenet", "light_inception_v1")
OV_REQUIREMENTS = ("onnxruntime-openvino==1.24.1",)
QNN_TARGETS = {"htp-v73": ("73", "60"), "htp-v75": ("75", "69")}
EPBUILD = [sys.executable, "-m", "epbuild"]
BUILD = [*EPBUILD, "build", "-j", "2", "--no-cache", "--json"]
READY = re.compile(r"toolchain for provider \S+ ready in ([0-9.]+) s")


def light_models() -> dict[str, Path]:
    """The chosen light CNNs inside the installed onnx package, by model name."""
    spec = importlib.util.find_spec("onnx")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("onnx is not installed: pip install onnx")
    light = Path(next(iter(spec.submodule_search_locations))) / "backend/test/data/light"
    found = {name.removeprefix("light_"): light / f"{name}.onnx" for name in MODELS}
    missing = [str(p) for p in found.values() if not p.is_file()]
    if missing:
        sys.exit(f"light models missing from the onnx wheel: {', '.join(missing)}")
    return found


def manifest(*, qnn: bool, openvino: bool, qnn_python: str | None = None) -> str:
    """An ``epbuild.toml`` building every model for the chosen providers."""
    lines = ["[workspace]", 'out_dir = "build"', ""]
    names: list[str] = []
    if qnn:
        for name, (arch, soc) in QNN_TARGETS.items():
            names.append(name)
            lines += [f"[providers.{name}]", 'ep = "qnn"']
            lines.append(f'options = {{ htp_arch = "{arch}", soc_model = "{soc}" }}')
            if qnn_python is not None:  # a JSON string is a valid TOML basic string
                lines.append(f"toolchain = {{ python = {json.dumps(qnn_python)} }}")
            lines.append("")
    if openvino:
        names.append("ov-cpu")
        lines += ["[providers.ov-cpu]", 'ep = "openvino"', 'options = { device_type = "CPU" }']
        lines += [f"toolchain = {{ requirements = {json.dumps(list(OV_REQUIREMENTS))} }}", ""]
    lines += ["[groups.cnn]", 'models = ["models/*.onnx"]', f"providers = {json.dumps(names)}"]
    return "\n".join(lines) + "\n"


def workspace(parent: Path, name: str, text: str, models: dict[str, Path]) -> Path:
    """A new workspace directory: the manifest and copies of the models."""
    ws = parent / name
    (ws / "models").mkdir(parents=True)
    for model, src in models.items():
        shutil.copyfile(src, ws / "models" / f"{model}.onnx")
    (ws / "epbuild.toml").write_text(text)
    return ws


def fresh(ws: Path) -> None:
    """Forget every build of the workspace (outputs and state)."""
    for d in ("build", ".epbuild"):
        shutil.rmtree(ws / d, ignore_errors=True)


def bench_env(toolchains: Path, **extra: str) -> dict[str, str]:
    """The environment of one measurement: its toolchain directory, the cache off, pip
    forced unless ``extra`` says otherwise, bytecode written as an installed package has it."""
    env = {**os.environ, "EPBUILD_CACHE": "off", "EPBUILD_INSTALLER": "pip"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["EPBUILD_TOOLCHAINS"] = str(toolchains)
    env.update(extra)
    return {k: v for k, v in env.items() if v}  # an empty value unsets


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str, str]:
    """Run a command; its wall time, stdout and stderr. Exits on failure."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout}\n{proc.stderr}")
    return elapsed, proc.stdout, proc.stderr


def build(ws: Path, env: dict[str, str], *, expect: str = "compiled") -> tuple[float, float]:
    """``epbuild build -j 2 --no-cache`` in ``ws``: wall time and epbuild's "ready in"
    figure for a toolchain it made (NaN if none). Exits unless every action had the
    outcome ``expect`` (``compiled``, or ``up_to_date`` for a no-op)."""
    elapsed, out, err = run(BUILD, ws, env)
    summary = json.loads(out)["summary"]
    if summary[expect] != summary["total"] or summary["total"] == 0:
        sys.exit(f"build in {ws}: expected every action {expect}, got {summary}\n{err}")
    ready = READY.search(err)
    return elapsed, float(ready.group(1)) if ready else float("nan")


def median(measure: Callable[[], float], runs: int) -> float:
    """The median of ``runs`` calls of ``measure``."""
    return statistics.median(measure() for _ in range(runs))


def install_uv(scratch: Path) -> Path | None:
    """Install uv with pip into ``scratch``; its binary, or None."""
    target = scratch / "uv"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), "uv"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    binary = target / "bin" / "uv"
    if proc.returncode != 0 or not binary.is_file():
        print(f"uv could not be installed, skipping it: {proc.stderr.strip()[-300:]}")
        return None
    return binary


def creation(tmp: Path, models: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Measurement 1: cold (pip, uv) and warm toolchain builds; leaves the pip-made
    toolchain in ``tmp / "tc"`` for the other measurements."""
    one = {"squeezenet": models["squeezenet"]}
    text = manifest(qnn=False, openvino=True)
    counter = iter(range(1_000_000))

    def cold(tc: Path, **extra: str) -> tuple[float, float]:
        """A build in a new workspace with ``tc`` emptied first."""
        n = next(counter)
        shutil.rmtree(tc, ignore_errors=True)  # ~450 MB each
        env = bench_env(tc, PIP_CACHE_DIR=str(tmp / f"pip-cache-{n}"), **extra)
        return build(workspace(tmp, f"cold-{n}", text, one), env)

    tc = tmp / "tc"
    pip_runs = [cold(tc) for _ in range(args.cold_runs)]  # the last one is kept
    figures: dict[str, Any] = {
        "cold_pip_s": statistics.median(r[0] for r in pip_runs),
        "cold_pip_ready_s": statistics.median(r[1] for r in pip_runs),
    }
    figures["warm_s"] = median(
        lambda: build(workspace(tmp, f"warm-{next(counter)}", text, one), bench_env(tc))[0],
        args.runs,
    )
    figures.update(uv_figures(tmp, args, cold))
    return figures


def uv_figures(
    tmp: Path, args: argparse.Namespace, cold: Callable[..., tuple[float, float]]
) -> dict[str, Any]:
    """The uv part of measurement 1: an empty uv cache, then a filled one (a new
    environment directory each time)."""
    uv_bin = None if args.no_uv else install_uv(tmp)
    if uv_bin is None:
        return {"uv": None}
    tc, uv_cache = tmp / "tc-uv", tmp / "uv-cache"
    extra = {
        "PATH": f"{uv_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "EPBUILD_INSTALLER": "",  # unset: uv when on PATH
        "UV_CACHE_DIR": str(uv_cache),
    }
    runs = []
    for _ in range(args.cold_runs):
        shutil.rmtree(uv_cache, ignore_errors=True)
        runs.append(cold(tc, **extra))
    cached = [cold(tc, **extra) for _ in range(args.runs)]
    shutil.rmtree(tc, ignore_errors=True)
    shutil.rmtree(uv_cache, ignore_errors=True)
    return {
        "uv": run([str(uv_bin), "--version"], tmp, dict(os.environ))[1].strip(),
        "cold_uv_s": statistics.median(r[0] for r in runs),
        "cold_uv_ready_s": statistics.median(r[1] for r in runs),
        "uv_cached_s": statistics.median(r[0] for r in cached),
        "uv_cached_ready_s": statistics.median(r[1] for r in cached),
    }


def mixed(tmp: Path, models: dict[str, Path], runs: int) -> dict[str, float]:
    """Measurement 2: the mixed build vs a QNN-only and an OpenVINO-only build."""
    env = bench_env(tmp / "tc")
    spaces = {
        "mixed": workspace(tmp, "mixed", manifest(qnn=True, openvino=True), models),
        "qnn": workspace(tmp, "qnn", manifest(qnn=True, openvino=False), models),
        "openvino": workspace(tmp, "openvino", manifest(qnn=False, openvino=True), models),
    }
    times: dict[str, list[float]] = {name: [] for name in spaces}
    for _ in range(runs):  # interleaved, so a busy spell of the machine hits all three
        for name, ws in spaces.items():
            fresh(ws)
            times[name].append(build(ws, env)[0])
    figures = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    figures["separate_sum_s"] = figures["qnn_s"] + figures["openvino_s"]
    figures["mixed_vs_sum"] = figures["mixed_s"] / figures["separate_sum_s"]
    return figures


NOOP_CASES = {
    "two_toolchains": "OpenVINO requirements + QNN python, 9 actions",
    "python_toolchain": "QNN python toolchain only, 6 actions",
    "no_toolchain": "no toolchains (QNN only), 6 actions",
}
PYTHON_CASES = {"import_onnx": "import onnx", "python_startup": "pass"}


def noop(tmp: Path, models: dict[str, Path], runs: int) -> dict[str, Any]:
    """Measurement 3: no-op builds (two toolchains; one; none) vs ``import onnx``, the
    commands interleaved so that a busy spell of the machine hits them all."""
    env = bench_env(tmp / "tc")
    own = sys.executable
    spaces = {
        "two_toolchains": manifest(qnn=True, openvino=True, qnn_python=own),
        "python_toolchain": manifest(qnn=True, openvino=False, qnn_python=own),
    }
    wss = {name: workspace(tmp, f"noop-{name}", text, models) for name, text in spaces.items()}
    for ws in wss.values():
        build(ws, env)
    wss["no_toolchain"] = tmp / "qnn"  # built by measurement 2
    for ws in wss.values():
        build(ws, env, expect="up_to_date")  # records the no-op fingerprint, warms caches
    for code in PYTHON_CASES.values():
        run([sys.executable, "-c", code], tmp, env)
    times: dict[str, list[float]] = {name: [] for name in [*wss, *PYTHON_CASES]}
    for _ in range(runs):
        for name, ws in wss.items():
            times[name].append(build(ws, env, expect="up_to_date")[0])
        for name, code in PYTHON_CASES.items():
            times[name].append(run([sys.executable, "-c", code], tmp, env)[0])
    figures: dict[str, Any] = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    for name, ws in wss.items():
        figures[f"{name}_vs_import_onnx"] = figures[f"{name}_s"] / figures["import_onnx_s"]
        figures[f"{name}_fast_path"] = (ws / ".epbuild" / "noop.json").is_file()
    return figures


def row(label: str, value: float, unit: str = "s", note: str = "") -> None:
    """One line of the table: a label, a figure and an optional note."""
    shown = f"{value * 1000:7.1f} ms" if unit == "ms" else f"{value:7.2f} {unit}".rstrip()
    print(f"   {label:<48} {shown}{'   ' + note if note else ''}")


def report(fig: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the figures as a table."""
    c, m, n = fig["creation"], fig["mixed"], fig["noop"]
    ready = "epbuild: toolchain ready in {:.1f} s"
    print(f"per-provider toolchains ({os.cpu_count()} CPUs; medians of {args.runs} unless noted)")
    print("1. making the onnxruntime-openvino==1.24.1 toolchain: build of squeezenet (1 compile)")
    row(
        f"cold, pip (median of {args.cold_runs})",
        c["cold_pip_s"],
        note=ready.format(c["cold_pip_ready_s"]),
    )
    row("warm: environment exists, fresh workspace", c["warm_s"])
    if c["uv"] is None:
        print("   uv: skipped")
    else:
        print(f"   {c['uv']}, pip-installed into a scratch dir, on PATH for these rows only")
        row(
            f"cold, uv, empty uv cache (median of {args.cold_runs})",
            c["cold_uv_s"],
            note=ready.format(c["cold_uv_ready_s"]),
        )
        row(
            "new environment, uv, uv cache filled",
            c["uv_cached_s"],
            note=ready.format(c["uv_cached_ready_s"]),
        )
    print("2. 3 light CNNs; QNN v73 + v75 (own env), OpenVINO CPU (toolchain); -j 2 --no-cache")
    row("mixed manifest (9 compiles)", m["mixed_s"])
    row("QNN-only manifest (6 compiles)", m["qnn_s"])
    row("OpenVINO-only manifest (3 compiles)", m["openvino_s"])
    row("sum of the two single-provider builds", m["separate_sum_s"])
    row("mixed / sum", m["mixed_vs_sum"], unit="x")
    print(f"3. no-op build (medians of {args.noop_runs}, interleaved)")
    for name, label in NOOP_CASES.items():
        taken = "yes" if n[f"{name}_fast_path"] else "no"
        row(label, n[f"{name}_s"], "ms", f"no-op fingerprint recorded: {taken}")
    for name, code in PYTHON_CASES.items():
        row(f"python -c '{code}'", n[f"{name}_s"], "ms")
    for name, label in NOOP_CASES.items():
        target = "(target <= 0.5)" if name == "two_toolchains" else ""
        row(f"{label.split(',')[0]} / import onnx", n[f"{name}_vs_import_onnx"], "x", target)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument(
        "--cold-runs", type=int, default=1, help="cold toolchain makes (each downloads ~90 MB)"
    )
    parser.add_argument("--noop-runs", type=int, default=10, help="runs per no-op measurement")
    parser.add_argument("--no-uv", action="store_true", help="skip the uv measurements")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    env = bench_env(Path(os.devnull))
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(ROOT / "epbuild")], check=True, env=env
    )
    models = light_models()
    with tempfile.TemporaryDirectory(prefix="epbuild-bench-tc-") as name:
        tmp = Path(name)
        figures = {"creation": creation(tmp, models, args)}
        figures["mixed"] = mixed(tmp, models, args.runs)
        figures["noop"] = noop(tmp, models, args.noop_runs)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        report(figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
