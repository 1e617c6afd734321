"""Crashes, for real: SIGKILL of the coordinator or a worker at random moments, native crashes
in a worker, Ctrl-C. Nothing half-written is ever reported fresh; the next build converges.

Native crashes use the worker's test seam ``EPBUILD_TEST_HOOK`` (see ``worker._test_hook``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import waits
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild.api import Outcome, status
from epbuild.onnx.proto import read_model
from epbuild.state.journal import load_state
from epbuild.state.statcache import hash_file


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile for real: no restores from a per-user action cache."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


def _crash_ws(workspace: Workspace, singles: int = 3) -> Workspace:
    import numpy as np

    w = np.random.default_rng(5).standard_normal((16, 16), dtype=np.float32) * 0.1
    workspace.model("m/p1.onnx", matmul_model(1, n=16, shared=w))
    workspace.model("m/p2.onnx", matmul_model(2, n=16, shared=w, batch=2))
    for i in range(singles):
        workspace.model(f"s/s{i}.onnx", matmul_model(10 + i, n=16))
    workspace.manifest({"workspace": {"jobs": 2}, "providers": {"htp": HTP73}, "groups": {
        "pair": {"models": ["m/p1.onnx", "m/p2.onnx"], "providers": ["htp"],
                 "share_weights": True},
        "one": {"models": ["s/*.onnx"], "providers": ["htp"]}}})  # fmt: skip
    return workspace


def _popen(ws: Workspace, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "epbuild", "-C", str(ws.root), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def verify_outputs(root: Path, fresh_only: set[str] | None = None) -> int:
    """Every recorded output of every (or the given) action is intact and self-consistent.

    Returns how many files were checked. Checks by reading the bytes, not the stat cache.
    """
    state = load_state(str(root / ".epbuild" / "state.jsonl"))
    checked = 0
    for action_id, rec in state.records.items():
        if fresh_only is not None and action_id not in fresh_only:
            continue
        assert action_id not in state.interrupted
        for rel, out in rec.outputs.items():
            full = root / rel
            assert full.is_file() and not full.is_symlink(), rel
            assert full.stat().st_size == out.size, rel
            assert hash_file(str(full)) == out.digest, f"{rel} does not match its record"
            checked += 1
            if rel.endswith("_ctx.onnx"):
                for node in read_model(full).context_nodes:
                    ref = node.attributes.get("ep_cache_context")
                    if node.attributes.get("embed_mode") == 0 and ref:
                        assert (full.parent / str(ref)).is_file(), (rel, ref)
    return checked


def _staging_left(root: Path) -> list[str]:
    base = root / "build" / ".staging"
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []


def _workers_of(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "epbuild.executors.worker" in " ".join(k.cmdline()):
                out.append(k)
        except psutil.Error:
            pass
    return out


def _gone(procs: list[psutil.Process], timeout: float = 30) -> list[psutil.Process]:
    """Those of ``procs`` still alive once all have exited or the (scaled) deadline passed."""
    _, alive = psutil.wait_procs(procs, timeout=waits.scaled(timeout))
    return alive


def _sits_in_slow_compile(ws: Workspace, proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """Wait until a worker of ``proc`` runs the ``sleep`` test hook; returns the workers."""

    def hooked() -> bool:
        logs = (ws.root / "build" / ".staging").glob("*/.epbuild-worker.log")
        return any(b"test hook: sleep" in p.read_bytes() for p in logs)

    waits.wait_for(hooked, "a worker to sit in the slow compile (its log says 'test hook')",
                   proc=proc)  # fmt: skip
    return _workers_of(proc.pid)


# ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "sig"), [("segv", "SIGSEGV"), ("abort", "SIGABRT")])
def test_native_crash_in_worker_is_reported_and_build_goes_on(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch, kind: str, sig: str
) -> None:
    ws = _crash_ws(workspace)
    monkeypatch.setenv("EPBUILD_TEST_HOOK", f"{kind}:s/s1.onnx")
    result = ws.build(keep_going=True)
    by_id = {a.id: a for a in result.actions}
    bad = by_id["one/htp/s1"]
    assert bad.outcome is Outcome.FAILED
    assert f"killed by {sig}" in (bad.error or ""), bad.error
    assert any(f"test hook: {kind}" in line for line in bad.log_tail), bad.log_tail
    assert {a.id: a.outcome for a in result.actions if a.id != bad.id} == {
        "pair/htp": Outcome.COMPILED, "one/htp/s0": Outcome.COMPILED,
        "one/htp/s2": Outcome.COMPILED}  # fmt: skip
    assert _staging_left(ws.root) == []
    assert not (ws.root / "build" / "one" / "htp" / "s1_ctx.onnx").exists()
    assert verify_outputs(ws.root) == 7
    monkeypatch.delenv("EPBUILD_TEST_HOOK")
    again = ws.build()
    assert [a.id for a in again.actions if a.outcome is Outcome.COMPILED] == ["one/htp/s1"]


def test_native_crash_cli_exit_and_message(workspace: Workspace) -> None:
    ws = _crash_ws(workspace, singles=2)
    proc = _popen(ws, "build", "--json", env={"EPBUILD_TEST_HOOK": "segv:s/s0.onnx"})
    out, err = waits.communicate(proc, "the build with a crashing worker to end")
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    doc = json.loads(out)
    bad = next(a for a in doc["actions"] if a["id"] == "one/htp/s0")
    assert bad["outcome"] == "failed" and "SIGSEGV" in bad["error"]
    assert any("test hook: segv" in line for line in bad["log_tail"])
    # without -k the coordinator stops starting actions but lets running ones finish
    assert doc["summary"]["failed"] == 1
    assert doc["summary"]["compiled"] + doc["summary"]["skipped"] == 2


def test_ctrl_c_stops_workers_and_cleans_up(workspace: Workspace) -> None:
    ws = _crash_ws(workspace, singles=2)
    proc = _popen(ws, "build", env={"EPBUILD_TEST_HOOK": "sleep:m/p1.onnx:600"})
    workers = _sits_in_slow_compile(ws, proc)
    assert workers, "the slow compile never started"
    proc.send_signal(signal.SIGINT)
    _, err = waits.communicate(proc, "the build to exit after SIGINT")
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert _gone(workers) == [], "workers outlived Ctrl-C"
    assert _staging_left(ws.root) == []
    state = load_state(str(ws.root / ".epbuild" / "state.jsonl"))
    assert "pair/htp" not in state.records
    # locks are released: the next build does not wait
    again = ws.cli("build", "--lock-timeout", "5")
    assert again.returncode == 0, again.stderr
    assert "waiting for" not in again.stderr
    verify_outputs(ws.root)


@pytest.mark.slow  # 8 to 24 rounds of builds, each killed and rebuilt
def test_sigkill_loop_converges(workspace: Workspace) -> None:
    """Kill the coordinator or a worker at random moments, again and again."""
    ws = _crash_ws(workspace)
    rng = random.Random(20240611)
    models = ["m/p1.onnx", "m/p2.onnx", "s/s0.onnx", "s/s1.onnx", "s/s2.onnx"]
    kills = {"coordinator": 0, "worker": 0, "finished first": 0}
    seen_fresh_checked = 0
    for round_ in range(24):  # at least 8 rounds, more until enough kills landed mid-build
        if round_ >= 8 and kills["coordinator"] >= 2 and kills["worker"] >= 2:
            break
        # change one or two inputs so there is work to interrupt
        for model in rng.sample(models, rng.randint(1, 2)):
            if model.startswith("m/"):
                ws.model(model, matmul_model(rng.randrange(1000), n=16, batch=2))
                ws.model("m/p1.onnx" if model == "m/p2.onnx" else "m/p2.onnx",
                         matmul_model(rng.randrange(1000), n=16))  # fmt: skip
            else:
                ws.model(model, matmul_model(rng.randrange(1000), n=16))
        proc = _popen(ws, "build")
        target = "coordinator" if round_ % 2 == 0 else "worker"
        if target == "worker":  # wait for a worker to exist, then hit it at a random moment
            started = proc
            waits.wait_for(lambda: _workers_of(started.pid) or started.poll() is not None,  # noqa: B023
                           "a worker to start (or the build to end)", interval=0.01)  # fmt: skip
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment to kill it, not a wait
        else:
            time.sleep(rng.uniform(0.05, 0.9))  # a random moment to kill it, not a wait
        workers = _workers_of(proc.pid)
        if proc.poll() is not None:
            kills["finished first"] += 1
        elif target == "worker" and workers:
            try:
                rng.choice(workers).kill()
                kills["worker"] += 1
            except psutil.NoSuchProcess:
                kills["finished first"] += 1
        else:
            proc.kill()
            kills["coordinator"] += 1
        waits.communicate(proc, f"round {round_}: the killed build to exit")
        # workers never outlive their coordinator (they watch stdin for EOF)
        assert _gone(workers) == [], f"round {round_}: orphaned workers"
        # nothing partial is reported fresh: every action status calls up to date verifies
        fresh = {p.id for p in status(ws.root).actions if not p.stale}
        seen_fresh_checked += verify_outputs(ws.root, fresh)
        # the next build converges, rebuilding only what was not committed
        proc2 = _popen(ws, "build", "--json")
        out, err = waits.communicate(proc2, f"round {round_}: the build after the kill")
        assert proc2.returncode == 0, f"round {round_}: {err}"
        doc = json.loads(out)
        compiled = {a["id"] for a in doc["actions"] if a["outcome"] == "compiled"}
        assert not compiled & fresh, f"round {round_}: rebuilt committed {compiled & fresh}"
        assert verify_outputs(ws.root) == 9
        assert _staging_left(ws.root) == []
        assert {p.id for p in status(ws.root).actions if p.stale} == set()
    print(f"kills: {kills}, fresh outputs verified after kills: {seen_fresh_checked}")
    assert kills["coordinator"] >= 2 and kills["worker"] >= 2, kills
    assert seen_fresh_checked > 0


def _summary(out: str) -> dict[str, Any]:
    return json.loads(out)["summary"]  # type: ignore[no-any-return]


def test_no_worker_starts_once_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose slot thread reaches the executor after Ctrl-C's cancel starts nothing:
    the interrupted build would otherwise wait for that whole compile (on a busy machine the
    thread often starts late)."""
    from epbuild.executors.local import LocalExecutor
    from epbuild.kinds.compilework import CompileWork
    from epbuild.manifest.model import ContextSettings
    from epbuild.providers.base import ProviderConfig

    executor = LocalExecutor(str(tmp_path), prewarm=True)
    spawned: list[tuple[str, ...]] = []
    monkeypatch.setattr(executor, "_spawn", spawned.append)
    executor.cancel()
    work = CompileWork(
        action_id="g/qnn/a",
        provider=ProviderConfig("qnn", "qnn", {}, {}, {}),
        models=("m/a.onnx",),
        staging="build/.staging/x",
        context=ContextSettings(),
        initializer_names=(),
    )
    outcome = executor.run(work.as_job())
    assert not outcome.ok and outcome.error == "interrupted before its worker started"
    assert spawned == []


def test_a_worker_killed_for_memory_says_so(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL is what the kernel sends when memory runs out: the failure names the peak the
    worker reached, the memory budget and -j, and says what to change."""
    ws = _crash_ws(workspace)
    monkeypatch.setenv("EPBUILD_TEST_HOOK", "oom:s/s1.onnx:96")
    result = ws.build("one/htp/s1", memory_budget=3 << 30, jobs=1)
    (bad,) = result.actions
    assert bad.outcome is Outcome.FAILED
    error = bad.error or ""
    assert "killed by SIGKILL" in error and "for lack of memory" in error, error
    assert "after reaching " in error and "(memory budget " in error and ", -j 1" in error, error
    assert "lower -j" in (bad.hint or "")
