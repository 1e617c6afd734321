"""Benchmark ``epbuild watch``: save-to-rebuild latency and the watcher's idle CPU use.

Runs a real watcher (``python -m epbuild watch --json``) on a temporary workspace with one
small model compiled by the QNN EP. For each save it reports, from the moment the save
finished (``os.replace`` of a temp file, like an exporter):

- event: the watcher saw the change (first filesystem event of the burst),
- start: the rebuild of the action started (debounce + planning + lock),
- done:  the cycle's build finished (worker start-up + compile + verify + commit).

Then it measures the watcher's CPU time while idle over ``--idle`` seconds (psutil), for the
inotify observer and, with ``--poll``, the polling one.

    python benchmarks/bench_watch.py [--saves 10] [--debounce 0.3] [--idle 10] [--poll]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MANIFEST = """\
[providers.htp]
ep = "qnn"
options = { htp_arch = "73", soc_model = "60" }

[groups.g]
models = ["models/m.onnx"]
providers = ["htp"]
"""


def _model(seed: int) -> Any:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 64), dtype=np.float32) * 0.1
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _save(seed: int, path: Path) -> float:
    import onnx

    tmp = path.with_name(path.name + ".tmp")
    onnx.save(_model(seed), tmp)
    os.replace(tmp, path)
    return time.time()


class _Watcher:
    def __init__(self, root: Path, debounce: float, poll: bool) -> None:
        cmd = [sys.executable, "-m", "epbuild", "-C", str(root), "watch", "--json",
               "--debounce", str(debounce)] + (["--poll"] if poll else [])  # fmt: skip
        env = {**os.environ, "EPBUILD_CACHE": "off"}  # measure compiles, not cache restores
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self) -> dict[str, Any]:
        return self.lines.get(timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.reader.join(timeout=5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _idle_cpu(pid: int, seconds: float) -> float:
    import psutil

    proc = psutil.Process(pid)

    def total() -> float:
        t = proc.cpu_times()
        return float(t.user + t.system)

    before, t0 = total(), time.perf_counter()
    time.sleep(seconds)
    return (total() - before) / (time.perf_counter() - t0) * 100


def run(saves: int, debounce: float, idle: float, poll: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ws"
        (root / "models").mkdir(parents=True)
        (root / "epbuild.toml").write_text(MANIFEST)
        model = root / "models" / "m.onnx"
        _save(0, model)
        w = _Watcher(root, debounce, poll)
        try:
            w.next()  # the initial build
            event, start, done = [], [], []
            for i in range(saves):
                time.sleep(0.5)
                saved = _save(i + 1, model)
                c = w.next()
                event.append(c["first_event"] - saved)
                start.append(c["action_started"]["g/htp/m"] - saved)
                done.append(c["finished"] - saved)
            time.sleep(1.0)  # let the last build's spare worker go
            cpu = _idle_cpu(w.proc.pid, idle)
        finally:
            w.stop()
    return {"event": event, "start": start, "done": done, "idle_cpu_percent": cpu}


def _ms(values: list[float]) -> str:
    return (f"median {statistics.median(values) * 1000:6.0f} ms   "
            f"min {min(values) * 1000:6.0f}   max {max(values) * 1000:6.0f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--debounce", type=float, default=0.3)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measurement")
    ap.add_argument("--poll", action="store_true", help="also measure the polling observer")
    args = ap.parse_args()
    for poll in (False, True) if args.poll else (False,):
        r = run(args.saves, args.debounce, args.idle, poll)
        name = "polling" if poll else "inotify"
        print(f"epbuild watch ({name}, debounce {args.debounce}s, {args.saves} saves)")
        print(f"  save -> event seen      {_ms(r['event'])}")
        print(f"  save -> rebuild starts  {_ms(r['start'])}")
        print(f"  save -> build finished  {_ms(r['done'])}")
        print(f"  idle CPU over {args.idle:g}s     {r['idle_cpu_percent']:.3f} % of one core")


if __name__ == "__main__":
    main()
