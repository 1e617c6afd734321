"""The action cache, end to end with the real QNN EP: restore instead of compile, export /
import across workspaces, corruption, concurrent writers, LRU prune, miss explanations."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import Workspace

from epbuild.api import Outcome
from epbuild.cache.actioncache import ActionCache
from epbuild.cache.store import OBJECTS, CacheEntry, object_path
from epbuild.state.statcache import hash_file


def outputs(ws: Workspace) -> dict[str, bytes]:
    out = ws.root / "build"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".staging" not in p.parts}  # fmt: skip


def outcomes(result) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {a.id: a.outcome.value for a in result.actions}


def check_consistent(cache_dir: Path) -> list[CacheEntry]:
    """Every entry readable, every object it names present with the right digest, no temps."""
    cache = ActionCache(str(cache_dir))
    entries = [cache.local.get_entry(k) for k in cache.local.entry_keys()]
    assert all(e is not None for e in entries)
    for entry in entries:
        assert entry is not None
        for name, out in entry.outputs.items():
            obj = cache_dir / object_path(out.digest)
            assert obj.is_file(), f"{entry.action_id}: object of {name} missing"
            assert hash_file(str(obj)) == out.digest and obj.stat().st_size == out.size
    leftovers = [p for p in cache_dir.rglob("*") if ".tmp-" in p.name]
    assert not leftovers, leftovers
    return [e for e in entries if e is not None]


def clone(ws: Workspace, dest: Path) -> Workspace:
    """The workspace's sources (manifest + models) at another absolute path, no state."""
    shutil.copytree(ws.root, dest, ignore=shutil.ignore_patterns("build", ".epbuild"))
    return Workspace(dest)


@pytest.mark.slow
def test_restore_after_clean_is_byte_identical(simple_ws: Callable[..., Workspace],
                                               tmp_path: Path) -> None:  # fmt: skip
    ws = simple_ws()
    cache = str(tmp_path / "cache")
    first = ws.build(cache=cache)
    assert outcomes(first) == {"pair/htp": "compiled", "single/htp/c": "compiled"}
    before = outputs(ws)
    assert len(check_consistent(Path(cache))) == 2
    ws.cli("clean", check=True)
    doc = ws.cli_json("build", "--cache", cache)
    assert doc["summary"]["restored"] == 2 and doc["summary"]["compiled"] == 0
    assert outputs(ws) == before
    # restored by hard link into the output directory, read-only so nothing edits the cache
    bin_path = ws.root / "build" / "single" / "htp" / "c_ctx_qnn.bin"
    assert bin_path.stat().st_nlink >= 2 and bin_path.stat().st_mode & 0o222 == 0
    again = ws.build(cache=cache)
    assert again.count(Outcome.UP_TO_DATE) == 2
    from epbuild.state.journal import load_state

    state = load_state(str(ws.root / ".epbuild" / "state.jsonl"))
    assert all(r.restored for r in state.records.values())


@pytest.mark.slow
def test_export_clone_import_cache_only(simple_ws: Callable[..., Workspace],
                                        tmp_path: Path) -> None:  # fmt: skip
    from epbuild.inspection.verify import verify_outputs

    ws = simple_ws()
    ws.build(cache=str(tmp_path / "cache-a"))
    archive = tmp_path / "ci-cache.tar.gz"
    ws.cli("cache", "export", str(archive), "--cache", str(tmp_path / "cache-a"), check=True)
    other = clone(ws, tmp_path / "elsewhere" / "deeper" / "ws")
    cache_b = str(tmp_path / "cache-b")
    proc = other.cli("cache", "import", str(archive), "--cache", cache_b, check=True)
    assert "imported 2 entr(ies), 5 object(s)" in proc.stdout
    doc = other.cli_json("build", "--cache-only", "--cache", cache_b)
    assert doc["summary"]["compiled"] == 0 and doc["summary"]["restored"] == 2, doc
    assert outputs(other) == outputs(ws)
    result = verify_outputs(other.root)
    assert result.ok and len(result.checked) == 3, result.lines()
    # the CI key depends on action keys only, not on where the workspace lives
    assert other.cli("cache", "key").stdout == ws.cli("cache", "key").stdout


def _built_cleaned_object(ws: Workspace, tmp_path: Path) -> tuple[Path, Any, Path]:
    """Build into a fresh cache, clean, and return (cache, outputs, the c binary's object)."""
    cache = tmp_path / "cache"
    ws.build(cache=str(cache))
    good = outputs(ws)
    ws.main("clean", check=True)
    entry = next(e for e in check_consistent(cache) if e.action_id == "single/htp/c")
    return cache, good, cache / object_path(entry.outputs["c_ctx_qnn.bin"].digest)


@pytest.mark.slow
def test_flipped_bit_in_object_is_detected_and_recompiled(simple_ws: Callable[..., Workspace],
                                                          tmp_path: Path) -> None:  # fmt: skip
    ws = simple_ws()
    cache, good, obj = _built_cleaned_object(ws, tmp_path)
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x10
    obj.write_bytes(bytes(data))
    result = ws.build(cache=str(cache))
    by_id = {a.id: a for a in result.actions}
    assert by_id["pair/htp"].outcome is Outcome.RESTORED
    assert by_id["single/htp/c"].outcome is Outcome.COMPILED
    assert any("c_ctx_qnn.bin is damaged" in w for w in by_id["single/htp/c"].warnings)
    assert outputs(ws) == good  # the damaged bytes never reached the output directory
    check_consistent(cache)  # the recompile stored a good object again
    ws.cli("clean", check=True)
    assert ws.build(cache=str(cache)).count(Outcome.RESTORED) == 2


@pytest.mark.slow
def test_restore_trusts_objects_verified_before(
    simple_ws: Callable[..., Workspace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hard-linked object whose stat matches its verified record is not re-hashed; one whose
    record is gone is re-hashed once and recorded again."""
    import epbuild.cache.actioncache as ac
    from epbuild.cache.trust import verified_path

    ws = simple_ws()
    cache = tmp_path / "cache"
    ws.build(cache=str(cache))
    digests = {o.digest for e in check_consistent(cache) for o in e.outputs.values()}
    assert all((cache / verified_path(d)).is_file() for d in digests)  # sealed when stored
    hashed: list[str] = []
    real = ac.hash_file
    monkeypatch.setattr(ac, "hash_file", lambda p: hashed.append(p) or real(p))
    ws.cli("clean", check=True)
    assert ws.build(cache=str(cache)).count(Outcome.RESTORED) == 2
    assert hashed == []
    (cache / verified_path(next(iter(digests)))).unlink()
    ws.cli("clean", check=True)
    assert ws.build(cache=str(cache)).count(Outcome.RESTORED) == 2
    assert len(hashed) == 1 and (cache / verified_path(next(iter(digests)))).is_file()
    assert ws.cli("verify").returncode == 0


@pytest.mark.slow
def test_tampering_that_keeps_size_and_mtime_needs_a_full_verify(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    """The documented limit of the stat trust model: a bit flipped with size and mtime put
    back is restored on trust; ``verify`` catches it in the output (a hard link to the
    object), ``cache verify`` discards it, and the next build recompiles."""
    ws = simple_ws()
    cache, good, obj = _built_cleaned_object(ws, tmp_path)
    st = obj.stat()
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x10
    obj.write_bytes(bytes(data))
    obj.chmod(0o444)
    os.utime(obj, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ws.build(cache=str(cache)).count(Outcome.RESTORED) == 2
    proc = ws.cli("verify")
    assert proc.returncode == 1 and "c_ctx_qnn.bin" in proc.stdout + proc.stderr
    proc = ws.cli("cache", "verify", "--cache", str(cache))
    assert proc.returncode == 1, proc.stderr
    assert "single/htp/c): c_ctx_qnn.bin missing or damaged; discarded" in proc.stderr
    assert not obj.exists()
    ws.cli("clean", check=True)
    result = ws.build(cache=str(cache))
    assert outcomes(result) == {"pair/htp": "restored", "single/htp/c": "compiled"}
    assert outputs(ws) == good
    proc = ws.cli("cache", "verify", "--cache", str(cache))
    assert proc.returncode == 0 and "; 0 discarded" in proc.stdout, proc.stderr
    check_consistent(cache)


def test_cache_only_miss_fails_listing_why(simple_ws: Callable[..., Workspace],
                                           tmp_path: Path) -> None:  # fmt: skip
    ws = simple_ws()
    proc = ws.cli("build", "--cache-only", "--cache", str(tmp_path / "empty"))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("not in the cache: no entry for") == 2
    assert "pair/htp" in proc.stderr and "single/htp/c" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((ws.root / "build").rglob("*.onnx"))


def test_version_bump_miss_is_explained(simple_ws: Callable[..., Workspace], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from epbuild import api
    from epbuild.providers import qnn

    ws = simple_ws()
    cache = str(tmp_path / "cache")
    ws.build(cache=cache)
    other = clone(ws, tmp_path / "fresh")
    plans = api.status(other.root, cache=cache).actions
    assert all(p.reasons[-1].startswith("in the cache (") for p in plans)
    real = qnn.dist_version
    here = real("onnxruntime-qnn")
    monkeypatch.setattr(qnn, "dist_version",
                        lambda d: "9.9.9" if d == "onnxruntime-qnn" else real(d))  # fmt: skip
    plans = api.status(other.root, cache=cache).actions
    expected = (f"not in the cache: the cache has pair/htp under another key (cache → here): "
                f"onnxruntime-qnn {here} → 9.9.9")  # fmt: skip
    assert plans[0].reasons == ["never built", expected]
    result = other.build(cache=cache, cache_only=True)
    assert result.count(Outcome.FAILED) == 2
    assert f"onnxruntime-qnn {here} → 9.9.9" in (result.actions[1].error or "")


def test_a_lone_restore_runs_in_the_coordinator_traced_as_a_slot(
    simple_ws: Callable[..., Workspace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--cache-only`` of one action restores it in the building thread (no slot thread),
    its trace as a slot's; of two, in slot threads."""
    import threading

    from epbuild.engine.builder import Builder

    ws = simple_ws()
    cache = str(tmp_path / "cache")
    ws.build(cache=cache)
    ran: list[bool] = []
    real = Builder.run_one

    def run_one(self: Builder, plan: Any) -> Any:
        ran.append(threading.current_thread() is threading.main_thread())
        return real(self, plan)

    monkeypatch.setattr(Builder, "run_one", run_one)
    lone = clone(ws, tmp_path / "lone")
    assert outcomes(lone.build("single", cache=cache, cache_only=True)) == {
        "single/htp/c": "restored"
    }
    assert ran == [True]
    events = json.loads((lone.root / ".epbuild" / "trace.json").read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {0: "coordinator", 1: "slot 1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans if e["cat"] != "plan"} == {1}
    assert [e["cat"] for e in spans if e["tid"] == 0] == ["plan"]
    both = clone(ws, tmp_path / "both")
    ran.clear()
    assert both.build(cache=cache, cache_only=True).count(Outcome.RESTORED) == 2
    assert ran == [False, False]
    assert outputs(lone) | outputs(both) == outputs(ws)


@pytest.mark.slow
def test_two_processes_fill_one_cache(simple_ws: Callable[..., Workspace], tmp_path: Path) -> None:
    ws = simple_ws()
    twin = clone(ws, tmp_path / "twin")  # same keys: both write the same objects and entries
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen([sys.executable, "-m", "epbuild", "-C", str(w.root), "build", "--json",
                          "--cache", str(cache)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for w in (ws, twin)
    ]  # fmt: skip
    docs = []
    for p in procs:
        out, err = waits.communicate(p, "a concurrent build to finish", timeout=300)
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    assert all(d["summary"]["compiled"] + d["summary"]["restored"] == 2 for d in docs)
    entries = check_consistent(cache)
    assert sorted(e.action_id for e in entries) == ["pair/htp", "single/htp/c"]
    third = clone(ws, tmp_path / "third")
    doc = third.cli_json("build", "--cache-only", "--cache", str(cache))
    assert doc["summary"]["restored"] == 2
    assert outputs(third) == outputs(ws) == outputs(twin)


@pytest.mark.slow
def test_prune_evicts_least_recently_used(simple_ws: Callable[..., Workspace],
                                          tmp_path: Path) -> None:  # fmt: skip
    ws = simple_ws()
    cache = tmp_path / "cache"
    ws.build(cache=str(cache))
    entries = {e.action_id: e for e in check_consistent(cache)}
    ws.cli("clean", "single", check=True)
    ws.build("single", cache=str(cache))  # a restore: single/htp/c is now the most recent
    limit = entries["single/htp/c"].size + 10
    proc = ws.cli("cache", "prune", "--max-size", str(limit), "--cache", str(cache), check=True)
    assert "removed 1 entr(ies)" in proc.stdout
    left = check_consistent(cache)
    assert [e.action_id for e in left] == ["single/htp/c"]
    stored = sum(p.stat().st_size for p in (cache / OBJECTS).rglob("*") if p.is_file())
    assert stored <= limit
    # the key locks of evicted entries go too, once older than the grace period
    from epbuild.cache.prune import prune
    from epbuild.cache.store import LOCKS

    assert len(list((cache / LOCKS).rglob("*.lock"))) == 2
    prune(ActionCache(str(cache)).local, limit, grace=0)
    assert [p.stem for p in (cache / LOCKS).rglob("*.lock")] == [entries["single/htp/c"].key]
    ws.cli("clean", check=True)
    result = ws.build(cache=str(cache), cache_only=True)
    assert outcomes(result) == {"pair/htp": "failed", "single/htp/c": "restored"}
    assert ws.cli("cache", "prune", "--max-size", "lots").returncode == 2


@pytest.mark.slow
def test_cache_key_follows_action_keys(simple_ws: Callable[..., Workspace]) -> None:
    from modelgen import matmul_model

    ws = simple_ws()
    first = ws.cli("cache", "key", check=True).stdout.strip()
    assert first.startswith("epbuild-") and len(first) == 24
    assert ws.cli("cache", "key", check=True).stdout.strip() == first
    (ws.root / "models" / "c.onnx").touch()
    assert ws.cli("cache", "key", check=True).stdout.strip() == first
    ws.model("models/c.onnx", matmul_model(42))
    assert ws.cli("cache", "key", check=True).stdout.strip() != first


@pytest.mark.slow
def test_default_cache_is_per_user_and_no_cache_bypasses(
    simple_ws: Callable[..., Workspace], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPBUILD_CACHE")
    ws = simple_ws()
    ws.build("single")
    user_cache = Path(os.environ["XDG_CACHE_HOME"]) / "epbuild"
    assert len(check_consistent(user_cache)) == 1
    ws.cli("clean", check=True)
    doc = ws.cli_json("build", "--no-cache")
    assert doc["summary"]["compiled"] == 2 and doc["summary"]["restored"] == 0
    assert len(check_consistent(user_cache)) == 1  # --no-cache stores nothing either


@pytest.mark.slow
def test_damaged_archive_imports_nothing_bad(simple_ws: Callable[..., Workspace],
                                             tmp_path: Path) -> None:  # fmt: skip
    ws = simple_ws()
    ws.build("single", cache=str(tmp_path / "a"))
    archive = tmp_path / "x.tar"
    ws.cli("cache", "export", str(archive), "single", "--cache", str(tmp_path / "a"), check=True)
    raw = archive.read_bytes()
    archive.write_bytes(raw[: len(raw) // 3])
    proc = ws.cli("cache", "import", str(archive), "--cache", str(tmp_path / "b"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert check_consistent(tmp_path / "b") == []
    missing = ws.cli("cache", "import", str(tmp_path / "nope.tar"), "--cache", str(tmp_path / "b"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def _until(what: str, ready: Callable[[], bool], timeout: float = 240) -> None:
    """Wait for an event (polled), failing with ``what`` after a generous deadline."""
    waits.wait_for(ready, what, timeout=timeout, interval=0.05)


def _worker_logs_say(ws: Workspace, needle: str) -> bool:
    from epbuild._names import LOG_NAME

    for log in (ws.root / "build").rglob(LOG_NAME):
        try:
            if needle in log.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _popen_build(ws: Workspace, cache: Path, err: Path, **env: str) -> subprocess.Popen[str]:
    with err.open("w") as f:  # the child has its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "epbuild", "-C", str(ws.root), "build", "--json", "--cache",
             str(cache)],
            stdout=subprocess.PIPE, stderr=f, text=True, env={**os.environ, **env},
        )  # fmt: skip


@pytest.mark.slow
def test_two_workspaces_sharing_a_cache_compile_each_key_once(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    ws = simple_ws()
    other = clone(ws, tmp_path / "other")
    cache, gate = tmp_path / "shared-cache", tmp_path / "go"
    # A's compile of c is held open until the test says go: B starts while it runs
    a = _popen_build(ws, cache, tmp_path / "a.err",
                     EPBUILD_TEST_HOOK=f"wait:models/c.onnx:{gate}")  # fmt: skip
    try:
        _until("A compiling c", lambda: _worker_logs_say(ws, "epbuild test hook: wait"))
        b = _popen_build(other, cache, tmp_path / "b.err")
        b_err = tmp_path / "b.err"
        _until("B waiting for A's key, or done",
               lambda: "built elsewhere" in b_err.read_text() or b.poll() is not None)  # fmt: skip
    finally:
        gate.touch()
    docs = []
    for p, err in ((a, tmp_path / "a.err"), (b, tmp_path / "b.err")):
        out, _ = waits.communicate(p, "a build sharing the cache to finish", timeout=300)
        assert p.returncode == 0, err.read_text()
        docs.append(json.loads(out))
    compiled = sum(d["summary"]["compiled"] for d in docs)
    restored = sum(d["summary"]["restored"] for d in docs)
    assert (compiled, restored) == (2, 2), docs
    assert outcomes_of(docs[1])["single/htp/c"] == "restored"
    assert outputs(other) == outputs(ws)
    check_consistent(cache)


def outcomes_of(doc: dict[str, Any]) -> dict[str, str]:
    return {a["id"]: a["outcome"] for a in doc["actions"]}


def test_inputs_are_hashed_again_after_waiting_for_the_action_lock(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    """A build that planned with one content of an input, then waited for another process's
    action lock while the input changed back, must not restore (or commit) the outputs of
    the content it planned with."""
    from modelgen import matmul_model

    from epbuild.state import locks

    ws = simple_ws()
    cache = tmp_path / "cache"
    model = ws.root / "models" / "c.onnx"
    first = model.read_bytes()
    assert ws.build(cache=str(cache)).count(Outcome.COMPILED) == 2
    built_first = outputs(ws)
    ws.model("models/c.onnx", matmul_model(4))
    assert ws.build(cache=str(cache)).count(Outcome.COMPILED) == 1  # the cache holds both
    model.write_bytes(first)
    assert ws.build(cache=str(cache)).count(Outcome.RESTORED) == 1
    ws.model("models/c.onnx", matmul_model(4))  # planned with this content...
    slug = hashlib.sha256(b"single/htp/c").hexdigest()[:16]  # Action.slug
    lock = ws.root / ".epbuild" / "locks" / f"{slug}.lock"
    err = tmp_path / "build.err"
    with locks.hold(str(lock), "a test holding the action lock"):
        proc = _popen_build(ws, cache, err)
        _until("the build waiting for the lock",
               lambda: "waiting for" in err.read_text() or proc.poll() is not None)  # fmt: skip
        assert proc.poll() is None, (proc.communicate(), err.read_text())
        model.write_bytes(first)  # ...and changed back while it waited
    out, _ = waits.communicate(proc, "the build to finish", timeout=300)
    assert proc.returncode == 0, err.read_text()
    assert outcomes_of(json.loads(out))["single/htp/c"] == "up_to_date", out
    assert outputs(ws) == built_first
    assert ws.build(cache=str(cache)).count(Outcome.UP_TO_DATE) == 2


def test_storing_an_object_again_leaves_the_outputs_linked_to_it_as_they_are(
    tmp_path: Path,
) -> None:
    """A restore links outputs to the cache's objects; a later store of the same bytes marks
    the object used by its access time only: the outputs' mtime, which the stat cache and
    the trust records vouch by, stays (else every linked output is hashed again)."""
    from epbuild.state.journal import ActionRecord, OutputRecord

    body = b"x" * 100
    digest = hashlib.sha256(body).hexdigest()

    def record(key: str) -> ActionRecord:
        outs = {"out/a.bin": OutputRecord(len(body), digest)}
        return ActionRecord("g/p", key, {}, outs, 0.0, 0, 0.0)

    cache = ActionCache(str(tmp_path / "cache"))
    built = tmp_path / "built"
    built.mkdir()
    (built / "a.bin").write_bytes(body)
    cache.save(record("1" * 64), str(built))
    restored = tmp_path / "restored"
    restored.mkdir()
    assert cache.local_backend.materialize(object_path(digest), str(restored / "a.bin")) == "link"
    obj = tmp_path / "cache" / object_path(digest)
    os.utime(obj, ns=(1, obj.stat().st_mtime_ns))  # last used long ago
    before = (restored / "a.bin").stat()
    cache.save(record("2" * 64), str(restored))  # the same bytes, stored again
    after = (restored / "a.bin").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert obj.stat().st_atime_ns > 1  # used now: a concurrent prune spares it
    assert len(check_consistent(tmp_path / "cache")) == 2


def test_a_vouched_state_output_becomes_its_object_by_a_hard_link(tmp_path: Path) -> None:
    """Outputs in the state directory are epbuild's own: stored by a hard link (read-only,
    as a restored output is), where the stat cache vouches for the file; any other stat
    (replaced, written since) and it is copied and hashed as every other output."""
    from epbuild.cache import trust
    from epbuild.state.journal import ActionRecord, OutputRecord

    state = tmp_path / "state"
    state.mkdir()
    files = {"a.bin": b"a" * 100, "b.bin": b"b" * 100}
    outs = {}
    for name, body in files.items():
        (state / name).write_bytes(body)
        outs[f"state/{name}"] = OutputRecord(len(body), hashlib.sha256(body).hexdigest())
    os.utime(state / "a.bin", ns=(1, 10**18))  # written long enough ago to be vouched for
    a, b = (state / "a.bin").stat(), (state / "b.bin").stat()
    vouched = {
        "a.bin": (a.st_ino, a.st_size, a.st_mtime_ns),
        "b.bin": (b.st_ino, b.st_size, b.st_mtime_ns + 1),  # not the file as it is now
    }
    cache = ActionCache(str(tmp_path / "cache"))
    cache.save(ActionRecord("g/p", "1" * 64, {}, outs, 0.0, 0, 0.0), str(state), vouched.get)
    obj_a = tmp_path / "cache" / object_path(outs["state/a.bin"].digest)
    obj_b = tmp_path / "cache" / object_path(outs["state/b.bin"].digest)
    assert obj_a.stat().st_ino == a.st_ino and (state / "a.bin").stat().st_mode & 0o222 == 0
    assert trust.is_trusted(str(tmp_path / "cache"), outs["state/a.bin"].digest, obj_a.stat())
    assert obj_b.stat().st_ino != b.st_ino and obj_b.read_bytes() == files["b.bin"]
    assert len(check_consistent(tmp_path / "cache")) == 1


def _state_output(folder: Path, body: bytes) -> tuple[str, Any, tuple[int, int, int]]:
    """A state output written long enough ago to be vouched for: (name, record, stat)."""
    from epbuild.state.journal import OutputRecord

    folder.mkdir(parents=True)
    (folder / "a.bin").write_bytes(body)
    os.utime(folder / "a.bin", ns=(1, 10**18))
    st = (folder / "a.bin").stat()
    digest = hashlib.sha256(body).hexdigest()
    return "a.bin", OutputRecord(len(body), digest), (st.st_ino, st.st_size, st.st_mtime_ns)


def test_two_stores_by_link_of_the_same_bytes_at_once_leave_one_good_object(
    tmp_path: Path,
) -> None:
    """Two builds (two workspaces sharing a cache) store the same prepared bytes by hard link
    at the same moment: one object, whole, the other's file as it was. The last rename wins
    the object's name; the trust record may then name the other file, which costs one
    re-hash at a restore (``cache.trust``: a record is only a hint)."""
    import threading

    from epbuild.state.journal import ActionRecord

    body = b"w" * 4096
    made = [_state_output(tmp_path / f"ws{i}", body) for i in range(2)]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def store(i: int) -> None:
        name, out, stat_key = made[i]
        record = ActionRecord("g/p", f"{i + 1}" * 64, {}, {f"s/{name}": out}, 0.0, 0, 0.0)
        cache = ActionCache(str(tmp_path / "cache"))
        start.wait()
        try:
            cache.save(record, str(tmp_path / f"ws{i}"), {name: stat_key}.get)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=store, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    obj = tmp_path / "cache" / object_path(made[0][1].digest)
    assert obj.read_bytes() == body
    assert obj.stat().st_ino in {(tmp_path / f"ws{i}" / "a.bin").stat().st_ino for i in (0, 1)}
    assert all((tmp_path / f"ws{i}" / "a.bin").read_bytes() == body for i in (0, 1))
    assert len(check_consistent(tmp_path / "cache")) == 2


def test_a_store_by_link_where_links_fail_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache on another filesystem (no hard link across): the vouched output is copied and
    hashed as any other, and stays writable as it was."""
    import errno

    from epbuild.state.journal import ActionRecord

    name, out, stat_key = _state_output(tmp_path / "ws", b"c" * 100)

    def cross_device(*_: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    record = ActionRecord("g/p", "1" * 64, {}, {f"s/{name}": out}, 0.0, 0, 0.0)
    ActionCache(str(tmp_path / "cache")).save(record, str(tmp_path / "ws"), {name: stat_key}.get)
    obj = tmp_path / "cache" / object_path(out.digest)
    assert obj.read_bytes() == b"c" * 100
    assert obj.stat().st_ino != (tmp_path / "ws" / "a.bin").stat().st_ino
    assert (tmp_path / "ws" / "a.bin").stat().st_mode & 0o200  # not made read-only
    assert len(check_consistent(tmp_path / "cache")) == 1
