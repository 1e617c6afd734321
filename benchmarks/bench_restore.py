"""Benchmark cache restores of the model-zoo outputs against ``cp -r`` of the same files.

    python benchmarks/bench_restore.py [--runs 7] [--jobs 2]

In one temp directory, on this machine: builds model-zoo (9 CNNs x 2 HTP targets = 18
actions) once with a fresh cache, then repeatedly (a) removes the outputs (``epbuild clean``)
and restores all 18 actions from the cache — through the library API and through the CLI —
and (b) copies the same output files with ``cp -r``. A restore hard-links each object into
the output directory (reflink or copy where it cannot), checks each object against the stat
recorded when it was last verified (re-hashing any whose stat changed; see
``epbuild/cache/trust.py``) and journals each action; ``cp -r`` reads and writes every
byte. Target: restore <= 2x ``cp -r``. Page cache is warm for both (same run, same files).
The CLI figure includes the interpreter start; the CLI no-op build shows that floor.

Then the small restore in a fresh clone (the CI case): a copy of the workspace without its
outputs and state, restored with ``epbuild build --cache-only`` from the CLI, against the
floor any script pays for the same result: start Python, hash the inputs (sha256 of every
model), copy the output files. Target: fresh-clone restore <= 2x that floor.
"""

from __future__ import annotations

import argparse
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


def light_models() -> list[Path]:
    """The ONNX "light" CNNs inside the installed onnx wheel."""
    import importlib.util

    spec = importlib.util.find_spec("onnx")
    assert spec is not None and spec.submodule_search_locations
    light = Path(next(iter(spec.submodule_search_locations))) / "backend/test/data/light"
    return sorted(light.glob("light_*.onnx"))


SMALL = ("squeezenet", "shufflenet")
"""The small workspace (``--small``): two CNNs x 2 HTP targets, a few MB of outputs."""


def make_workspace(dest: Path, only: tuple[str, ...] = ()) -> Path:
    """model-zoo's manifest + its nine models (or those named in ``only``) in ``dest``."""
    (dest / "models").mkdir(parents=True)
    shutil.copy(ZOO / "epbuild.toml", dest / "epbuild.toml")
    for src in light_models():
        if only and src.stem.removeprefix("light_") not in only:
            continue
        shutil.copyfile(src, dest / "models" / src.name.removeprefix("light_"))
    return dest


FLOOR = """
import hashlib, os, shutil, sys
src, ws, dest = sys.argv[1:4]
for folder, _dirs, files in os.walk(os.path.join(ws, "models")):
    for name in files:
        with open(os.path.join(folder, name), "rb") as f:
            hashlib.sha256(f.read()).hexdigest()
shutil.copytree(src, dest)
"""
"""What a script restoring the same outputs pays at least: Python start, hashing the inputs,
copying the output files (from a directory holding them, as a cache does)."""


def fresh_clone(ws: Path, dest: Path) -> Path:
    """A copy of the workspace as a fresh clone has it: manifest and models only."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ws, dest, ignore=shutil.ignore_patterns("build", ".epbuild"))
    return dest


def small_restore(ws: Path, cache: str, tmp: Path, runs: int) -> tuple[list[float], list[float]]:
    """Seconds of ``build --cache-only`` in fresh clones, and of the floor script. Bytecode
    is written and a first run is not counted, as for an installed epbuild (pip compiles
    it at install; ``PYTHONDONTWRITEBYTECODE`` would time the compiler instead)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    restore_s, floor_s = [], []
    for run in range(runs + 1):
        clone = fresh_clone(ws, tmp / "clone")
        cmd = [sys.executable, "-m", "epbuild", "-C", str(clone), "build", "--cache-only",
               "--cache", cache]  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        restored = time.perf_counter() - t0
        clone = fresh_clone(ws, tmp / "clone")
        floor = [sys.executable, "-c", FLOOR, str(ws / "build"), str(clone), str(clone / "build")]
        t0 = time.perf_counter()
        subprocess.run(floor, check=True, capture_output=True, env=env)
        if run:  # the first run writes the bytecode
            restore_s.append(restored)
            floor_s.append(time.perf_counter() - t0)
    return restore_s, floor_s


def _report_small(ws: Path, cache: str, tmp: Path, runs: int, n: int, size: int) -> int:
    restore_s, floor_s = small_restore(ws, cache, tmp, runs)
    restore, floor = statistics.median(restore_s), statistics.median(floor_s)
    print(f"fresh clone, {n} actions, {size / 1e6:.1f} MB of outputs:")
    print(f"  restore (CLI build --cache-only): {restore * 1000:.0f} ms  "
          f"[{', '.join(f'{x * 1000:.0f}' for x in restore_s)}]")  # fmt: skip
    print(f"  floor (python start + hash inputs + copy outputs): {floor * 1000:.0f} ms  "
          f"[{', '.join(f'{x * 1000:.0f}' for x in floor_s)}]")  # fmt: skip
    print(f"  ratio restore/floor (medians): {restore / floor:.2f}x (target <= 2x)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--small", action="store_true", help="only the fresh-clone restore of a small workspace"
    )
    args = ap.parse_args()

    from epbuild.api import Outcome, build, clean

    tmp = Path(tempfile.mkdtemp(prefix="epbuild-bench-restore-"))
    try:
        ws = make_workspace(tmp / "ws", SMALL if args.small else ())
        cache = str(tmp / "cache")
        t0 = time.perf_counter()
        first = build(ws, cache=cache, jobs=args.jobs)
        compile_s = time.perf_counter() - t0
        assert first.ok, [a.error for a in first.actions if a.error]
        n = first.count(Outcome.COMPILED)
        files = [p for p in (ws / "build").rglob("*") if p.is_file() and ".staging" not in p.parts]
        size = sum(p.stat().st_size for p in files)
        if args.small:
            return _report_small(ws, cache, tmp, args.runs, n, size)
        api_s, cli_s, cp_s, noop_s = [], [], [], []
        for _ in range(args.runs):
            clean(ws)
            t0 = time.perf_counter()
            result = build(ws, cache=cache, jobs=args.jobs)
            api_s.append(time.perf_counter() - t0)
            assert result.count(Outcome.RESTORED) == n, result.summary()
            clean(ws)
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "epbuild", "-C", str(ws), "build", "--cache", cache,
                   "-j", str(args.jobs)]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
            cli_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)  # all up to date now
            noop_s.append(time.perf_counter() - t0)
            shutil.rmtree(tmp / "copy", ignore_errors=True)
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", str(ws / "build"), str(tmp / "copy")], check=True)
            cp_s.append(time.perf_counter() - t0)
        api, cli, cp, noop = (statistics.median(x) for x in (api_s, cli_s, cp_s, noop_s))
        nlink = min(p.stat().st_nlink for p in files)
        print(f"model-zoo: {n} actions, {len(files)} output files, {size / 1e6:.1f} MB; "
              f"first build (compile + store) {compile_s:.1f}s at -j {args.jobs}")  # fmt: skip
        print(f"restore via API (median of {args.runs}): {api * 1000:.0f} ms  "
              f"[{', '.join(f'{x * 1000:.0f}' for x in api_s)}]")  # fmt: skip
        print(f"restore via CLI (incl. interpreter start): {cli * 1000:.0f} ms  "
              f"[{', '.join(f'{x * 1000:.0f}' for x in cli_s)}]")  # fmt: skip
        print(f"CLI no-op build (the interpreter-start floor): {noop * 1000:.0f} ms  "
              f"[{', '.join(f'{x * 1000:.0f}' for x in noop_s)}]")  # fmt: skip
        print(f"cp -r of the same files:  {cp * 1000:.0f} ms  "
              f"[{', '.join(f'{x * 1000:.0f}' for x in cp_s)}]")  # fmt: skip
        print(f"ratio restore/cp -r (medians): API {api / cp:.2f}x, CLI {cli / cp:.2f}x, CLI "
              f"minus its no-op floor {(cli - noop) / cp:.2f}x (target <= 2x); "
              f"outputs hard-linked: {'yes' if nlink >= 2 else 'no'}")  # fmt: skip
        return _report_small(ws, cache, tmp, args.runs, n, size)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
