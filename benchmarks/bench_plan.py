"""Benchmark planning as the graph grows: ``epbuild status`` and ``epbuild cache key``, cold
and warm.

    python benchmarks/bench_plan.py [--models 1000] [--targets 5] [--runs 5] [--also 100]
                                    [--baseline DIR] [--profile FILE] [--keep DIR]

Generates ``--models`` distinct small CNNs (``conv_model``: 91 nodes in 21 KB, near the
ONNX SqueezeNet's 105 in 15 KB, each with its own weights; every tenth with its weights in
an external-data file, as torch.onnx writes them) in one group compiled for ``--targets`` QNN
HTP targets (one provider each: ``models × targets`` actions).

Cold: the workspace never built (no state directory, as on a fresh CI runner): times
``--runs`` fresh ``epbuild status`` processes (text and ``--json``) and ``epbuild cache
key`` ones; every model is read for its external-data references. Then it records every
action as built with the library's own journal writer (``begin``, then ``done`` with the
detail a QNN compile reports, as a build writes them; a small ctx model and context binary
in place: no compile), warms the stat cache with one ``status`` and times the same commands
warm. It reports the medians of their wall and CPU (user + system) time beside the load
average: on a shared machine the CPU time is the steadier figure.

It also times (CPU), each in a fresh interpreter, finding the external-data references of
all the models: with epbuild's ``read_external_refs`` (what a key reads), with its
whole-model reader ``read_model``, and with onnx's own C++ parser (``import onnx``, then
``onnx.load`` without the external data; alone, and with onnx's walk of every tensor).

``--also 100`` repeats it at 100 models (the same number of targets) to show how the time
grows. ``--baseline DIR`` also times the ``epbuild`` package of another source tree (say
``git archive <commit> | tar -x -C DIR``), interleaved run by run with this one.
``--profile FILE`` writes a cProfile of one cold ``status`` (``python -m pstats FILE``).
``--keep DIR`` makes the workspaces there and reuses them next time. Needs ``onnx`` and
``numpy`` to make the models; the cache is off (``EPBUILD_CACHE=off``). The processes keep
their bytecode in a temporary ``PYTHONPYCACHEPREFIX``, as an installed package keeps it.
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

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
ENV["EPBUILD_CACHE"] = "off"
ENV.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "epbuild-bench-pyc"))
TARGETS = [("69", "36"), ("73", "43"), ("75", "57"), ("79", "69"), ("73", "60"), ("81", "87")]
"""(htp_arch, soc_model) of well-known Snapdragon SoCs, one provider each."""


BLOCKS = 40
"""Conv-Relu blocks of ``conv_model``: 91 nodes, 21 KB (the ONNX SqueezeNet: 105, 15 KB)."""
EXTERNAL_EVERY = 10
"""Every tenth model keeps its weights in an external-data file."""


def conv_model(path: Path, seed: int, external: bool = False) -> None:
    """A small CNN: ``BLOCKS`` blocks of a 3x3 Conv (3 channels, with its attributes) and a
    Relu, a residual Add every fourth block, a global average pool; weights drawn from
    ``seed``. ``external``: every tensor in ``<name>.data`` beside it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for b in range(BLOCKS):
        w = rng.standard_normal((3, 3, 3, 3), dtype=np.float32) * 0.1
        inits.append(numpy_helper.from_array(w, f"w{b}"))
        inits.append(numpy_helper.from_array(np.zeros(3, np.float32), f"b{b}"))
        conv = helper.make_node(
            "Conv",
            [x, f"w{b}", f"b{b}"],
            [f"c{b}"],
            name=f"conv{b}",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[1, 1],
            dilations=[1, 1],
            group=1,
        )
        nodes.append(conv)
        nodes.append(helper.make_node("Relu", [f"c{b}"], [f"r{b}"], name=f"relu{b}"))
        y = f"r{b}"
        if b % 4 == 3:
            nodes.append(helper.make_node("Add", [y, x], [f"a{b}"], name=f"add{b}"))
            y = f"a{b}"
        x = y
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["y"], name="pool"))
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 1, 1])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(
        model,
        str(path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=0,
    )


def make_workspace(root: Path, models: int, targets: int) -> None:
    """``models`` distinct small CNNs in one group, for ``targets`` HTP targets."""
    for i in range(models):
        conv_model(root / "models" / f"m{i:05d}.onnx", seed=i, external=i % EXTERNAL_EVERY == 0)
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


def plan(root: Path) -> list[dict[str, object]]:
    proc = subprocess.run([sys.executable, "-m", "epbuild", "-C", str(root), "status", "--json"],
                          capture_output=True, text=True, env=ENV, check=True)  # fmt: skip
    actions: list[dict[str, object]] = json.loads(proc.stdout)["actions"]
    return actions


def check_all_up_to_date(root: Path, actions: int) -> None:
    doc = plan(root)  # also warms the stat cache
    stale = [a["id"] for a in doc if a["stale"]]
    if len(doc) != actions or stale:
        sys.exit(f"expected {actions} up-to-date actions, {len(stale)} stale: {stale[:3]}")


def check_never_built(root: Path, actions: int) -> None:
    doc = plan(root)
    fresh = [a["id"] for a in doc if a["reasons"] != ["never built"]]
    if len(doc) != actions or fresh:
        sys.exit(f"expected {actions} never-built actions, {len(fresh)} others: {fresh[:3]}")


COMMANDS = {
    "status": ("status",),
    "status_json": ("status", "--json"),
    "cache_key": ("cache", "key"),
}
"""What is timed, by the name of its figure."""


def time_commands(
    root: Path, runs: int, baseline: str | None, state: Path | None, prefix: str
) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) of ``runs`` runs of each of ``COMMANDS``, interleaved with the baseline
    tree's (the two see the same load); ``state``: a directory removed before each run
    (cold: whatever a command leaves there, none leaves anything today, is not reused)."""
    figures: dict[str, list[tuple[float, float]]] = {}
    for _ in range(runs):
        for label, source in (("", None), ("baseline_", baseline)):
            if label and source is None:
                continue
            for name, args in COMMANDS.items():
                if state is not None:
                    shutil.rmtree(state, ignore_errors=True)
                figures.setdefault(f"{label}{prefix}{name}", []).append(
                    epbuild(root, *args, source=source)
                )
    return figures


READERS = {
    "read_external_refs": (
        "from epbuild.onnx.proto import read_external_refs",
        "for p in paths: read_external_refs(p)",
    ),
    "read_model": (
        "from epbuild.onnx.proto import read_model",
        "for p in paths: read_model(p).external_refs",
    ),
    "onnx_parse": (
        "import onnx",
        "for p in paths: onnx.load(p, load_external_data=False)",
    ),
    "onnx_parse_and_walk": (
        "import onnx\nfrom onnx.external_data_helper import _get_all_tensors, uses_external_data",
        "for p in paths:\n"
        "    m = onnx.load(p, load_external_data=False)\n"
        "    [t.name for t in _get_all_tensors(m) if uses_external_data(t)]",
    ),
}
"""Ways to find the external-data references of every model, (imports, reading), each timed
in a fresh interpreter: epbuild's two readers, and onnx's C++ parser alone (what it costs
before a single reference is found) and with onnx's own walk of every tensor."""


def time_readers(root: Path) -> dict[str, dict[str, float]]:
    """CPU seconds of the imports and of the reading of each of ``READERS`` over the
    workspace's models."""
    paths = sorted(str(p) for p in (root / "models").glob("*.onnx"))
    found: dict[str, dict[str, float]] = {}
    for name, (imports, body) in READERS.items():
        code = (
            "import json, sys, time\npaths = json.load(sys.stdin)\nstart = time.process_time()\n"
            f"{imports}\nimported = time.process_time()\n{body}\nend = time.process_time()\n"
            "print(imported - start, end - imported)"
        )
        command = [sys.executable, "-c", code]
        proc = subprocess.run(
            command, input=json.dumps(paths), capture_output=True, text=True, env=ENV, check=True
        )
        imported, read = map(float, proc.stdout.split())
        found[name] = {"import_cpu_s": round(imported, 3), "read_cpu_s": round(read, 3)}
    return found


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(
    tmp: Path, models: int, targets: int, runs: int, profile: str | None, baseline: str | None
) -> dict[str, object]:
    root = tmp / f"ws-{models}x{targets}"
    state = root / ".epbuild"
    actions = models * targets
    if not (root / "epbuild.toml").exists():
        make_workspace(root, models, targets)
    shutil.rmtree(state, ignore_errors=True)  # (a kept workspace: cold again)
    check_never_built(root, actions)  # also writes the bytecode
    figures = time_commands(root, runs, baseline, state, "cold_")
    if profile:
        code = (
            "import cProfile, sys; from epbuild.frontends.cli import main; "
            "cProfile.run('main(sys.argv[2:])', sys.argv[1])"
        )
        subprocess.run([sys.executable, "-c", code, profile, "-C", str(root), "status"],
                       capture_output=True, env=ENV, check=True)  # fmt: skip
    shutil.rmtree(state, ignore_errors=True)
    if record_built(root) != actions:
        sys.exit("record_built: not every action was recorded")
    check_all_up_to_date(root, actions)  # also warms the stat cache
    figures.update(time_commands(root, runs, baseline, None, "warm_"))
    report: dict[str, object] = {"actions": actions, "runs": runs}
    for name, times in figures.items():
        report[f"{name}_s"] = round(statistics.median(t for t, _ in times), 3)
        report[f"{name}_cpu_s"] = round(statistics.median(c for _, c in times), 3)
    report[f"readers_{models}_models"] = time_readers(root)
    report["load"] = load()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=1000)
    ap.add_argument("--targets", type=int, default=5, choices=range(1, len(TARGETS) + 1))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--also", type=int, default=0, help="also at this many models")
    ap.add_argument("--profile", help="write a cProfile of one cold status here")
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
