"""Damage that a stat cannot see: whatever finds it makes the action stale, and a rewrite
within one timestamp tick is never trusted (real QNN builds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import Workspace
from test_runtime import _flip_middle_byte

from epbuild import status
from epbuild._names import NOOP_NAME, STATCACHE_NAME
from epbuild.errors import NotBuiltError
from epbuild.inspection.verify import verify_outputs
from epbuild.results import Outcome
from epbuild.runtime import open_action
from epbuild.state.statcache import StatCache, hash_file

BIN = "build/single/htp/c_ctx_qnn.bin"


def flip_keeping_stat(path: Path) -> None:
    """Change one byte in place: same inode, same size, mtime set back (a stat cannot tell)."""
    st = path.stat()
    _flip_middle_byte(path, keep_mtime=True)
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )


def stale_reasons(ws: Workspace) -> dict[str, str]:
    return {a.id: a.reasons[0] for a in status(ws.root).actions if a.stale}


@pytest.fixture
def built(simple_built: Workspace) -> Workspace:
    ws = simple_built  # compiled once per session (two actions), copied
    assert ws.build().count(Outcome.UP_TO_DATE) == 2  # writes the no-op fingerprint
    return ws


def test_damage_found_by_verify_is_rebuilt(built: Workspace) -> None:
    good = hash_file(str(built.root / BIN))
    flip_keeping_stat(built.root / BIN)
    assert stale_reasons(built) == {}  # the stat alone vouches for the file
    problems = [p.line() for p in verify_outputs(built.root).problems]
    assert problems == [f"{BIN}: content does not match the digest recorded by the build"]
    assert stale_reasons(built) == {"single/htp/c": f"verify found output {BIN} damaged"}
    # verify says the same thing again (not a second, different complaint)
    again = [p.line() for p in verify_outputs(built.root).problems]
    assert again == [
        f"build/single/htp: action single/htp/c is stale: verify found output {BIN} damaged; "
        "run 'epbuild build'"
    ]
    with pytest.raises(NotBuiltError, match="damaged"):
        open_action("single/htp", built.root)
    # the CLI's no-op fast path must not answer from its fingerprint either
    proc = built.main("build", check=True)
    assert "1 compiled" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert hash_file(str(built.root / BIN)) == good
    assert verify_outputs(built.root).ok
    assert built.build().count(Outcome.UP_TO_DATE) == 2


def test_damage_found_by_a_hash_check_is_rebuilt(built: Workspace) -> None:
    flip_keeping_stat(built.root / BIN)
    with open_action("single/htp", built.root) as opened:  # the stat check passes
        assert opened.session("c") is not None
    with pytest.raises(NotBuiltError, match="was modified"):
        open_action("single/htp", built.root, check="hash")
    assert stale_reasons(built) == {
        "single/htp/c": f'open_action(check="hash") found output {BIN} damaged'
    }
    result = built.build()
    assert result.count(Outcome.COMPILED) == 1
    with open_action("single/htp", built.root, check="hash") as opened:
        assert opened.session("c") is not None


def test_a_rebuild_since_the_check_is_not_marked(built: Workspace) -> None:
    """Damage is recorded only against the record that was checked, and only if the file
    still differs under the state lock."""
    from epbuild.planning.damage import record_damage
    from epbuild.planning.workspace import open_workspace

    ws = open_workspace(built.root)
    rec = ws.state.records["single/htp/c"]
    digest = rec.outputs[BIN].digest
    assert record_damage(ws, "single/htp/c", {BIN: "0" * 64}, "verify") is None
    assert record_damage(ws, "single/htp/c", {BIN: digest}, "verify") is None  # file is fine
    assert stale_reasons(built) == {}


def _rewrite_same_tick(path: Path, data: bytes) -> os.stat_result:
    """Rewrite ``path`` in place with same-size ``data``, keeping inode and mtime: what a
    filesystem with a 1–2 s timestamp tick shows for a rewrite within the tick."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return st


def test_stat_cache_distrusts_an_entry_as_new_as_its_own_write(tmp_path: Path) -> None:
    data = tmp_path / "m.bin"
    data.write_bytes(b"a" * 100)
    old = os.stat(data).st_mtime_ns - 5_000_000_000
    os.utime(data, ns=(old, old))
    cache = StatCache(str(tmp_path / "stats"))
    assert cache.digest(str(tmp_path), "m.bin").digest == hash_file(str(data))
    cache.save()
    st = _rewrite_same_tick(data, b"b" * 100)
    # Coarse timestamps: the cache file's write falls in the same tick as the file's mtime.
    os.utime(tmp_path / "stats", ns=(st.st_mtime_ns, st.st_mtime_ns))
    fresh = StatCache(str(tmp_path / "stats"))
    assert fresh.lookup("m.bin", os.stat(data)) is None
    assert fresh.digest(str(tmp_path), "m.bin").digest == hash_file(str(data))
    fresh.save()  # the entry of the rewritten file (the first one's change time is gone)
    # An entry older than the cache's write is trusted (no re-hash).
    os.utime(tmp_path / "stats", ns=(st.st_mtime_ns + 1, st.st_mtime_ns + 1))
    assert StatCache(str(tmp_path / "stats")).lookup("m.bin", os.stat(data)) is not None


def test_a_same_tick_rewrite_of_an_input_is_rebuilt(built: Workspace) -> None:
    """Inputs rewritten within the tick of the last build's records: neither the no-op
    fingerprint nor the stat cache may answer 'up to date'."""
    from modelgen import matmul_model, save

    source = built.root / "models/c.onnx"
    other = built.root / "other.onnx"
    save(matmul_model(4), other)
    if other.stat().st_size != source.stat().st_size:
        pytest.skip("the two generated models differ in size")
    st = _rewrite_same_tick(source, other.read_bytes())
    for name in (NOOP_NAME, STATCACHE_NAME):  # written in the same (coarse) tick
        os.utime(built.root / ".epbuild" / name, ns=(st.st_mtime_ns, st.st_mtime_ns))
    proc = built.main("build", check=True)
    assert "1 compiled" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_an_input_rewritten_with_its_old_mtime_put_back_is_rebuilt(built: Workspace) -> None:
    """A same-size rewrite of a source whose mtime is then put back (``touch -r``, an
    archiver, ``os.utime``), long after the last build's records: inode, size and mtime
    are those the stat cache and the no-op fingerprint hold; the change time is not."""
    from modelgen import matmul_model, save

    source = built.root / "models/c.onnx"
    other = built.root / "other.onnx"
    save(matmul_model(4), other)
    if other.stat().st_size != source.stat().st_size:
        pytest.skip("the two generated models differ in size")
    assert other.read_bytes() != source.read_bytes()
    before = source.stat()
    _rewrite_same_tick(source, other.read_bytes())
    after = source.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert stale_reasons(built) != {}
    proc = built.cli("build", check=True)
    assert "1 compiled" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_changed_change_time_rehashes_an_input_but_not_a_committed_output(
    tmp_path: Path,
) -> None:
    data = tmp_path / "m.bin"
    data.write_bytes(b"a" * 100)
    old = os.stat(data).st_mtime_ns - 5_000_000_000
    os.utime(data, ns=(old, old))
    cache = StatCache(str(tmp_path / "stats"))
    cache.digest(str(tmp_path), "m.bin")
    os.chmod(data, 0o600)  # moves the change time alone: content, size and mtime kept
    assert cache.lookup("m.bin", os.stat(data)) is None
    # An output epbuild committed is vouched for without it: a restored output is a hard
    # link to a cache object, whose change time other workspaces' restores move.
    assert cache.digest(str(tmp_path), "m.bin", output=True).ctime_ns is None
    os.chmod(data, 0o644)
    assert cache.lookup("m.bin", os.stat(data)) is not None
    cache.save()
    assert StatCache(str(tmp_path / "stats")).lookup("m.bin", os.stat(data)) is not None


def test_a_recorded_damage_survives_compaction_and_clears_on_done(tmp_path: Path) -> None:
    from epbuild.state.journal import ActionRecord, Damage, Journal, load_state

    path = str(tmp_path / "state.jsonl")
    journal = Journal(path)
    rec = ActionRecord("g/p", "k", {}, {}, 1.0, 0, 1.0)
    journal.done(rec)
    journal.damaged("g/p", Damage(("build/x.bin",), "verify"))
    state = load_state(path)
    assert "g/p" in state.interrupted and state.damaged["g/p"].outputs == ("build/x.bin",)
    state.lines = 10_000  # force a compaction
    journal.compact_if_needed(state)
    assert load_state(path).damaged == state.damaged
    journal.done(rec)
    after = load_state(path)
    assert after.damaged == {} and after.interrupted == set()
