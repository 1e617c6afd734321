"""Benchmark epbuild on an LLM-sized workspace: parts of prefill + decode sharing weights.

    python benchmarks/bench_llm.py [--parts 4] [--layers 24] [--hidden 2048] [--runs 3]
                                   [--workdir DIR] [--keep] [--skip-hand] [--json]

The workspace: ``--parts`` parts, each a prefill graph (sequence length 128) and a decode
graph (sequence length 1) of the same stack of ``--layers`` residual blocks
(``h = h + Relu(h @ W_i)``, ``W_i`` of ``hidden x hidden`` fp32). Both graphs of a part
reference ONE external data file (``models/partK/weights.bin``, same offsets); each part is
one sharing group (``share_weights = true``, ``embed_mode = 0``) for one QNN HTP target
(soc_model 60 / htp_arch 73). Weights are seeded, so runs are comparable. The defaults give
4 x 24 x 2048² x 4 bytes = 1.6 GB of weights (~400 MB per part); the run needs about 3 x
that on disk (inputs, outputs, cache, a ``cp -r`` copy; the clone's inputs are hard links).

Measured in one run, on the real QNN EP, each command a fresh process (medians of ``--runs``
for the cheap ones):
- full build at ``-j 1`` and ``-j 2`` (cache on, fresh and empty: what a user's first build
  pays), vs a hand-written loop in one Python process doing the same sessions as the worker
  (``ep.context_*`` entries, ``ep.share_ep_contexts`` / ``ep.stop_share_ep_contexts`` on the
  last model of a part, the same provider options); target ``-j 1`` <= 1.1 x the loop;
- the no-op build; touching every input then building (re-hash only, nothing compiles);
- rewriting one part's weights (another seed), then building: exactly that part rebuilds;
- restoring everything from the cache into a fresh clone (the sources at a new path, no
  state), vs ``cp -r`` of the outputs and vs ``sha256sum`` of the inputs; target restore
  <= 1.2 x ``sha256sum`` (a clone must hash its inputs to know its keys);
- ``epbuild verify``;
- the coordinator's peak RSS over all commands (target < 200 MB): the peak of the epbuild
  process itself (``VmHWM``; workers are separate subprocesses and not counted), and beside
  it the largest worker's peak (``RUSAGE_CHILDREN``).

Prints a markdown table (measurement, figure, target, pass/fail), or the figures as JSON with
``--json``. Exits 1 when a correctness check fails (a compile where none was due, the wrong
part rebuilt, an action not restored, verify reporting problems); missed timing or memory
targets show as ``fail`` in the table but do not change the exit status.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PREFILL_SEQ = 128
DECODE_SEQ = 1
ALIGN = 4096
WEIGHTS = "weights.bin"
PROVIDER = "htp"
PROVIDER_OPTIONS = {"htp_arch": "73", "soc_model": "60"}

# The coordinator's own peak: VmHWM of this process's memory map. After exec the map is
# new, so unlike ru_maxrss it cannot inherit the peak of whoever forked us. Workers are
# subprocesses of the coordinator: their largest peak is RUSAGE_CHILDREN's ru_maxrss.
RSS_WRAPPER = (
    "import resource, sys\n"
    "from epbuild.frontends.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "try:\n"
    "    with open('/proc/self/status') as f:\n"
    "        hwm = next(int(x.split()[1]) for x in f if x.startswith('VmHWM:'))\n"
    "except (OSError, StopIteration):\n"
    "    pass\n"
    "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "print('EPBUILD_RSS_KB', hwm, kids, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)

# What the worker does for one sharing group (epbuild/executors/worker.py), for every part
# in manifest order, in one process: sessions created in order, destroyed in reverse.
HAND_LOOP = r"""
import os, sys, tomllib
import onnxruntime as ort, onnxruntime_qnn
ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
manifest = tomllib.load(open("epbuild.toml", "rb"))
options = {"backend_type": "htp", **manifest["providers"]["htp"]["options"]}
for name, group in manifest["groups"].items():
    out = f"hand/{name}"
    os.makedirs(out, exist_ok=True)
    sessions = []
    for index, model in enumerate(group["models"]):
        so = ort.SessionOptions()
        stem = os.path.basename(model)[:-5]
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", f"{out}/{stem}_ctx.onnx")
        so.add_session_config_entry("ep.context_embed_mode", "0")
        so.add_session_config_entry("ep.share_ep_contexts", "1")
        if index == len(group["models"]) - 1:
            so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
        so.add_provider_for_devices(devices, options)
        sessions.append(ort.InferenceSession(model, so))
    while sessions:
        sessions.pop()
    if not any(f.endswith(".bin") for f in os.listdir(out)):
        sys.exit(f"{out}: no context binary written")
"""


# --- the workspace ----------------------------------------------------------------------


def part_name(index: int) -> str:
    """Group name of part ``index``: ``part0``."""
    return f"part{index}"


def layer_bytes(hidden: int) -> int:
    """Bytes one layer's weight takes in the external data file (aligned)."""
    size = hidden * hidden * 4
    return (size + ALIGN - 1) // ALIGN * ALIGN


def write_weights(path: Path, layers: int, hidden: int, seed: int) -> None:
    """One part's external data: ``layers`` fp32 ``hidden²`` matrices, one at a time."""
    import numpy as np

    rng = np.random.default_rng(seed)
    scale = np.float32(0.5 / hidden**0.5)
    pad = layer_bytes(hidden) - hidden * hidden * 4
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for _ in range(layers):
            w = rng.standard_normal((hidden, hidden), dtype=np.float32) * scale
            f.write(w.tobytes())
            f.write(b"\0" * pad)
    os.replace(tmp, path)  # a new inode, as an exporter writing the file anew gives


def block_graph(name: str, seq: int, layers: int, hidden: int) -> Any:
    """``y = x`` through ``layers`` residual blocks ``h + Relu(h @ W_i)``; W_i external."""
    from onnx import TensorProto, helper

    nodes, inits = [], []
    h = "x"
    for i in range(layers):
        w = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[hidden, hidden])
        w.data_location = TensorProto.EXTERNAL
        location = {"location": WEIGHTS, "offset": i * layer_bytes(hidden)}
        location["length"] = hidden * hidden * 4
        for key, value in location.items():
            w.external_data.add(key=key, value=str(value))
        inits.append(w)
        out = "y" if i == layers - 1 else f"h{i}"
        nodes += [
            helper.make_node("MatMul", [h, f"W{i}"], [f"m{i}"], name=f"matmul{i}"),
            helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}"),
            helper.make_node("Add", [h, f"r{i}"], [out], name=f"add{i}"),
        ]
        h = out
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def manifest_text(parts: int) -> str:
    """The manifest: one QNN HTP target, one sharing group per part."""
    opts = ", ".join(f'{k} = "{v}"' for k, v in PROVIDER_OPTIONS.items())
    lines = [f'[providers.{PROVIDER}]\nep = "qnn"\noptions = {{ {opts} }}\n']
    for k in range(parts):
        name = part_name(k)
        lines.append(
            f"[groups.{name}]\n"
            f'models = ["models/{name}/prefill.onnx", "models/{name}/decode.onnx"]\n'
            f'providers = ["{PROVIDER}"]\nshare_weights = true\nembed_mode = 0\n'
        )
    return "\n".join(lines)


def make_workspace(root: Path, parts: int, layers: int, hidden: int, seed: int = 0) -> None:
    """``root/epbuild.toml`` and ``models/partK/{prefill,decode}.onnx`` + ``weights.bin``."""
    root.mkdir(parents=True, exist_ok=True)
    for k in range(parts):
        d = root / "models" / part_name(k)
        d.mkdir(parents=True, exist_ok=True)
        write_weights(d / WEIGHTS, layers, hidden, seed + k)
        for stem, seq in (("prefill", PREFILL_SEQ), ("decode", DECODE_SEQ)):
            model = block_graph(f"{part_name(k)}_{stem}", seq, layers, hidden)
            (d / f"{stem}.onnx").write_bytes(model.SerializeToString())
    (root / "epbuild.toml").write_text(manifest_text(parts), encoding="utf-8")


def input_files(root: Path) -> list[Path]:
    """Every input of the workspace: the manifest, models and external data files."""
    return [root / "epbuild.toml", *sorted(p for p in (root / "models").rglob("*") if p.is_file())]


# --- running commands ----------------------------------------------------------------------


class Run:
    """One finished epbuild command: seconds, coordinator and largest-worker peak RSS."""

    def __init__(self, seconds: float, rss: int, workers_rss: int, stdout: str, rc: int) -> None:
        self.returncode = rc
        self.seconds = seconds
        self.rss = rss
        self.workers_rss = workers_rss
        self.stdout = stdout

    def json(self) -> Any:
        return json.loads(self.stdout)


class Bench:
    """Runs epbuild commands as fresh processes and keeps every coordinator peak."""

    def __init__(self, verbose: bool) -> None:
        self.env = {**os.environ}
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package has it
        self.verbose = verbose
        self.peaks: dict[str, int] = {}
        self.worker_peak = 0

    def note(self, text: str) -> None:
        if self.verbose:
            print(f"bench_llm: {text}", file=sys.stderr, flush=True)

    def epbuild(
        self, label: str, ws: Path, args: Sequence[str], cache: Path | None, *, ok: int = 0
    ) -> Run:
        """``epbuild -C ws ARGS`` with the cache at ``cache`` (None: off); exit status 0, or
        up to ``ok``, else the benchmark stops with the command's output."""
        env = {**self.env, "EPBUILD_CACHE": str(cache) if cache else "off"}
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", RSS_WRAPPER, "-C", str(ws), *args],
            capture_output=True,
            text=True,
            env=env,
        )
        elapsed = time.perf_counter() - t0
        if not 0 <= proc.returncode <= ok or "EPBUILD_RSS_KB" not in proc.stderr:
            sys.exit(
                f"epbuild {' '.join(args)} failed ({proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
            )
        fields = proc.stderr.rsplit("EPBUILD_RSS_KB", 1)[1].split()
        run = Run(
            elapsed, int(fields[0]) * 1024, int(fields[1]) * 1024, proc.stdout, proc.returncode
        )
        self.peaks[label] = max(self.peaks.get(label, 0), run.rss)
        self.worker_peak = max(self.worker_peak, run.workers_rss)
        self.note(f"{label}: {elapsed:.2f} s, coordinator {run.rss >> 20} MB")
        return run

    def timed(self, label: str, cmd: Sequence[str], cwd: Path) -> float:
        """Seconds of one other command (must succeed)."""
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=self.env)
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"{label} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
        self.note(f"{label}: {elapsed:.2f} s")
        return elapsed


def outcomes(doc: dict[str, Any]) -> dict[str, str]:
    """Action id → outcome of a ``build --json`` document."""
    return {a["id"]: a["outcome"] for a in doc["actions"]}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def repeat(runs: int, once: Callable[[], float]) -> float:
    return median([once() for _ in range(runs)])


def reset(ws: Path) -> None:
    """Remove the outputs and state of ``ws`` (not its inputs)."""
    for d in ("build", ".epbuild", "hand"):
        shutil.rmtree(ws / d, ignore_errors=True)


def link_tree(src: Path, dest: Path) -> None:
    """``dest``: the sources of ``src`` (manifest, models), hard-linked where possible."""

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    dest.mkdir(parents=True)
    shutil.copy2(src / "epbuild.toml", dest / "epbuild.toml")
    shutil.copytree(src / "models", dest / "models", copy_function=link)


# --- the measurements ----------------------------------------------------------------------


def measure(ns: argparse.Namespace, tmp: Path, bench: Bench) -> dict[str, Any]:
    """Every figure of the benchmark, as a JSON-able dict."""
    py = sys.executable
    ws = tmp / "ws"
    parts, runs = ns.parts, ns.runs
    ids = [f"{part_name(k)}/{PROVIDER}" for k in range(parts)]
    bench.note(f"generating {parts} parts x {ns.layers} layers x {ns.hidden}² in {ws}")
    t0 = time.perf_counter()
    make_workspace(ws, parts, ns.layers, ns.hidden)
    inputs = input_files(ws)
    fig: dict[str, Any] = {
        "parts": parts,
        "layers": ns.layers,
        "hidden": ns.hidden,
        "weights_mb": round(sum(p.stat().st_size for p in ws.rglob(WEIGHTS)) / 1e6, 1),
        "input_files": len(inputs),
        "cpus": os.cpu_count(),
        "generate_s": round(time.perf_counter() - t0, 2),
    }
    checks: dict[str, bool] = {}
    subprocess.run([py, "-m", "compileall", "-q", str(ROOT / "epbuild")], check=True)
    bench.timed("warm-up import", [py, "-c", "import onnxruntime, onnxruntime_qnn"], ws)

    # Full builds: the hand loop, then epbuild at -j 1 and -j 2, each from nothing.
    if not ns.skip_hand:
        fig["hand_loop_s"] = round(bench.timed("hand loop", [py, "-c", HAND_LOOP], ws), 2)
        reset(ws)
    for jobs in (1, 2):
        cache = tmp / f"cache-j{jobs}"
        shutil.rmtree(cache, ignore_errors=True)
        reset(ws)
        run = bench.epbuild(f"build -j {jobs}", ws, ["build", "--json", "-j", str(jobs)], cache)
        fig[f"full_j{jobs}_s"] = round(run.seconds, 2)
        # The workers' compile time alone (sessions created and destroyed, outputs checked).
        compile_s = sum(a.get("seconds") or 0 for a in run.json()["actions"])
        fig[f"full_j{jobs}_action_s"] = round(compile_s, 2)
        checks[f"full build -j {jobs} compiles every part"] = set(
            outcomes(run.json()).values()
        ) == {"compiled"}
        if jobs == 1:
            shutil.rmtree(cache, ignore_errors=True)  # the -j 2 build's cache is the one kept
    cache = tmp / "cache-j2"  # serves the restores below
    if "hand_loop_s" in fig:
        fig["j1_vs_hand"] = round(fig["full_j1_s"] / fig["hand_loop_s"], 3)
        fig["j2_vs_hand"] = round(fig["full_j2_s"] / fig["hand_loop_s"], 3)
    outputs = [p for p in (ws / "build").rglob("*") if p.is_file() and ".staging" not in p.parts]
    fig["outputs_mb"] = round(sum(p.stat().st_size for p in outputs) / 1e6, 1)

    # No-op, and touch-all (every input's mtime moves: re-hash, nothing compiles).
    bench.epbuild("no-op", ws, ["build"], cache)  # records the no-op fingerprint
    fig["noop_s"] = round(
        repeat(runs, lambda: bench.epbuild("no-op", ws, ["build"], cache).seconds), 3
    )

    def touch_build() -> float:
        now = time.time()
        for i, p in enumerate(inputs):
            os.utime(p, (now + 1 + i * 1e-3, now + 1 + i * 1e-3))
        run = bench.epbuild("touch-all build", ws, ["build", "--json"], cache)
        checks["touch-all rebuilds nothing"] = checks.get("touch-all rebuilds nothing", True) and (
            set(outcomes(run.json()).values()) == {"up_to_date"}
        )
        return run.seconds

    fig["touch_all_build_s"] = round(repeat(runs, touch_build), 3)

    # One part's weights change: exactly that part rebuilds.
    changed = part_name(1 if parts > 1 else 0)
    write_weights(ws / "models" / changed / WEIGHTS, ns.layers, ns.hidden, seed=1000)
    run = bench.epbuild("change one part", ws, ["build", "--json", "-j", "2"], cache)
    got = outcomes(run.json())
    rebuilt = sorted(i for i, o in got.items() if o == "compiled")
    fig["change_one_part_s"] = round(run.seconds, 2)
    fig["change_one_part_rebuilt"] = rebuilt
    checks["changing one part rebuilds exactly it"] = rebuilt == [f"{changed}/{PROVIDER}"] and all(
        o == "up_to_date" for i, o in got.items() if i != f"{changed}/{PROVIDER}"
    )

    # Restore into a fresh clone vs cp -r of the outputs vs sha256sum of the inputs.
    clone = tmp / "clone"
    clone_inputs = [clone / p.relative_to(ws) for p in inputs]

    def restore() -> float:
        shutil.rmtree(clone, ignore_errors=True)
        link_tree(ws, clone)
        run = bench.epbuild("restore", clone, ["build", "--json", "-j", "2"], cache)
        ok = outcomes(run.json()) == dict.fromkeys(ids, "restored")
        checks["clone restores every part"] = checks.get("clone restores every part", True) and ok
        return run.seconds

    def copy_outputs() -> float:
        shutil.rmtree(tmp / "copy", ignore_errors=True)
        return bench.timed("cp -r outputs", ["cp", "-r", str(ws / "build"), str(tmp / "copy")], tmp)

    def hash_inputs() -> float:
        return bench.timed("sha256sum inputs", ["sha256sum", *map(str, clone_inputs)], tmp)

    fig["restore_s"] = round(repeat(runs, restore), 3)
    fig["cp_r_outputs_s"] = round(repeat(runs, copy_outputs), 3)
    fig["sha256sum_inputs_s"] = round(repeat(runs, hash_inputs), 3)
    fig["restore_vs_sha256sum"] = round(fig["restore_s"] / fig["sha256sum_inputs_s"], 3)
    fig["restore_vs_cp_r"] = round(fig["restore_s"] / fig["cp_r_outputs_s"], 3)
    shutil.rmtree(tmp / "copy", ignore_errors=True)

    # verify re-reads every output; exit 1 means it found a problem.
    def verify() -> float:
        run = bench.epbuild("verify", ws, ["verify", "--json"], cache, ok=1)
        if run.returncode:
            fig["verify_problems"] = run.stdout[-3000:]
        checks["verify finds no problem"] = checks.get("verify finds no problem", True) and (
            run.returncode == 0
        )
        return run.seconds

    fig["verify_s"] = round(repeat(runs, verify), 3)

    fig["coordinator_peak_rss_mb"] = {k: v >> 20 for k, v in bench.peaks.items()}
    fig["coordinator_peak_rss_max_mb"] = max(bench.peaks.values()) >> 20
    fig["worker_peak_rss_mb"] = bench.worker_peak >> 20
    fig["checks"] = checks
    return fig


def verdict(ok: bool) -> str:
    return "pass" if ok else "**fail**"


def table(fig: dict[str, Any]) -> str:
    """The markdown table: measurement, figure, target, pass/fail."""
    hand = fig.get("hand_loop_s")
    parts = fig["parts"]
    gb = fig["weights_mb"] / 1000
    rows: list[tuple[str, str, str, str]] = []
    if hand is not None:
        rows.append((f"hand-written loop, one process ({parts} groups)", f"{hand:.2f} s", "", ""))
    for jobs in (1, 2):
        t = fig[f"full_j{jobs}_s"]
        ratio = f" ({t / hand:.2f} × loop)" if hand else ""
        target, ok = ("≤ 1.10 × loop", verdict(t <= 1.1 * hand)) if jobs == 1 and hand else ("", "")
        rows.append((f"`epbuild build -j {jobs}` (fresh cache)", f"{t:.2f} s{ratio}", target, ok))
    rows += [
        ("no-op `epbuild build`", f"{fig['noop_s'] * 1000:.0f} ms", "", ""),
        (
            f"touch all inputs, build (re-hash {gb:.2f} GB)",
            f"{fig['touch_all_build_s']:.2f} s",
            "nothing compiles",
            verdict(fig["checks"]["touch-all rebuilds nothing"]),
        ),
        (
            "new weights for one part, build",
            f"{fig['change_one_part_s']:.2f} s; rebuilt "
            + ", ".join(fig["change_one_part_rebuilt"]),
            "exactly that part",
            verdict(fig["checks"]["changing one part rebuilds exactly it"]),
        ),
        (
            "restore into a fresh clone",
            f"{fig['restore_s']:.2f} s ({fig['restore_vs_sha256sum']:.2f} × sha256sum, "
            f"{fig['restore_vs_cp_r']:.2f} × cp -r)",
            "≤ 1.2 × sha256sum",
            verdict(
                fig["checks"]["clone restores every part"] and fig["restore_vs_sha256sum"] <= 1.2
            ),
        ),
        (
            f"`cp -r` of the outputs ({fig['outputs_mb']:.0f} MB)",
            f"{fig['cp_r_outputs_s']:.2f} s",
            "",
            "",
        ),
        (f"`sha256sum` of the inputs ({gb:.2f} GB)", f"{fig['sha256sum_inputs_s']:.2f} s", "", ""),
        (
            "`epbuild verify`",
            f"{fig['verify_s']:.2f} s",
            "no problem",
            verdict(fig["checks"]["verify finds no problem"]),
        ),
        (
            "coordinator peak RSS (all commands)",
            f"{fig['coordinator_peak_rss_max_mb']} MB",
            "< 200 MB",
            verdict(fig["coordinator_peak_rss_max_mb"] < 200),
        ),
        ("largest worker peak RSS", f"{fig['worker_peak_rss_mb']} MB", "", ""),
    ]
    head = (
        f"{parts} parts × (prefill {PREFILL_SEQ}, decode {DECODE_SEQ}) × {fig['layers']} layers "
        f"× {fig['hidden']}², {gb:.2f} GB of weights, {fig['cpus']} CPUs\n\n"
        "| measurement | figure | target | result |\n|---|---|---|---|\n"
    )
    return head + "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--parts", type=int, default=4, help="sharing groups (default 4)")
    ap.add_argument("--layers", type=int, default=24, help="blocks per graph (default 24)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each cheap measurement")
    ap.add_argument("--workdir", type=Path, help="make the temp directory here (needs disk)")
    ap.add_argument("--keep", action="store_true", help="keep the temp directory")
    ap.add_argument("--skip-hand", action="store_true", help="skip the hand-written loop")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ns = ap.parse_args(argv)
    if ns.parts < 1 or ns.layers < 1 or ns.hidden < 1 or ns.runs < 1:
        ap.error("--parts, --layers, --hidden and --runs must be at least 1")
    if ns.workdir:
        ns.workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="epbuild-bench-llm-", dir=ns.workdir))
    bench = Bench(verbose=not ns.quiet)
    try:
        fig = measure(ns, tmp, bench)
    finally:
        if ns.keep:
            print(f"bench_llm: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(fig, indent=2) if ns.json else table(fig))
    return 0 if all(fig["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
