"""Concurrent builds, for real: separate ``epbuild`` processes on one workspace, real locks.

Every action is compiled exactly once however many builds race; waiters say whom they wait
for; ``--lock-timeout`` exits 3 naming the holder; a killed holder never blocks; an input
rewritten during its compile is never recorded as fresh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import HTP73, Workspace
from modelgen import matmul_model
from test_crash import verify_outputs

from epbuild.api import Outcome, status
from epbuild.state.journal import load_state
from epbuild.state.statcache import StatCache


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile for real: no restores from a per-user action cache."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


def _race(
    root: Path, n: int, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> list[tuple[int, dict[str, Any], str]]:
    """Start ``n`` builds at once; returns (exit code, --json document, stderr) of each."""
    go = root.parent / "go"
    go.unlink(missing_ok=True)
    ready = root.parent / "ready"
    ready.mkdir(exist_ok=True)
    # each process says it is ready, then waits for the go file: they start compiling together
    starter = (
        "import os, sys, time\n"
        f"open(os.path.join({str(ready)!r}, str(os.getpid())), 'w').close()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.005)\n"
        "from epbuild.frontends.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", starter, "-C", str(root), "build", "--json", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        for _ in range(n)
    ]
    waits.wait_for(lambda: {str(p.pid) for p in procs} <= {f.name for f in ready.iterdir()},
                   f"all {n} builds to start")  # fmt: skip
    go.touch()
    results = []
    for i, p in enumerate(procs):
        out, err = waits.communicate(p, f"racing build {i + 1} of {n} to finish", timeout=timeout)
        try:
            doc = json.loads(out)
        except ValueError:
            doc = {}
        results.append((p.returncode, doc, err))
    return results


def _check_race(root: Path, results: list[tuple[int, dict[str, Any], str]], n: int) -> None:
    for code, _, err in results:
        assert code == 0, err
        assert "Traceback" not in err
    compiled = Counter(
        a["id"] for _, doc, _ in results for a in doc["actions"] if a["outcome"] == "compiled"
    )
    assert len(compiled) == n and set(compiled.values()) == {1}, compiled
    assert sum(doc["summary"]["compiled"] for _, doc, _ in results) == n
    # the journal holds one completed compile per action: nobody compiled twice
    raw = (root / ".epbuild" / "state.jsonl").read_bytes().splitlines()[1:]
    done = Counter(json.loads(x)["id"] for x in raw if b'"op":"done"' in x)
    assert set(done.values()) == {1} and len(done) == n, done
    state = load_state(str(root / ".epbuild" / "state.jsonl"))
    assert not state.warnings and not state.interrupted
    assert verify_outputs(root) >= n
    assert StatCache(str(root / ".epbuild" / "statcache.json")).entries, "stat cache lost"
    assert not any(p.stale for p in status(root).actions)
    staging = root / "build" / ".staging"
    assert not staging.is_dir() or not list(staging.iterdir())


@pytest.mark.slow  # eight builds at once
def test_eight_concurrent_builds_compile_each_action_once(workspace: Workspace) -> None:
    for i in range(6):
        workspace.model(f"m/m{i}.onnx", matmul_model(i, n=16))
    workspace.manifest({"providers": {"htp": HTP73},
                        "groups": {"g": {"models": ["m/*.onnx"],
                                         "providers": ["htp"]}}})  # fmt: skip
    results = _race(workspace.root, 8, "-j", "2")
    _check_race(workspace.root, results, 6)
    waited = sum(err.count("waiting for") for _, _, err in results)
    assert waited > 0, "no build ever waited: the race did not happen"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eight_concurrent_builds_of_model_zoo(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "model-zoo"))
    try:
        import fetch_models
    finally:
        sys.path.pop(0)
    root = tmp_path / "zoo"
    (root / "models").mkdir(parents=True)
    assert fetch_models.main(root / "models") == 0
    n = len(list((root / "models").glob("*.onnx")))
    assert n == 9
    # one HTP target keeps it short; the shared cache directory is raced on too
    (root / "epbuild.toml").write_text(
        '[providers.htp-v73]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
        '[groups.cnn]\nmodels = ["models/*.onnx"]\nproviders = ["htp-v73"]\n'
    )
    t0 = time.perf_counter()
    results = _race(root, 8, "-j", "2", env={"EPBUILD_CACHE": str(tmp_path / "cache")},
                    timeout=600)  # fmt: skip
    print(f"8 concurrent model-zoo builds: {time.perf_counter() - t0:.1f}s")
    _check_race(root, results, n)
    # the shared cache, written by whichever process compiled each action, restores intact
    copy = tmp_path / "copy"
    (copy / "models").mkdir(parents=True)
    for p in (root / "models").iterdir():
        (copy / "models" / p.name).write_bytes(p.read_bytes())
    (copy / "epbuild.toml").write_text((root / "epbuild.toml").read_text())
    proc = waits.run([sys.executable, "-m", "epbuild", "-C", str(copy), "build", "--json"],
                     "the build restoring from the shared cache", timeout=300,
                     env={**os.environ, "EPBUILD_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["restored"] == n
    verify_outputs(copy)


_HOLDER = """
import sys
from epbuild.state import locks
with locks.hold(sys.argv[1], "epbuild build g/htp/m0 (test holder)"):
    print("held", flush=True)
    sys.stdin.read()  # holds the lock until the test closes its stdin (or kills it)
"""


def _hold(lock: Path) -> subprocess.Popen[str]:
    """A process holding ``lock`` until its stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _lock_ws(workspace: Workspace) -> tuple[Workspace, Path]:
    from epbuild.planning.workspace import open_workspace

    workspace.model("m/m0.onnx", matmul_model(0, n=16))
    workspace.model("m/m1.onnx", matmul_model(1, n=16))
    workspace.manifest({"providers": {"htp": HTP73},
                        "groups": {"g": {"models": ["m/*.onnx"],
                                         "providers": ["htp"]}}})  # fmt: skip
    ws = open_workspace(workspace.root)
    action = next(a for a in ws.actions if a.id == "g/htp/m0")
    return workspace, Path(ws.action_lock(action))


def test_lock_timeout_exits_3_naming_the_holder(workspace: Workspace) -> None:
    ws, lock = _lock_ws(workspace)
    holder = _hold(lock)
    try:
        proc = ws.cli("build", "--lock-timeout", "1")
    finally:
        holder.kill()
        holder.communicate()
    assert proc.returncode == 3, proc.stderr
    assert f"pid {holder.pid}" in proc.stderr and "test holder" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_waiter_says_once_whom_it_waits_for(workspace: Workspace) -> None:
    ws, lock = _lock_ws(workspace)
    holder = _hold(lock)
    err_path = ws.root.parent / "build.err"
    with open(err_path, "w+") as err_file:
        build = subprocess.Popen([sys.executable, "-m", "epbuild", "-C", str(ws.root), "build"],
                                 stdout=subprocess.DEVNULL, stderr=err_file)  # fmt: skip
        try:
            waits.wait_for(lambda: "waiting for" in err_path.read_text(),
                           "the build to say whom it waits for", proc=build,
                           output=err_path.read_text)  # fmt: skip
        finally:
            waits.communicate(holder, "the holder to release the lock")  # closes its stdin
        waits.communicate(build, "the build to finish once the lock is free")
    err = err_path.read_text()
    assert build.returncode == 0, err
    assert err.count("waiting for") == 1, err
    assert f"(pid {holder.pid})" in err and "g/htp/m0" in err


def test_killed_lock_holder_never_blocks(workspace: Workspace) -> None:
    ws, lock = _lock_ws(workspace)
    holder = _hold(lock)
    holder.kill()  # SIGKILL: no cleanup runs, the OS drops the lock
    holder.communicate()
    assert lock.exists()
    proc = ws.cli("build", "--lock-timeout", "2")
    assert proc.returncode == 0, proc.stderr
    assert "waiting for" not in proc.stderr


@pytest.mark.slow
def test_input_rewritten_during_compile_is_not_recorded(workspace: Workspace) -> None:
    workspace.model("m/a.onnx", matmul_model(0, n=16))
    workspace.model("m/b.onnx", matmul_model(1, n=16))
    workspace.manifest({"providers": {"htp": HTP73},
                        "groups": {"g": {"models": ["m/*.onnx"],
                                         "providers": ["htp"]}}})  # fmt: skip
    go = workspace.root.parent / "go"
    proc = subprocess.Popen(
        [sys.executable, "-m", "epbuild", "-C", str(workspace.root), "build", "-k", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "EPBUILD_TEST_HOOK": f"wait:m/a.onnx:{go}"},
    )  # fmt: skip

    def hooked() -> bool:  # the worker is about to compile m/a.onnx, and waits for go
        logs = (workspace.root / "build" / ".staging").glob("*/.epbuild-worker.log")
        return any(b"test hook: wait" in p.read_bytes() for p in logs)

    try:
        waits.wait_for(hooked, "the worker to hold before compiling m/a.onnx", proc=proc)
        workspace.model("m/a.onnx", matmul_model(42, n=16))  # the exporter rewrites it
    finally:
        go.touch()
    out, err = waits.communicate(proc, "the build to finish")
    assert proc.returncode == 1, err
    by_id = {a["id"]: a for a in json.loads(out)["actions"]}
    assert by_id["g/htp/a"]["outcome"] == "failed"
    assert "m/a.onnx changed while it was being compiled" in by_id["g/htp/a"]["error"]
    assert by_id["g/htp/b"]["outcome"] == "compiled"
    state = load_state(str(workspace.root / ".epbuild" / "state.jsonl"))
    assert "g/htp/a" not in state.records and "g/htp/b" in state.records
    assert not (workspace.root / "build" / "g" / "htp" / "a_ctx.onnx").exists()
    plans = {p.id: p for p in status(workspace.root).actions}
    assert plans["g/htp/a"].stale and not plans["g/htp/b"].stale
    again = workspace.build()
    assert {a.id: a.outcome for a in again.actions} == {
        "g/htp/a": Outcome.COMPILED, "g/htp/b": Outcome.UP_TO_DATE}  # fmt: skip
    verify_outputs(workspace.root)


@pytest.mark.parametrize(
    ("args", "lock"),
    [
        (("clean",), ".epbuild/state.lock"),
        (("add", "model", "m/m0.onnx", "-g", "other"), ".epbuild/locks/manifest.lock"),
        (("init", "--from", "m"), ".epbuild/locks/manifest.lock"),
        (("lock",), ".epbuild/locks/manifest.lock"),
    ],
    ids=["clean", "add", "init", "lock"],
)
def test_every_command_honours_lock_timeout(
    workspace: Workspace, args: tuple[str, ...], lock: str
) -> None:
    """``--lock-timeout`` bounds the wait of commands besides build (their locks are taken
    deep in the library: the state lock of clean, the manifest lock of add, init and lock)."""
    ws, _ = _lock_ws(workspace)
    if args[0] == "init":
        (ws.root / "epbuild.toml").unlink()
    before = {p: p.read_bytes() for p in ws.root.glob("*.toml")}
    holder = _hold(ws.root / lock)
    try:
        proc = ws.cli(*args, "--lock-timeout", "0.5")
    finally:
        holder.kill()
        holder.communicate()
    assert proc.returncode == 3, proc.stderr
    assert f"pid {holder.pid}" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("epbuild: waiting for") == 1, proc.stderr  # said once
    assert {p: p.read_bytes() for p in ws.root.glob("*.toml")} == before  # nothing written
