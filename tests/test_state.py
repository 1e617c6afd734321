"""The state journal and the stat cache survive truncation and corruption at any byte.

Like Ninja's ``BuildLogTest.Truncate``: cut the real journal of a real build at every byte
offset and load it; flip bytes in the middle; damage the stat cache. Loading never raises,
never yields a record that was not written, and the next build converges.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Workspace

from epbuild.api import Outcome
from epbuild.planning.staleness import make_plan
from epbuild.planning.workspace import open_workspace
from epbuild.state.journal import ActionRecord, Journal, State, load_state
from epbuild.state.statcache import StatCache, hash_file


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile for real: no restores from a per-user action cache."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


def _built(simple_ws: Callable[..., Workspace]) -> tuple[Workspace, Path, bytes]:
    ws = simple_ws()
    assert ws.build().ok
    # a second record for one action and an interrupted begin: a realistic journal
    state_path = ws.root / ".epbuild" / "state.jsonl"
    state = load_state(str(state_path))
    rec = state.records["single/htp/c"]
    journal = Journal(str(state_path))
    journal.begin("pair/htp", state.records["pair/htp"].key)
    journal.done(state.records["pair/htp"])
    journal.done(rec)
    journal.forget("nope/never")
    return ws, state_path, state_path.read_bytes()


def _verified(ws: Workspace) -> None:
    """Every recorded output exists with its recorded size and digest."""
    state = load_state(str(ws.root / ".epbuild" / "state.jsonl"))
    assert not state.interrupted
    for action_id, rec in state.records.items():
        for rel, out in rec.outputs.items():
            full = ws.root / rel
            assert full.is_file(), (action_id, rel)
            assert full.stat().st_size == out.size and hash_file(str(full)) == out.digest


@pytest.mark.slow
def test_truncated_at_every_offset(simple_ws: Callable[..., Workspace]) -> None:
    ws, path, full = _built(simple_ws)
    complete = load_state(str(path))
    assert set(complete.records) == {"pair/htp", "single/htp/c"} and not complete.interrupted
    ends = [i + 1 for i, b in enumerate(full) if b == ord("\n")]
    w = open_workspace(ws.root)
    for cut in range(len(full) + 1):
        path.write_bytes(full[:cut])
        state = load_state(str(path))
        # only whole records survive, each exactly as written
        for action_id, rec in state.records.items():
            assert rec == complete.records[action_id] or _earlier_record(full[:cut], rec)
        whole_lines = sum(1 for e in ends if e <= cut)
        if cut in ends or cut == len(full):
            assert not state.warnings or whole_lines == 0
        if 0 < cut < len(_header(full)):
            assert state.warnings and "starting over" in state.warnings[0]
            assert not state.records
        plans = make_plan(w.actions, state, w.keys, w.stats, w.root)
        for p in plans:  # fresh only if the full record for it survived
            if not p.stale:
                assert state.records[p.action.id] == complete.records[p.action.id]
    assert len(full) > 1500, "the journal under test is too small to mean much"


def _header(raw: bytes) -> bytes:
    return raw[: raw.index(b"\n") + 1]


def _earlier_record(raw: bytes, rec: ActionRecord) -> bool:
    lines = [json.loads(x) for x in raw.split(b"\n")[1:] if x.strip().endswith(b"}")]
    return any(d.get("op") == "done" and d.get("key") == rec.key for d in lines)


@pytest.mark.slow
def test_build_converges_after_truncation(simple_ws: Callable[..., Workspace]) -> None:
    ws, path, full = _built(simple_ws)
    rng = random.Random(4)
    for cut in [*sorted(rng.sample(range(1, len(full)), 5)), len(_header(full)) - 3]:
        path.write_bytes(full[:cut])
        result = ws.build()
        assert result.ok, [a.error for a in result.actions]
        _verified(ws)
        assert ws.build().count(Outcome.UP_TO_DATE) == 2


@pytest.mark.slow
def test_corrupted_byte_anywhere_never_breaks_loading(simple_ws: Callable[..., Workspace]) -> None:
    ws, path, full = _built(simple_ws)
    complete = load_state(str(path))
    w = open_workspace(ws.root)
    rng = random.Random(1)
    for pos in range(len(full)):
        for value in (full[pos] ^ 0x01, rng.randrange(256)):
            bad = bytearray(full)
            bad[pos] = value
            path.write_bytes(bytes(bad))
            state = load_state(str(path))
            if pos % 5 == 0:
                for p in make_plan(w.actions, state, w.keys, w.stats, w.root):
                    if not p.stale:  # fresh: the record matches what is on disk and the key
                        rec = state.records[p.action.id]
                        assert rec.key == complete.records[p.action.id].key
                        assert rec.outputs == complete.records[p.action.id].outputs


@pytest.mark.slow
def test_damaged_state_warns_and_build_proceeds(simple_ws: Callable[..., Workspace]) -> None:
    ws, path, full = _built(simple_ws)
    path.write_bytes(b"\x00garbage" + full[40:])
    proc = ws.cli("build")
    assert proc.returncode == 0, proc.stderr
    assert "warning: state" in proc.stderr and "starting over" in proc.stderr
    assert "Traceback" not in proc.stderr
    _verified(ws)
    assert load_state(str(path)).warnings == []  # compacted into a clean journal
    path.write_bytes(full[: len(full) - 25])  # damaged tail: only the last record is lost
    proc = ws.cli("build")
    assert proc.returncode == 0 and "dropped 1 damaged record(s)" in proc.stderr, proc.stderr
    _verified(ws)


def test_wrongly_typed_records_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    good = {"op": "done", "id": "g/p", "key": "k", "components": {}, "seconds": 1,
            "outputs": {"build/g/p/a_ctx.onnx": {"size": 3, "digest": "d"}}}  # fmt: skip
    bad_variants = [
        [1, 2], "str", {"op": "done"}, {**good, "outputs": []}, {**good, "components": []},
        {**good, "id": 5}, {**good, "outputs": {"/etc/passwd": {"size": 1, "digest": "d"}}},
        {**good, "outputs": {"../x": {"size": 1, "digest": "d"}}},
        {**good, "outputs": {"a": {"size": "1", "digest": "d"}}}, {**good, "seconds": None},
        {"op": "begin", "id": ["x"]}, {"op": "explode", "id": "x"},
    ]  # fmt: skip
    for bad in bad_variants:
        path.write_bytes(
            b'{"epbuild_state":1}\n' + json.dumps(good).encode() + b"\n"
            + json.dumps(bad).encode() + b"\n"
        )  # fmt: skip
        state = load_state(str(path))
        assert list(state.records) == ["g/p"] and state.warnings, bad
    path.write_bytes(b'{"epbuild_state":1}\n' + b"[" * 100000 + b"\n")
    assert load_state(str(path)).warnings


def test_append_after_damaged_tail_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    journal = Journal(str(path))
    journal.begin("a", "k")
    path.write_bytes(path.read_bytes() + b'{"op":"done","id":"a"')  # a crash mid-append
    journal.forget("b")
    state = load_state(str(path))
    assert state.interrupted == {"a"}  # the damaged record is dropped, the rest replays
    assert state.warnings == [f"state {path}: dropped 2 damaged record(s) from line 3 on"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip", "types"])
def test_statcache_damage_only_costs_rehashing(simple_ws: Callable[..., Workspace],
                                               damage: str) -> None:  # fmt: skip
    ws = simple_ws()
    assert ws.build().ok
    cache = ws.root / ".epbuild" / "statcache.json"
    full = cache.read_bytes()
    assert len(StatCache(str(cache)).entries) >= 3
    variants: list[bytes] = []
    if damage == "truncate":
        variants = [full[:cut] for cut in range(len(full))]
    elif damage == "flip":
        for pos in range(len(full)):
            bad = bytearray(full)
            bad[pos] ^= 0x20
            variants.append(bytes(bad))
    else:
        data = json.loads(full.partition(b"\n")[2])
        rel = next(iter(data["entries"]))
        for entry in (
            [1, 2],
            ["a", 1, 1, "0" * 64, None],
            [1, 1, 1, 5, None],
            [1, 1, 1, "0" * 64, [7]],
            [1, 1, 1, "0" * 64, ["../../etc/passwd"]],
        ):
            data["entries"][rel] = entry
            variants.append(_signed(json.dumps(data).encode()))
        variants += [_signed(b"[]"), _signed(b"null"), _signed(b'{"entries":[]}'), b"[]\n{}"]
    w = open_workspace(ws.root)
    for raw in variants:
        cache.write_bytes(raw)
        stats = StatCache(str(cache))
        for rel, e in stats.entries.items():  # whatever loaded is well-formed
            assert isinstance(rel, str) and isinstance(e.digest, str) and isinstance(e.size, int)
        w.stats = stats
        w.keys.stats = stats
        w.keys._models.clear()
        plans = make_plan(w.actions, w.state, w.keys, stats, w.root)
        assert not any(p.stale for p in plans), [p.reasons for p in plans if p.stale]
    cache.write_bytes(full[: len(full) // 2])
    result = ws.build()
    assert result.count(Outcome.UP_TO_DATE) == 2


def _signed(body: bytes) -> bytes:
    import hashlib

    return json.dumps({"version": 2, "sha256": hashlib.sha256(body).hexdigest()}).encode() + (
        b"\n" + body
    )


def test_state_without_records_is_empty(tmp_path: Path) -> None:
    assert load_state(str(tmp_path / "missing.jsonl")) == State()
    (tmp_path / "dir.jsonl").mkdir()
    state = load_state(str(tmp_path / "dir.jsonl"))
    assert not state.records and state.warnings
