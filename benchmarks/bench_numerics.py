"""Figures of ``verify --numerics`` on the model zoo: per model, the errors against the CPU
EP and the check's time beside the compile's.

    python examples/model-zoo/fetch_models.py   # once
    python benchmarks/bench_numerics.py [--provider htp-v73]

Copies the model zoo to a temporary workspace, builds it for one provider (one compile per
model, the action cache off), runs ``verify --numerics --json`` twice (the second run only
reads the recorded figures) and prints a table: worst output per model (max_abs, max_rel,
cosine, argmax agreement), compile seconds (from ``status --detail``), check seconds (the
first verify's wall time shared out by model count is not meaningful for uneven models, so
each model is checked alone with ``verify --numerics <action>``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "examples" / "model-zoo"


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


def print_checks(ws: Path, compile_s: dict[str, float]) -> float:
    """Check each action of ``compile_s`` alone (``verify --numerics --json ACTION``) and print
    a row per model: its worst output's figures, the compile's and the check's seconds, the
    status; returns the checks' seconds in all."""
    print(f"{'model':<22}{'worst output':<14}{'max_abs':>10}{'max_rel':>10}{'cosine':>11}"
          f"{'argmax':>8}{'compile s':>11}{'check s':>9}")  # fmt: skip
    total = 0.0
    for action_id in sorted(compile_s):
        proc, seconds = epbuild(ws, "verify", "--numerics", "--json", action_id)
        total += seconds
        (check,) = json.loads(proc.stdout)["numerics"]
        name = action_id.rsplit("/", 1)[-1]
        if not check["outputs"]:
            print(f"{name:<22}{check['status']}: {check['reason']}")
            continue
        worst = max(check["outputs"], key=lambda o: o["max_rel"] or float("inf"))
        argmax = "-" if worst["argmax"] is None else f"{worst['argmax']:.2f}"
        print(
            f"{name:<22}{worst['name'][:13]:<14}{worst['max_abs']:>10.3g}"
            f"{worst['max_rel']:>10.3g}{worst['cosine']:>11.6f}{argmax:>8}"
            f"{compile_s[action_id]:>11.2f}{seconds:>9.2f}  {check['status']}"
        )
    return total


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="htp-v73")
    args = parser.parse_args()
    if not any((ZOO / "models").glob("*.onnx")):
        sys.exit("no models: run python examples/model-zoo/fetch_models.py first")
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "zoo"
        shutil.copytree(ZOO, ws, ignore=shutil.ignore_patterns("build", ".epbuild"))
        selector = f"cnn/{args.provider}"
        proc, _ = epbuild(ws, "build", selector, "-j", "1")
        if proc.returncode != 0:
            sys.exit(f"build failed:\n{proc.stdout}\n{proc.stderr}")
        detail = json.loads(epbuild(ws, "status", "--detail", "--json", selector)[0].stdout)
        compile_s = {a["id"]: a["seconds"] for a in detail["actions"]}
        total_check = print_checks(ws, compile_s)
        _, again = epbuild(ws, "verify", "--numerics", selector)
        print(f"all checks: {total_check:.1f}s; again with nothing changed: {again:.2f}s")


if __name__ == "__main__":
    main()
