"""Benchmark planning as the graph grows: ``epbuild status`` on a warm workspace.

    python benchmarks/bench_plan.py [--models 1000] [--targets 5] [--runs 5]
                                    [--also 100] [--profile FILE] [--keep DIR]

Generates ``--models`` distinct tiny models (16x16 MatMul-Relu) in one group compiled for
``--targets`` QNN HTP targets (one provider each: ``models × targets`` actions), records every
action as built with the library's own journal writer (``Journal.done``, the record a build
writes, with a small ctx model and context binary in place: no compile), warms the stat
cache with one ``status``, then times ``--runs`` fresh ``epbuild status`` processes (text and
``--json``) and reports the median beside the load average. ``--also 100`` repeats it at
100 models (the same number of targets) to show how the time grows. ``--profile FILE`` writes
a cProfile of one warm ``status`` (read it with ``python -m pstats FILE``). Needs ``onnx`` and
``numpy`` to make the models; the cache is off (``EPBUILD_CACHE=off``).
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

ENV = {**os.environ, "EPBUILD_CACHE": "off"}
TARGETS = [("69", "36"), ("73", "43"), ("75", "57"), ("79", "69"), ("73", "60"), ("81", "87")]
"""(htp_arch, soc_model) of well-known Snapdragon SoCs, one provider each."""


def make_workspace(root: Path, models: int, targets: int) -> None:
    """``models`` distinct tiny models in one group, for ``targets`` HTP targets."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    (root / "models").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(models):
        w = rng.standard_normal((16, 16), dtype=np.float32) * 0.1
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
            [numpy_helper.from_array(w, "W")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 9
        onnx.save(model, str(root / "models" / f"m{i:05d}.onnx"))
    providers = ""
    names = []
    for arch, soc in TARGETS[:targets]:
        name = f"v{arch}-{soc}"
        names.append(name)
        providers += (
            f'[providers."{name}"]\nep = "qnn"\n'
            f'options = {{ htp_arch = "{arch}", soc_model = "{soc}" }}\n\n'
        )
    (root / "epbuild.toml").write_text(
        providers + f'[groups.many]\nmodels = ["models/*.onnx"]\nproviders = {json.dumps(names)}\n'
    )


def record_built(root: Path) -> int:
    """Record every action as built through the journal writer, as a build does (``begin``,
    then ``done`` with the detail a QNN compile reports), its outputs in place (a ctx model
    and a context binary of a few bytes); returns the number of actions."""
    from epbuild.planning.workspace import open_workspace
    from epbuild.state.journal import ActionRecord, OutputRecord
    from epbuild.state.statcache import hash_file

    ws = open_workspace(root)
    for n, action in enumerate(ws.actions):
        key = ws.keys.compute(action)
        ctx = action.ctx_paths[0]
        outputs = {}
        for rel, payload in ((ctx, b"ctx"), (ctx[: -len(".onnx")] + "_qnn.bin", b"bin")):
            full = root / rel
            full.parent.mkdir(parents=True, exist_ok=True)
            full.write_bytes(action.id.encode() + payload)
            outputs[rel] = OutputRecord(full.stat().st_size, hash_file(str(full)))
        opts = action.provider.options
        model = {
            "compatibility": f"v2:6:2.51.0:5.51.0:{opts['htp_arch']}:{opts['soc_model']}:0:0",
            "context_nodes": 1,
            "cpu_nodes": 0,
            "cpu_op_types": {},
            "ctx": os.path.basename(ctx),
            "node_names": [f"QNNExecutionProvider_QNNExecutionProvider_{n}_1_0"],
            "source_nodes": 2,
        }
        detail = {"compiler": "compile_api", "models": {action.models[0]: model}}
        rec = ActionRecord(action.id, key.key, key.components, outputs, 0.2, 150 << 20,
                           time.time(), detail)  # fmt: skip
        ws.journal.begin(action.id, key.key)
        ws.journal.done(rec, sync=False)
    ws.journal.sync()
    return len(ws.actions)


def epbuild(root: Path, *args: str) -> float:
    """Seconds one fresh ``epbuild -C root ...`` process takes (it must succeed)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "epbuild", "-C", str(root), *args],
                          capture_output=True, text=True, env=ENV)  # fmt: skip
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"epbuild {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return elapsed


def check_all_up_to_date(root: Path, actions: int) -> None:
    proc = subprocess.run([sys.executable, "-m", "epbuild", "-C", str(root), "status", "--json"],
                          capture_output=True, text=True, env=ENV, check=True)  # fmt: skip
    doc = json.loads(proc.stdout)
    stale = [a["id"] for a in doc["actions"] if a["stale"]]
    if len(doc["actions"]) != actions or stale:
        sys.exit(f"expected {actions} up-to-date actions, {len(stale)} stale: {stale[:3]}")


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(tmp: Path, models: int, targets: int, runs: int, profile: str | None) -> dict:
    root = tmp / f"ws-{models}x{targets}"
    make_workspace(root, models, targets)
    actions = record_built(root)
    check_all_up_to_date(root, actions)  # also warms the stat cache
    text = [epbuild(root, "status") for _ in range(runs)]
    js = [epbuild(root, "status", "--json") for _ in range(runs)]
    if profile:
        code = (
            "import cProfile, sys; from epbuild.frontends.cli import main; "
            "cProfile.run('main(sys.argv[2:])', sys.argv[1])"
        )
        subprocess.run([sys.executable, "-c", code, profile, "-C", str(root), "status"],
                       capture_output=True, env=ENV, check=True)  # fmt: skip
    return {
        "actions": actions,
        "status_s": round(statistics.median(text), 3),
        "status_json_s": round(statistics.median(js), 3),
        "runs": runs,
        "load": load(),
        "workspace": root.name,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--targets", type=int, default=5, choices=range(1, len(TARGETS) + 1))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--also", type=int, default=0, help="also at this many models")
    ap.add_argument("--profile", help="write a cProfile of one warm status here")
    ap.add_argument("--keep", help="make the workspaces here and keep them")
    ns = ap.parse_args()
    tmp = Path(ns.keep or tempfile.mkdtemp(prefix="epbuild-bench-plan-"))
    tmp.mkdir(parents=True, exist_ok=True)
    report = []
    try:
        if ns.also:
            report.append(measure(tmp, ns.also, ns.targets, ns.runs, None))
        report.append(measure(tmp, ns.models, ns.targets, ns.runs, ns.profile))
    finally:
        if not ns.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
