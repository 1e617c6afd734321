"""Benchmark epbuild at scale: many tiny generated models.

    python benchmarks/bench_scale.py [--actions 1000] [--status-actions 10000] [--runs 5]
                                     [--skip-build]

Reports:
- full build of ``--actions`` actions (one tiny model each, one HTP target, -j = CPUs);
- the no-op build of that workspace, and its ratio to ``python -c "import onnx"`` (target ≤ 1);
- ``epbuild status`` at ``--status-actions`` actions with a cold and a warm stat cache, on
  fabricated state (every action recorded as built, with its outputs present: no compile);
- the coordinator's peak RSS for the no-op build and for status at that scale.

Each command runs as a fresh process; the cache is off (``EPBUILD_CACHE=off``) so the full
build compiles.
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

RSS_WRAPPER = (
    "import resource, sys\n"
    "from epbuild.frontends.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('EPBUILD_MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
    " file=sys.stderr)\n"
    "sys.exit(rc)\n"
)
ENV = {**os.environ, "EPBUILD_CACHE": "off"}


def tiny_model(path: Path, seed: int = 0) -> None:
    """A 16x16 MatMul-Relu model."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((16, 16), dtype=np.float32) * 0.1
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def make_workspace(root: Path, count: int) -> None:
    """``count`` distinct tiny models (``tiny_model``), one action each."""
    for i in range(count):
        tiny_model(root / "models" / f"m{i:05d}.onnx", seed=i)
    (root / "epbuild.toml").write_text(
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n\n'
        '[groups.many]\nmodels = ["models/*.onnx"]\nproviders = ["htp"]\n'
    )


def fabricate_state(root: Path) -> None:
    """Record every action as built, with a small output file in place (no compile)."""
    from epbuild.fs import atomic_write_bytes
    from epbuild.kinds.compilekey import compile_key
    from epbuild.planning.workspace import open_workspace
    from epbuild.state.journal import _HEADER_LINE, ActionRecord, OutputRecord, _done_dict, _line
    from epbuild.state.statcache import hash_file

    ws = open_workspace(root)
    lines = [_HEADER_LINE]
    for action in ws.actions:
        key = compile_key(action, ws.keys)
        rel = action.ctx_paths[0]
        full = root / rel
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(action.id.encode() * 8)
        out = {rel: OutputRecord(full.stat().st_size, hash_file(str(full)))}
        rec = ActionRecord(action.id, key.key, key.components, out, 0.2, 160 << 20, time.time())
        lines.append(_line(_done_dict(rec)))
    atomic_write_bytes(os.path.join(ws.state_dir, "state.jsonl"), b"".join(lines))


def run(args: list[str], cwd: Path | None = None) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one fresh epbuild process."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *args], cwd=cwd,
                          capture_output=True, text=True, env=ENV)  # fmt: skip
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"epbuild {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rss = int(proc.stderr.rsplit("EPBUILD_MAXRSS", 1)[1].split()[0]) * 1024
    return elapsed, rss


def import_onnx(runs: int) -> float:
    def once() -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import onnx"], check=True)
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", type=int, default=1000)
    ap.add_argument("--status-actions", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip-build", action="store_true", help="only the status figures")
    ns = ap.parse_args()
    report: dict[str, object] = {"cpus": os.cpu_count()}
    tmp = Path(tempfile.mkdtemp(prefix="epbuild-bench-scale-"))
    try:
        onnx_s = import_onnx(ns.runs)
        report["import_onnx_s"] = round(onnx_s, 3)
        if not ns.skip_build:
            ws = tmp / "build1k"
            make_workspace(ws, ns.actions)
            full, full_rss = run(["-C", str(ws), "build", "--json"])
            report["full_build"] = {"actions": ns.actions, "seconds": round(full, 1),
                                    "per_action_s": round(full / ns.actions, 3),
                                    "coordinator_peak_rss_mb": full_rss >> 20}  # fmt: skip
            noops = [run(["-C", str(ws), "build"]) for _ in range(ns.runs + 1)][1:]
            noop = statistics.median(t for t, _ in noops)
            report["noop_build"] = {"actions": ns.actions, "seconds": round(noop, 3),
                                    "ratio_to_import_onnx": round(noop / onnx_s, 2),
                                    "peak_rss_mb": max(r for _, r in noops) >> 20}  # fmt: skip
        ws = tmp / "status10k"
        make_workspace(ws, ns.status_actions)
        fabricate_state(ws)
        stats = ws / ".epbuild" / "statcache.json"
        cold = []
        for _ in range(ns.runs):
            stats.unlink(missing_ok=True)
            cold.append(run(["-C", str(ws), "status", "--json"]))
        warm = [run(["-C", str(ws), "status", "--json"]) for _ in range(ns.runs)]
        noop10k = [run(["-C", str(ws), "build"]) for _ in range(ns.runs)]
        report["status"] = {
            "actions": ns.status_actions,
            "cold_stat_cache_s": round(statistics.median(t for t, _ in cold), 3),
            "warm_stat_cache_s": round(statistics.median(t for t, _ in warm), 3),
            "noop_build_s": round(statistics.median(t for t, _ in noop10k), 3),
            "coordinator_peak_rss_mb": max(r for _, r in cold + warm + noop10k) >> 20,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
