"""``epbuild watch``: a real watcher in a subprocess, real file operations, the real QNN EP."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
import waits
from conftest import HTP73, HTP75, Workspace, render_manifest
from modelgen import matmul_model, save

from epbuild.watching import glob_match, make_targets

CYCLE_TIMEOUT = 120.0
"""Seconds (scaled by EPBUILD_TEST_TIMEOUT_SCALE) a test waits for the next cycle."""


class Watcher:
    """``epbuild watch --json`` in a subprocess; cycles are read by a thread, with timeouts."""

    def __init__(
        self, root: Path, *args: str, json_lines: bool = True, env: dict[str, str] | None = None
    ) -> None:
        self.json_lines = json_lines
        self.text: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epbuild", "-C", str(root), "watch",
             *(["--json"] if json_lines else []), "--debounce", "0.2", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.cycles: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        self.bad: list[str] = []
        self.threads = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not self.json_lines:
                self.text.put(line.rstrip("\n"))
                continue
            try:
                self.cycles.put(json.loads(line))
            except ValueError:
                self.bad.append(line)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def next(self, timeout: float = CYCLE_TIMEOUT) -> dict[str, Any]:
        """The next cycle; fails (never hangs) when none comes in time."""
        return self._get(self.cycles, "the next watch cycle", timeout)

    def line(self, timeout: float = CYCLE_TIMEOUT) -> str:
        """The next line of plain (not --json) output."""
        return self._get(self.text, "the next line of output", timeout)

    def _get(self, q: queue.Queue[Any], what: str, timeout: float) -> Any:
        try:
            return q.get(timeout=waits.scaled(timeout))
        except queue.Empty:
            raise waits.WaitExpired(
                f"timed out after {waits.scaled(timeout):.0f} s waiting for {what}\n"
                + waits.describe(self.proc, output=lambda: "".join(self.stderr))
            ) from None

    def quiet(self, seconds: float) -> None:
        """Assert that no cycle runs for ``seconds``."""
        try:
            extra = self.cycles.get(timeout=seconds)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected cycle: {json.dumps(extra)[:2000]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the watcher and return its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            waits.wait_for(lambda: self.proc.poll() is not None,
                           f"the watcher to exit after {signal.Signals(sig).name}",
                           proc=self.proc.pid, output=lambda: "".join(self.stderr))  # fmt: skip
        finally:
            self.close()
        return self.proc.wait()

    def close(self) -> None:
        """Kill the watcher and everything it started (a worker left compiling after a
        failed test would outlive the run)."""
        import psutil

        if self.proc.poll() is None:
            try:
                family = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                family = []
            self.proc.kill()
            self.proc.wait()
            for child in family:
                with contextlib.suppress(psutil.Error):
                    child.kill()
        for t in self.threads:
            t.join(timeout=5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def watcher() -> Iterator[Callable[..., Watcher]]:
    started: list[Watcher] = []

    def start(
        root: Path, *args: str, json_lines: bool = True, env: dict[str, str] | None = None
    ) -> Watcher:
        w = Watcher(root, *args, json_lines=json_lines, env=env)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def built(cycle: dict[str, Any]) -> dict[str, str]:
    """Action id → outcome, for actions that did something (not up to date)."""
    return {a["id"]: a["outcome"] for a in cycle["actions"] if a["outcome"] != "up_to_date"}


def atomic_save(model: onnx.ModelProto, path: Path) -> None:
    """Save like an exporter that writes a temp file and renames it over the target."""
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(model, tmp)
    os.replace(tmp, path)


@pytest.mark.slow
def test_file_operations_rebuild_exactly_the_affected_actions(
    simple_ws: Callable[..., Workspace], watcher: Callable[..., Watcher]
) -> None:
    ws = simple_ws()
    models = ws.root / "models"
    w = watcher(ws.root)
    first = w.next()
    assert first["cycle"] == 1 and first["changed"] == []
    assert built(first) == {"pair/htp": "compiled", "single/htp/c": "compiled"}

    # plain write
    save(matmul_model(30), models / "c.onnx")
    c = w.next()
    assert (c["cycle"], c["changed"]) == (2, ["models/c.onnx"])
    assert built(c) == {"single/htp/c": "compiled"}
    assert c["first_event"] <= c["started"] <= c["action_started"]["single/htp/c"]

    # save by rename (the temp file next to it is not an input)
    atomic_save(matmul_model(31, batch=4), models / "b.onnx")
    c = w.next()
    assert (c["changed"], built(c)) == (["models/b.onnx"], {"pair/htp": "compiled"})

    # delete and recreate
    (models / "c.onnx").unlink()
    time.sleep(0.05)
    save(matmul_model(32), models / "c.onnx")
    c = w.next()
    assert (c["changed"], built(c)) == (["models/c.onnx"], {"single/htp/c": "compiled"})

    # a slow writer: pauses between chunks are longer than the debounce, the file stays open
    data = matmul_model(33, n=256).SerializeToString()
    with open(models / "c.onnx", "wb") as f:
        for i in range(4):
            f.write(data[i * len(data) // 4 : (i + 1) * len(data) // 4])
            f.flush()
            time.sleep(0.35)
    c = w.next()
    assert (c["changed"], built(c)) == (["models/c.onnx"], {"single/htp/c": "compiled"})

    # a burst of 20 saves is one build
    for i in range(20):
        save(matmul_model(40 + i), models / "a.onnx")
        time.sleep(0.02)
    c = w.next()
    assert (c["changed"], built(c)) == (["models/a.onnx"], {"pair/htp": "compiled"})
    w.quiet(1.5)  # its own writes (outputs, state, stat cache) trigger nothing
    assert not any(a["stale"] for a in ws.cli_json("status")["actions"])
    assert w.stop() == 0, "".join(w.stderr)
    assert not w.bad, w.bad


@pytest.mark.slow
def test_manifest_globs_external_data_and_failures(
    workspace: Workspace, watcher: Callable[..., Watcher]
) -> None:
    models = workspace.root / "models"
    workspace.model("models/a.onnx", matmul_model(1))
    workspace.model("models/e.onnx", matmul_model(2), external="e.data")
    data: dict[str, Any] = {
        "providers": {"htp": HTP73},
        "groups": {"g": {"models": ["models/*.onnx"], "providers": ["htp"]}},
    }
    workspace.manifest(data)
    w = watcher(workspace.root)
    assert built(w.next()) == {"g/htp/a": "compiled", "g/htp/e": "compiled"}

    # the external-data file is an input too
    blob = bytearray((models / "e.data").read_bytes())
    blob[8:12] = bytes(4)
    (models / "e.data").write_bytes(bytes(blob))
    c = w.next()
    assert (c["changed"], built(c)) == (["models/e.data"], {"g/htp/e": "compiled"})

    # a new model matched by the glob; a hidden temp file is not
    (models / ".scratch.onnx").write_bytes(b"half")
    save(matmul_model(3), models / "d.onnx")
    c = w.next()
    assert (c["changed"], built(c)) == (["models/d.onnx"], {"g/htp/d": "compiled"})
    assert c["manifest_reloaded"] is True

    # a manifest edit reloads it
    data["providers"]["v75"] = HTP75
    data["groups"]["g"]["providers"] = ["htp", "v75"]
    workspace.manifest(data)
    c = w.next()
    assert c["changed"] == ["epbuild.toml"] and c["manifest_reloaded"] is True
    assert built(c) == {f"g/v75/{m}": "compiled" for m in "ade"}

    # a broken manifest is reported; the last good one stays in use
    workspace.manifest(render_manifest(data).replace("[groups.g]", "[groups.g"))
    c = w.next()
    assert c["summary"] is None and c["actions"] == []
    assert "epbuild.toml:" in c["manifest_error"] and "invalid TOML" in c["manifest_error"]
    save(matmul_model(4), models / "a.onnx")
    c = w.next()
    assert c["changed"] == ["models/a.onnx"] and c["manifest_error"] is None
    assert built(c) == {"g/htp/a": "compiled", "g/v75/a": "compiled"}

    # a failing compile is reported and the next save retries
    (models / "d.onnx").write_bytes(b"not an onnx model")
    c = w.next()
    assert built(c) == {"g/htp/d": "failed", "g/v75/d": "failed"}
    assert all("d.onnx" in a["error"] for a in c["actions"])
    save(matmul_model(5), models / "d.onnx")
    c = w.next()
    assert built(c) == {"g/htp/d": "compiled", "g/v75/d": "compiled"}

    # fixing the manifest (one provider again) reloads it
    data["groups"]["g"]["providers"] = ["htp"]
    workspace.manifest(data)
    c = w.next()
    assert c["manifest_reloaded"] is True and c["manifest_error"] is None
    assert {a["id"] for a in c["actions"]} == {"g/htp/a", "g/htp/d", "g/htp/e"}
    assert built(c) == {}
    assert w.stop(signal.SIGINT) == 0
    assert not list((workspace.root / "build").rglob(".staging/*"))


@pytest.mark.slow
def test_watch_and_manual_build_never_compile_the_same_action_twice(
    simple_ws: Callable[..., Workspace], watcher: Callable[..., Watcher]
) -> None:
    ws = simple_ws()
    w = watcher(ws.root)
    w.next()
    for seed in (50, 51):
        save(matmul_model(seed), ws.root / "models" / "c.onnx")
        manual = ws.cli_json("build", "single")  # races the watcher's debounced build
        cycle = w.next()
        by_manual = {a["id"]: a["outcome"] for a in manual["actions"]}["single/htp/c"]
        by_watch = {a["id"]: a["outcome"] for a in cycle["actions"]}["single/htp/c"]
        assert sorted([by_manual, by_watch]) == ["compiled", "up_to_date"]
    assert w.stop() == 0


def test_interrupt_during_a_build_stops_workers_and_releases_locks(
    workspace: Workspace, watcher: Callable[..., Watcher]
) -> None:
    import psutil
    from filelock import FileLock

    workspace.model("m/big.onnx", matmul_model(1, n=512))
    group = {"models": ["m/big.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    w = watcher(workspace.root)
    workers = _wait_for_worker(w.proc)
    assert w.stop(signal.SIGINT) == 0, "".join(w.stderr)
    _, alive = psutil.wait_procs(workers, timeout=waits.scaled(30))
    assert not alive
    locks = list((workspace.root / ".epbuild").rglob("*.lock"))
    assert locks
    for path in locks:
        lock = FileLock(str(path))
        lock.acquire(timeout=0)
        lock.release()
    assert not list((workspace.root / "build").rglob(".staging/*"))


def test_glob_match() -> None:
    assert glob_match("models/a.onnx", "models/*.onnx")
    assert not glob_match("models/.a.onnx", "models/*.onnx")
    assert not glob_match("models/sub/a.onnx", "models/*.onnx")
    assert glob_match("models/sub/deep/a.onnx", "models/**/*.onnx")
    assert glob_match("models/a.onnx", "models/**/*.onnx")
    assert not glob_match("models/.git/a.onnx", "models/**/*.onnx")
    assert glob_match("m/x1.onnx", "m/x[0-9].onnx") and not glob_match("m/xa.onnx", "m/x[0-9].onnx")


def test_targets_are_the_inputs_never_the_outputs(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from epbuild.manifest.load import load_manifest

    monkeypatch.delenv("EPBUILD_CACHE")

    workspace.model("models/a.onnx", matmul_model(1), external="a.data")
    workspace.model("more/x/b.onnx", matmul_model(2))
    path = workspace.manifest({
        "workspace": {"out_dir": "more/out", "cache": "more/cache"},
        "providers": {"htp": HTP73},
        "groups": {"g": {"models": ["models/a.onnx"], "providers": ["htp"]},
                   "h": {"models": ["more/**/*.onnx"], "providers": ["htp"]}},
    })  # fmt: skip
    (workspace.root / "more" / "out" / "h").mkdir(parents=True)
    t = make_targets(load_manifest(path), [])
    root = str(workspace.root)
    assert t.inputs == {"g/htp/a": {"models/a.onnx", "models/a.data"},
                        "h/htp/b": {"more/x/b.onnx"}}  # fmt: skip
    files = ("epbuild.toml", "models/a.onnx", "models/a.data", "more/x/b.onnx")
    assert t.files == {os.path.join(root, p) for p in files}
    # the glob's tree is watched around the output directory, not through it
    assert (os.path.join(root, "more"), False) in t.dirs
    assert (os.path.join(root, "more", "x"), True) in t.dirs
    assert not any(d.startswith(os.path.join(root, "more", "out")) for d, _ in t.dirs)
    assert t.wants(os.path.join(root, "more", "y", "new.onnx"), False)
    assert not t.wants(os.path.join(root, "more", "out", "h", "b_ctx.onnx"), False)
    assert not t.wants(os.path.join(root, ".epbuild", "state.jsonl"), False)
    assert not t.wants(os.path.join(root, "more", "cache", "x", "m.onnx"), False)
    assert not t.wants(os.path.join(root, "models", "a.onnx.tmp"), False)


def test_a_finished_file_arriving_at_once_is_not_waited_for_as_one_being_written(
    workspace: Workspace, tmp_path: Path
) -> None:
    """A model moved in from outside the watched folder (exported to /tmp, then ``mv``), a new
    hard link or symlink arrives as a bare create with no close to follow: the burst settles
    at the debounce, not at the settle timeout; a file created empty (being written) waits."""
    from epbuild.manifest.load import load_manifest
    from epbuild.watching.observer import Pending, make_handler
    from epbuild.watching.observer import Watcher as Observed

    workspace.model("m/a.onnx", matmul_model(1))
    group = {"models": ["m/*.onnx"], "providers": ["htp"]}
    path = workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    targets = make_targets(load_manifest(path), [])
    pending = Pending(track_writes=True)
    obs = Observed(False, 0.5, lambda text: None)
    obs.handler = make_handler(lambda: targets, pending, obs.dead)
    m = workspace.root / "m"
    try:
        obs.reconcile(targets)
        save(matmul_model(2), tmp_path / "export.onnx")
        os.rename(tmp_path / "export.onnx", m / "a.onnx")
        os.link(m / "a.onnx", m / "b.onnx")
        os.symlink("a.onnx", m / "c.onnx")
        (m / "d.onnx").open("wb").close()
        with (m / "e.onnx").open("wb"):  # still open: being written
            names = {str(m / f"{n}.onnx") for n in "abcde"}
            waits.wait_for(lambda: names <= pending.paths, "the events of all five files")
            assert set(pending.writing) == {str(m / "e.onnx")}
    finally:
        obs.stop()


def test_targets_of_a_quantized_group_are_its_samples(workspace: Workspace) -> None:
    import numpy as np

    from epbuild.manifest.load import load_manifest

    workspace.model("models/a.onnx", matmul_model(1))
    (workspace.root / "calib").mkdir()
    np.savez(workspace.root / "calib" / "s0.npz", x=np.ones((1, 4), "f4"))
    path = workspace.manifest({
        "providers": {"htp": HTP73},
        "groups": {"g": {"models": ["models/a.onnx"], "providers": ["htp"], "quantize": "q"}},
    })  # fmt: skip
    path.write_text(path.read_text() + '\n[quantization.q]\ncalibration = "calib/*.npz"\n')
    t = make_targets(load_manifest(path), [])
    calib = os.path.join(str(workspace.root), "calib")
    assert os.path.join(calib, "s0.npz") in t.files
    assert "calib/s0.npz" in t.inputs["g/htp/a"]
    assert t.listed == {calib} and t.wants(os.path.join(calib, "s1.npz"), False)


def _wait_for_worker(proc: subprocess.Popen[str]) -> list[Any]:
    """Wait until ``proc`` has started a worker; returns its workers (psutil processes)."""
    import psutil

    me = psutil.Process(proc.pid)

    def workers() -> list[psutil.Process]:
        try:
            return [p for p in me.children() if "epbuild.executors.worker" in " ".join(p.cmdline())]
        except psutil.Error:
            return []

    return waits.wait_for(workers, "the watcher to start a worker", proc=proc, interval=0.01)


def test_changes_during_a_build_coalesce_into_one_follow_up(
    workspace: Workspace, watcher: Callable[..., Watcher]
) -> None:
    model = workspace.model("m/big.onnx", matmul_model(1, n=512))
    group = {"models": ["m/big.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    go = workspace.root.parent / "go"  # the first compile holds until the saves are done
    w = watcher(workspace.root, env={"EPBUILD_TEST_HOOK": f"wait:m/big.onnx:{go}"})

    def held() -> bool:
        logs = (workspace.root / "build" / ".staging").glob("*/.epbuild-worker.log")
        return any(b"test hook: wait" in p.read_bytes() for p in logs)

    try:
        waits.wait_for(held, "the first compile to start", proc=w.proc,
                       output=lambda: "".join(w.stderr))  # fmt: skip
        for seed in range(2, 7):
            save(matmul_model(seed, n=512), model)
    finally:
        go.touch()
    w.next()  # the first build: compiled, or discarded because its input changed meanwhile
    c = w.next()
    assert (c["cycle"], c["changed"], built(c)) == (2, ["m/big.onnx"], {"g/htp/big": "compiled"})
    w.quiet(1.0)
    assert w.stop() == 0


def test_a_model_read_while_it_was_saved_is_built_again_not_failed(workspace: Workspace) -> None:
    """A save the build read half-written (a burst of saves under load lets a build start
    between two writes): the failure it caused is no failure, the next cycle builds again."""
    from epbuild.results import Outcome, Reporter
    from epbuild.watching import Cycle, watch

    model = workspace.model("m/a.onnx", matmul_model(1))
    group = {"models": ["m/a.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    whole = matmul_model(2).SerializeToString()
    half = whole[: len(whole) // 2]

    class Writer(Reporter):
        """The saving program: it finishes its save once the build has read (planned with)
        the half it had written."""

        def start(self, total: int, stale: int) -> None:
            if model.read_bytes() == half:
                model.write_bytes(whole)

    cycles: queue.Queue[Cycle] = queue.Queue()
    stop = threading.Event()
    kw = {"debounce": 0.05, "reporter_factory": Writer, "on_cycle": cycles.put, "stop": stop}
    thread = threading.Thread(target=watch, args=(workspace.root,), kwargs=kw, daemon=True)
    thread.start()

    def outcomes() -> tuple[Cycle, dict[str, Outcome]]:
        cycle = cycles.get(timeout=waits.scaled(CYCLE_TIMEOUT))
        assert cycle.result is not None, cycle
        return cycle, {a.id: a.outcome for a in cycle.result.actions}

    try:
        first, done = outcomes()
        assert first.ok and done == {"g/htp/a": Outcome.COMPILED}, first
        model.write_bytes(half)  # the save has written half the model so far
        read, done = outcomes()
        assert read.ok and read.again == ["m/a.onnx"], read
        assert done == {"g/htp/a": Outcome.SKIPPED}, read
        error = read.result.actions[0].error if read.result else None
        assert error == "m/a.onnx changed while the build read it: built again once it is written"
        again, done = outcomes()
        assert again.ok and again.changed == ["m/a.onnx"], again
        assert done == {"g/htp/a": Outcome.COMPILED}, again
    finally:
        stop.set()
        thread.join(timeout=waits.scaled(CYCLE_TIMEOUT))
    assert not thread.is_alive()
    assert not any(a["stale"] for a in workspace.main_json("status")["actions"])


@pytest.mark.slow
def test_polling_observer(
    simple_ws: Callable[..., Workspace], watcher: Callable[..., Watcher]
) -> None:
    ws = simple_ws()
    w = watcher(ws.root, "--poll", "single")
    assert built(w.next()) == {"single/htp/c": "compiled"}
    atomic_save(matmul_model(60), ws.root / "models" / "c.onnx")
    save(matmul_model(61), ws.root / "models" / "a.onnx")  # not selected: not watched
    c = w.next()
    assert (c["changed"], built(c)) == (["models/c.onnx"], {"single/htp/c": "compiled"})
    w.quiet(1.5)
    assert w.stop() == 0


def test_model_directory_removed_and_restored(
    simple_built: Workspace, watcher: Callable[..., Watcher], tmp_path: Path
) -> None:
    import shutil

    ws = simple_built  # built once per session, copied: the first cycle only re-hashes
    models = ws.root / "models"
    w = watcher(ws.root)
    w.next()
    shutil.copytree(models, tmp_path / "backup")
    shutil.rmtree(models)
    c = w.next()  # the build fails cleanly: the models are gone
    assert set(built(c).values()) == {"failed"}
    assert all("does not exist" in a["error"] for a in c["actions"])
    save(matmul_model(70), tmp_path / "backup" / "c.onnx")
    shutil.copytree(tmp_path / "backup", models)  # a new directory: the watch is re-made
    c = w.next()
    assert {a["id"]: a["outcome"] for a in c["actions"]} == {
        "pair/htp": "up_to_date", "single/htp/c": "compiled"}  # fmt: skip
    save(matmul_model(71), models / "c.onnx")
    c = w.next()
    assert (c["changed"], built(c)) == (["models/c.onnx"], {"single/htp/c": "compiled"})
    assert w.stop() == 0


def test_plain_output_says_what_changed_then_builds(
    simple_ws: Callable[..., Workspace], watcher: Callable[..., Watcher]
) -> None:
    ws = simple_ws()
    w = watcher(ws.root, "single", json_lines=False)
    lines = [w.line() for _ in range(2)]
    save(matmul_model(80), ws.root / "models" / "c.onnx")
    lines += [w.line() for _ in range(2)]
    assert lines[0] == "epbuild watch: initial build"
    assert lines[1].startswith("epbuild: 1 compiled in ")
    assert lines[2] == "epbuild watch: models/c.onnx changed"
    assert lines[3].startswith("epbuild: 1 compiled in ")
    assert w.stop() == 0
    err = "".join(w.stderr)
    assert "compiled single/htp/c" in err and "Traceback" not in err


def test_model_reached_through_a_symlink(
    workspace: Workspace, watcher: Callable[..., Watcher], tmp_path: Path
) -> None:
    """inotify watches the link's directory, where nothing changes when the target is
    saved: the target's directory (here outside the workspace) is watched too."""
    elsewhere = tmp_path / "exports"
    save(matmul_model(80), elsewhere / "real.onnx")
    (workspace.root / "models").mkdir(parents=True)
    (workspace.root / "models" / "c.onnx").symlink_to(elsewhere / "real.onnx")
    single = {"models": ["models/c.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"single": single}})
    w = watcher(workspace.root)
    assert built(w.next()) == {"single/htp/c": "compiled"}
    atomic_save(matmul_model(81), elsewhere / "real.onnx")
    c = w.next()
    assert (c["changed"], built(c)) == (["models/c.onnx"], {"single/htp/c": "compiled"})
    save(matmul_model(82), elsewhere / "real.onnx")  # written in place
    c = w.next()
    assert (c["changed"], built(c)) == (["models/c.onnx"], {"single/htp/c": "compiled"})
    assert w.stop() == 0


def test_a_rewrite_whose_mtime_was_put_back_is_built(
    simple_ws: Callable[..., Workspace], watcher: Callable[..., Watcher]
) -> None:
    """Same size, old mtime put back (``touch -r``): the change time still moved."""
    ws = simple_ws()
    source = ws.root / "models" / "c.onnx"
    other = ws.root / "other.onnx"
    save(matmul_model(30), other)
    if other.stat().st_size != source.stat().st_size:
        pytest.skip("the two generated models differ in size")
    w = watcher(ws.root)
    assert w.next()["cycle"] == 1
    st = source.stat()
    with open(source, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    c = w.next()
    assert (c["changed"], built(c)) == (["models/c.onnx"], {"single/htp/c": "compiled"})
    assert w.stop() == 0, "".join(w.stderr)
