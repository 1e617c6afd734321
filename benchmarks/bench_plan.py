"""Benchmark planning as the graph grows: ``epbuild status`` on a warm workspace.

    python benchmarks/bench_plan.py [--models 1000] [--targets 5] [--runs 5] [--also 100]
                                    [--baseline DIR] [--profile FILE] [--keep DIR]

Generates ``--models`` distinct tiny models (16x16 MatMul-Relu) in one group compiled for
``--targets`` QNN HTP targets (one provider each: ``models × targets`` actions), records every
action as built with the library's own journal writer (``begin``, then ``done`` with the
detail a QNN compile reports, as a build writes them; a small ctx model and context binary
in place: no compile), warms the stat cache with one ``status``, then times ``--runs`` fresh
``epbuild status`` processes (text and ``--json``) and reports the medians of their wall and
CPU (user + system) time beside the load average: on a shared machine the CPU time is the
steadier figure.

``--also 100`` repeats it at 100 models (the same number of targets) to show how the time
grows. ``--baseline DIR`` also times the ``epbuild`` package of another source tree (say
``git archive <commit> | tar -x -C DIR``), interleaved run by run with this one.
``--profile FILE`` writes a cProfile of one warm ``status`` (``python -m pstats FILE``).
``--keep DIR`` makes the workspaces there and reuses them next time. Needs ``onnx`` and
``numpy`` to make the models; the cache is off (``EPBUILD_CACHE=off``).
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

ENV = {**os.environ, "EPBUILD_CACHE": "off"}
TARGETS = [("69", "36"), ("73", "43"), ("75", "57"), ("79", "69"), ("73", "60"), ("81", "87")]
"""(htp_arch, soc_model) of well-known Snapdragon SoCs, one provider each."""


def make_workspace(root: Path, models: int, targets: int) -> None:
    """``models`` distinct tiny models in one group, for ``targets`` HTP targets."""
    for i in range(models):
        tiny_model(root / "models" / f"m{i:05d}.onnx", seed=i)
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
    from epbuild.kinds.compilekey import compile_key
    from epbuild.planning.workspace import open_workspace
    from epbuild.state.journal import ActionRecord, OutputRecord
    from epbuild.state.statcache import hash_file

    ws = open_workspace(root)
    for n, action in enumerate(ws.actions):
        key = compile_key(action, ws.keys)
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


FROM_SOURCE = (
    "import sys; src = sys.argv.pop(1); "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
    "sys.path.insert(0, src); import epbuild; "
    "assert epbuild.__file__.startswith(src), epbuild.__file__; "
    "from epbuild.frontends.cli import main; sys.exit(main(sys.argv[1:]))"
)
"""Run the epbuild package of a source tree (``--baseline``), not the installed one."""


def epbuild(root: Path, *args: str, source: str | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh ``epbuild -C root ...`` process (it must succeed),
    of the installed epbuild or the one in the ``source`` tree. The CPU time (user +
    system) is the steadier figure on a shared machine."""
    start = [sys.executable, "-m", "epbuild"] if source is None else [
        sys.executable, "-c", FROM_SOURCE, source]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([*start, "-C", str(root), *args],
                          capture_output=True, text=True, env=ENV)  # fmt: skip
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"epbuild {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return elapsed, cpu


def check_all_up_to_date(root: Path, actions: int) -> None:
    proc = subprocess.run([sys.executable, "-m", "epbuild", "-C", str(root), "status", "--json"],
                          capture_output=True, text=True, env=ENV, check=True)  # fmt: skip
    doc = json.loads(proc.stdout)
    stale = [a["id"] for a in doc["actions"] if a["stale"]]
    if len(doc["actions"]) != actions or stale:
        sys.exit(f"expected {actions} up-to-date actions, {len(stale)} stale: {stale[:3]}")


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(
    tmp: Path, models: int, targets: int, runs: int, profile: str | None, baseline: str | None
) -> dict[str, object]:
    root = tmp / f"ws-{models}x{targets}"
    if not (root / "epbuild.toml").exists():
        make_workspace(root, models, targets)
        actions = record_built(root)
    else:
        actions = models * targets
    check_all_up_to_date(root, actions)  # also warms the stat cache
    figures: dict[str, list[tuple[float, float]]] = {}
    for _ in range(runs):  # interleaved: the baseline and this tree see the same load
        for label, source in (("", None), ("baseline_", baseline)):
            if label and source is None:
                continue
            figures.setdefault(f"{label}status", []).append(epbuild(root, "status", source=source))
            figures.setdefault(f"{label}status_json", []).append(
                epbuild(root, "status", "--json", source=source)
            )
    if profile:
        code = (
            "import cProfile, sys; from epbuild.frontends.cli import main; "
            "cProfile.run('main(sys.argv[2:])', sys.argv[1])"
        )
        subprocess.run([sys.executable, "-c", code, profile, "-C", str(root), "status"],
                       capture_output=True, env=ENV, check=True)  # fmt: skip
    report: dict[str, object] = {"actions": actions, "runs": runs}
    for name, times in figures.items():
        report[f"{name}_s"] = round(statistics.median(t for t, _ in times), 3)
        report[f"{name}_cpu_s"] = round(statistics.median(c for _, c in times), 3)
    report["load"] = load()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--targets", type=int, default=5, choices=range(1, len(TARGETS) + 1))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--also", type=int, default=0, help="also at this many models")
    ap.add_argument("--profile", help="write a cProfile of one warm status here")
    ap.add_argument("--keep", help="make the workspaces here and keep them (and reuse them)")
    ap.add_argument(
        "--baseline", help="also time the epbuild package of this source tree, interleaved"
    )
    ns = ap.parse_args()
    tmp = Path(ns.keep or tempfile.mkdtemp(prefix="epbuild-bench-plan-"))
    tmp.mkdir(parents=True, exist_ok=True)
    report = []
    try:
        if ns.also:
            report.append(measure(tmp, ns.also, ns.targets, ns.runs, None, ns.baseline))
        report.append(measure(tmp, ns.models, ns.targets, ns.runs, ns.profile, ns.baseline))
    finally:
        if not ns.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
