"""Benchmark epbuild's small commands against their floors, side by side.

    python benchmarks/bench_floors.py [--runs 7] [--only restore|noop] [--toolchains DIR]

1. Restore (the CI case): a one-model workspace (one tiny model, one HTP target) and a
   4-action one (four tiny models), each built once into a directory cache; then, in a fresh
   copy of its sources each time (no outputs, no state), ``epbuild build --cache-only --cache
   DIR`` against the floor any restore pays: ``python -c pass`` + ``sha256sum`` of the inputs
   + ``cp -r`` of the outputs (three processes, timed together), paired run by run. Target:
   at most 2x the floor. ``paired_ratio``: the median of the runs' ratios; ``cpu_ratio``:
   the same of their CPU times (user + system), which a busy machine moves far less.
2. No-op ``epbuild build`` against ``python -c "import onnx"`` for three workspaces: a plain
   one (``examples/quickstart``), a toolchain one (one tiny model whose provider has a
   ``requirements`` toolchain, made by epbuild with pip in ``--toolchains`` or a temporary
   directory; first without ``epbuild.lock``, then with it) and an LLM one
   (``examples/llm``). Each is built, built again (recording the no-op fingerprint), then
   timed; the report says whether the fast path answered (``fast``). Target: at most 0.5x.

Each figure is the median of ``--runs`` fresh processes, with the load average beside it
(the machine may be shared). The action cache is off except where a step names one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_scale import tiny_model

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "EPBUILD_CACHE": "off"}
ENV.pop("PYTHONDONTWRITEBYTECODE", None)  # time an installed epbuild, not the compiler
HTP = '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(cmds: list[list[str]], env: dict[str, str] = ENV) -> float:
    """Seconds the commands take one after the other (each must succeed)."""
    return measured(cmds, env)[0]


def measured(cmds: list[list[str]], env: dict[str, str] = ENV) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of the commands run one after the other (each must
    succeed). CPU time, user and system, of the processes themselves: on a machine shared
    with other work it moves far less than the wall time."""
    t0, c0 = time.perf_counter(), children_cpu()
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0, children_cpu() - c0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def epbuild(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "epbuild", "-C", str(root), *args]


def restore(tmp: Path, runs: int, models: int) -> dict[str, object]:
    ws = tmp / f"ws-{models}"
    for i in range(models):
        tiny_model(ws / "models" / f"m{i}.onnx", seed=i)
    (ws / "epbuild.toml").write_text(
        HTP + '\n[groups.g]\nmodels = ["models/*.onnx"]\nproviders = ["htp"]\n'
    )
    cache = tmp / f"cache-{models}"
    timed([epbuild(ws, "build", "--cache", str(cache))])
    inputs = [str(p) for p in sorted((ws / "models").rglob("*")) if p.is_file()]
    ours, floor, cpu = [], [], []
    for run in range(runs + 1):  # the first run of each writes bytecode
        clone = fresh(ws, tmp / "clone")
        a, a_cpu = measured([epbuild(clone, "build", "--cache-only", "--cache", str(cache))])
        if len(list((clone / "build").rglob("*_ctx.onnx"))) != models:
            sys.exit("the restore wrote no outputs")
        copy = tmp / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        b, b_cpu = measured(
            [
                [sys.executable, "-c", "pass"],
                ["sha256sum", *inputs],
                ["cp", "-r", str(ws / "build"), str(copy)],
            ]
        )
        if run:
            ours.append(a)
            floor.append(b)
            cpu.append(a_cpu / b_cpu)
    mine, low = statistics.median(ours), statistics.median(floor)
    paired = statistics.median([a / b for a, b in zip(ours, floor, strict=True)])
    return {
        "restore_s": round(mine, 3),
        "floor_s": round(low, 3),
        "ratio": round(mine / low, 2),
        "paired_ratio": round(paired, 2),
        "cpu_ratio": round(statistics.median(cpu), 2),
        "runs": runs,
        "load": load(),
    }


def fresh(ws: Path, dest: Path) -> Path:
    """A fresh checkout of ``ws`` at ``dest``: its sources, no outputs, no state."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ws, dest, ignore=shutil.ignore_patterns("build", ".epbuild"))
    return dest


def noop_figure(ws: Path, runs: int, env: dict[str, str] = ENV) -> dict[str, object]:
    """Build twice (the second records the fingerprint), then time ``runs`` no-ops."""
    from epbuild.planning.noop import fast_noop

    timed([epbuild(ws, "build")], env)
    timed([epbuild(ws, "build")], env)
    fast = fast_noop(str(ws), None, []) is not None
    times = [timed([epbuild(ws, "build")], env) for _ in range(runs)]
    return {"noop_s": round(statistics.median(times), 3), "fast": fast, "load": load()}


def noops(tmp: Path, runs: int, toolchains: Path) -> dict[str, object]:
    from epbuild.providers.base import dist_version

    onnx_s = statistics.median(
        timed([[sys.executable, "-c", "import onnx"]]) for _ in range(runs + 1)
    )
    report: dict[str, object] = {"import_onnx_s": round(onnx_s, 3)}

    plain = tmp / "quickstart"
    shutil.copytree(ROOT / "examples" / "quickstart", plain,
                    ignore=shutil.ignore_patterns("build", ".epbuild", "dist"))  # fmt: skip
    report["plain"] = noop_figure(plain, runs)

    tc = tmp / "toolchain"
    tiny_model(tc / "models" / "a.onnx")
    pin = f"onnxruntime-qnn=={dist_version('onnxruntime-qnn')}"
    (tc / "epbuild.toml").write_text(
        HTP + f"toolchain = {{ requirements = [{json.dumps(pin)}] }}\n\n"
        '[groups.g]\nmodels = ["models/a.onnx"]\nproviders = ["htp"]\n'
    )
    env = {**ENV, "EPBUILD_TOOLCHAINS": str(toolchains)}
    report["toolchain_no_lock"] = noop_figure(tc, runs, env)
    timed([epbuild(tc, "lock")], env)
    report["toolchain_with_lock"] = noop_figure(tc, runs, env)

    llm = tmp / "llm"
    shutil.copytree(ROOT / "examples" / "llm", llm,
                    ignore=shutil.ignore_patterns("build", ".epbuild", "dist"))  # fmt: skip
    report["llm"] = noop_figure(llm, runs)
    for name in ("plain", "toolchain_no_lock", "toolchain_with_lock", "llm"):
        figure = report[name]
        assert isinstance(figure, dict)
        figure["ratio_to_import_onnx"] = round(figure["noop_s"] / onnx_s, 2)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--only", choices=("restore", "noop"))
    ap.add_argument("--toolchains", help="where the toolchain is made (kept; default: temporary)")
    ns = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="epbuild-bench-floors-"))
    report: dict[str, object] = {"cpus": os.cpu_count()}
    try:
        if ns.only in (None, "restore"):
            report["restore_one_model"] = restore(tmp, ns.runs, 1)
            report["restore_four_actions"] = restore(tmp, ns.runs, 4)
        if ns.only in (None, "noop"):
            toolchains = Path(ns.toolchains) if ns.toolchains else tmp / "toolchains"
            report["noop"] = noops(tmp, ns.runs, toolchains)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
