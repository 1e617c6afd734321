"""Disk-full-like failures, for real: a read-only output directory, a file-size limit
(RLIMIT_FSIZE) that hits a worker's outputs or the coordinator's journal. Each fails its
action cleanly (FAILED, a message naming the path and the OS error, exit code 1, no
traceback), leaves the other actions' results intact and nothing half-committed, and the
next build without the obstacle converges.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild.api import Outcome
from epbuild.state.journal import load_state
from epbuild.state.statcache import hash_file

BIG_N = 256
"""Group g1's model size: its context binary is about 300 kB."""


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile for real: no restores from a per-user action cache."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


def _two_groups(workspace: Workspace, big: int = BIG_N) -> Workspace:
    workspace.model("m/a.onnx", matmul_model(1, n=big))
    workspace.model("m/b.onnx", matmul_model(2))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {
        "g1": {"models": ["m/a.onnx"], "providers": ["htp"]},
        "g2": {"models": ["m/b.onnx"], "providers": ["htp"]}}})  # fmt: skip
    assert workspace.build().ok
    return workspace


def _state_path(ws: Workspace) -> Path:
    return ws.root / ".epbuild" / "state.jsonl"


def _snapshot(ws: Workspace, action: str) -> dict[str, bytes]:
    rec = load_state(str(_state_path(ws))).records[action]
    return {rel: (ws.root / rel).read_bytes() for rel in rec.outputs}


def _assert_nothing_half_committed(ws: Workspace) -> None:
    """The state loads cleanly; every action it trusts has exactly its recorded outputs."""
    state = load_state(str(_state_path(ws)))
    assert not state.warnings
    for action_id, rec in state.records.items():
        if action_id in state.interrupted:
            continue  # recorded as not built: the next build rebuilds it
        for rel, out in rec.outputs.items():
            assert hash_file(str(ws.root / rel)) == out.digest, f"{rel} does not match its record"
    staging = ws.root / "build" / ".staging"
    assert not staging.is_dir() or not any(staging.iterdir())


def _build_json(ws: Workspace, preexec: Callable[[], None] | None = None) -> tuple[int, Any, str]:
    proc = waits.run([sys.executable, "-m", "epbuild", "-C", str(ws.root), "build", "-k", "--json"],
                     "epbuild build -k --json", timeout=300, preexec_fn=preexec)  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _outcomes(doc: Any) -> dict[str, str]:
    return {a["id"]: a["outcome"] for a in doc["actions"]}


def _error(doc: Any, action: str) -> str:
    (entry,) = (a for a in doc["actions"] if a["id"] == action)
    return str(entry["error"])


@contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """``path`` takes no new entries: mode 0o555, or for root (who ignores modes) the
    immutable attribute."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode:
        pytest.skip("root ignores modes, and chattr +i does not work here")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


NOT_WRITABLE = ("Permission denied", "Operation not permitted", "Read-only file system")


@pytest.mark.slow
def test_read_only_action_dir_fails_that_action_only(workspace: Workspace) -> None:
    ws = _two_groups(workspace)
    before = _snapshot(ws, "g1/htp/a")
    ws.model("m/a.onnx", matmul_model(11, n=BIG_N))
    ws.model("m/b.onnx", matmul_model(12))
    with _read_only(ws.root / "build" / "g1" / "htp"):
        code, doc, _ = _build_json(ws)
        assert code == 1
        assert _outcomes(doc) == {"g1/htp/a": "failed", "g2/htp/b": "compiled"}
        error = _error(doc, "g1/htp/a")
        assert "build/g1/htp" in error and any(e in error for e in NOT_WRITABLE), error
        assert "Errno" not in error and str(ws.root) not in error  # said, not a Python repr
        assert _snapshot(ws, "g1/htp/a") == before  # the old outputs, untouched
        _assert_nothing_half_committed(ws)
        assert "g1/htp/a" in load_state(str(_state_path(ws))).interrupted
    result = ws.build()
    assert result.ok and {a.id: a.outcome for a in result.actions} == {
        "g1/htp/a": Outcome.COMPILED, "g2/htp/b": Outcome.UP_TO_DATE}  # fmt: skip
    _assert_nothing_half_committed(ws)
    assert {a.outcome for a in ws.build().actions} == {Outcome.UP_TO_DATE}


@pytest.mark.slow
def test_read_only_out_dir_fails_every_action_cleanly(workspace: Workspace) -> None:
    workspace.model("m/b.onnx", matmul_model(2))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {
        "g": {"models": ["m/b.onnx"], "providers": ["htp"]}}})  # fmt: skip
    (workspace.root / "build").mkdir()
    with _read_only(workspace.root / "build"):
        proc = workspace.cli("build")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "FAILED g/htp/b" in proc.stdout + proc.stderr
        assert "build/.staging" in proc.stderr
        assert any(e in proc.stderr for e in NOT_WRITABLE), proc.stderr
        assert "Errno" not in proc.stderr, proc.stderr
        assert load_state(str(workspace.root / ".epbuild" / "state.jsonl")).records == {}
    assert workspace.build().ok


def _limit(size: int) -> Callable[[], None]:
    """preexec_fn: a file-size limit for the build and its workers; writes past it fail
    with EFBIG instead of killing the process with SIGXFSZ."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return apply


@pytest.mark.slow
def test_file_size_limit_fails_the_worker_with_a_clear_message(workspace: Workspace) -> None:
    ws = _two_groups(workspace)
    before = _snapshot(ws, "g1/htp/a")
    assert len(before["build/g1/htp/a_ctx_qnn.bin"]) > 128 << 10  # the limit below stops it
    ws.model("m/a.onnx", matmul_model(11, n=BIG_N))
    ws.model("m/b.onnx", matmul_model(12))
    code, doc, _ = _build_json(ws, _limit(128 << 10))
    assert code == 1
    assert _outcomes(doc) == {"g1/htp/a": "failed", "g2/htp/b": "compiled"}
    error = _error(doc, "g1/htp/a")
    assert "File too large" in error and "a_ctx_qnn.bin" in error, error
    assert _snapshot(ws, "g1/htp/a") == before
    _assert_nothing_half_committed(ws)
    result = ws.build()
    assert result.ok and {a.id: a.outcome for a in result.actions} == {
        "g1/htp/a": Outcome.COMPILED, "g2/htp/b": Outcome.UP_TO_DATE}  # fmt: skip
    _assert_nothing_half_committed(ws)


@pytest.mark.slow
@pytest.mark.parametrize("room", [0, 400], ids=["no-room", "room-for-begin-only"])
def test_file_size_limit_on_the_journal(workspace: Workspace, room: int) -> None:
    """The coordinator's own writes: the journal cannot take the action's ``begin`` (nothing
    is touched), or takes ``begin`` but not ``done`` (outputs in place, recorded as not
    built). Either way a clean failure, and the next build converges."""
    ws = _two_groups(workspace, big=32)
    ws.model("m/a.onnx", matmul_model(11))
    limit = 1 << 20
    journal = _state_path(ws)
    pad = limit - room - journal.stat().st_size - len('{"id":"","op":"forget"}\n')
    with journal.open("a") as f:  # a valid record that brings the journal near the limit
        f.write(json.dumps({"id": "x" * pad, "op": "forget"}, separators=(",", ":")) + "\n")
    assert journal.stat().st_size == limit - room
    code, doc, _ = _build_json(ws, _limit(limit))
    assert code == 1
    assert _outcomes(doc) == {"g1/htp/a": "failed", "g2/htp/b": "up_to_date"}
    error = _error(doc, "g1/htp/a")
    assert "state journal" in error and ".epbuild/state.jsonl" in error, error
    assert "File too large" in error and "Errno" not in error, error
    state = load_state(str(journal))
    assert not state.warnings and "g2/htp/b" in state.records  # whole lines only, all loaded
    assert ("g1/htp/a" in state.interrupted) == (room > 0)
    _assert_nothing_half_committed(ws)
    result = ws.build()
    assert result.ok and {a.id: a.outcome for a in result.actions} == {
        "g1/htp/a": Outcome.COMPILED, "g2/htp/b": Outcome.UP_TO_DATE}  # fmt: skip
    _assert_nothing_half_committed(ws)


def test_read_only_cache_only_warns(workspace: Workspace, tmp_path: Path) -> None:
    """The action cache is an optimisation: a cache that cannot be written warns, and the
    compiled action is committed and recorded as usual."""
    workspace.model("m/b.onnx", matmul_model(2))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {
        "g": {"models": ["m/b.onnx"], "providers": ["htp"]}}})  # fmt: skip
    cache = tmp_path / "cache"
    cache.mkdir()
    with _read_only(cache):
        proc = workspace.cli("build", "--cache", str(cache))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "not stored in the cache" in proc.stderr and "Errno" not in proc.stderr
    _assert_nothing_half_committed(workspace)
    assert "g/htp/b" in load_state(str(_state_path(workspace))).records


_UNDER_LIMIT = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from epbuild.fs import atomic_write_bytes
from epbuild.state.journal import ActionRecord, Journal
path, kind = sys.argv[1], sys.argv[2]
try:
    if kind == "atomic":
        atomic_write_bytes(path, b"x" * 10000)
    else:
        Journal(path).done(ActionRecord("big", "k", {"pad": "y" * 10000}, {}, 1.0, 0, 1.0))
except OSError as exc:
    print(exc.strerror, exc.filename == path)
"""


@pytest.mark.parametrize("kind", ["atomic", "journal"])
def test_a_write_cut_short_leaves_the_file_as_it_was(tmp_path: Path, kind: str) -> None:
    """Atomic writes leave the old file and no temp file; a journal record cut short by the
    limit is taken back, so the journal still ends with a whole line."""
    from epbuild.state.journal import Journal

    path = tmp_path / "state.jsonl"
    if kind == "atomic":
        path.write_bytes(b"old")
    else:
        Journal(str(path)).begin("small", "k")
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _UNDER_LIMIT, str(path), kind],
                          capture_output=True, text=True, timeout=waits.scaled(60))  # fmt: skip
    assert proc.stdout.split() == ["File", "too", "large", "True"], proc.stderr
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["state.jsonl"]
    if kind == "journal":
        Journal(str(path)).forget("small")  # a later record lands on a whole line
        state = load_state(str(path))
        assert not state.warnings and state.lines == 2 and not state.interrupted


@pytest.mark.slow
def test_end_of_build_steps_that_cannot_write_are_warnings_in_the_result(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import epbuild.api

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(epbuild.api, "save_stats", full)
    ws = _two_groups(workspace)
    ws.model("m/b.onnx", matmul_model(13))
    result = ws.build()
    assert result.ok, [a.error for a in result.actions]
    said = [w for w in result.warnings if "stat cache was not saved" in w]
    assert said and "No space left on device" in said[0], result.warnings
    assert "stat cache was not saved" in json.dumps(result.to_json())
