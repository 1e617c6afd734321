"""Incremental journal reloads, and loads through a snapshot, replay only the lines after
what they start from and agree with a full replay."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from epbuild._names import SNAPSHOT_SUFFIX
from epbuild.state import journal as journal_module
from epbuild.state.journal import (
    ActionRecord,
    Damage,
    Journal,
    OutputRecord,
    State,
    load_state,
)


def _rec(i: int) -> ActionRecord:
    return ActionRecord(
        id=f"g/p/m{i % 3}", key=f"{i:064x}", components={"i": i},
        outputs={f"build/g/p/m{i % 3}_ctx.onnx": OutputRecord(i, f"{i:064x}")},
        seconds=0.5, peak_rss=1, at=1.0,
    )  # fmt: skip


def _same(a: State, b: State) -> None:
    assert (a.records, a.interrupted, a.lines, a.warnings) == (
        b.records, b.interrupted, b.lines, b.warnings,
    )  # fmt: skip


def test_incremental_reload_matches_full_replay(tmp_path: Path) -> None:
    path = str(tmp_path / "state.jsonl")
    journal = Journal(path)
    state = load_state(path)
    for i in range(12):
        journal.begin(f"g/p/m{i % 3}", f"{i:064x}")
        if i % 4 != 3:  # some actions stay interrupted
            journal.done(_rec(i), sync=i % 2 == 0)
        if i == 7:
            journal.forget("g/p/m1")
        state = load_state(path, state)
        _same(state, load_state(path))
        assert state.replayed  # the next reload can be incremental
    assert state.records and state.interrupted


def test_rewritten_or_damaged_journal_is_replayed_in_full(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    journal = Journal(str(path))
    for i in range(4):
        journal.done(_rec(i))
    first = load_state(str(path))
    # compaction-like rewrite with other content: the old prefix no longer matches
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], lines[3], lines[4], b""]))
    _same(load_state(str(path), first), load_state(str(path)))
    # a torn append: same warnings as a full replay, and nothing cached to build on
    before = load_state(str(path))
    with open(path, "ab") as f:
        f.write(b'{"op":"done","id":"g/p/m9","ke')
    torn = load_state(str(path), before)
    _same(torn, load_state(str(path)))
    assert torn.warnings and not torn.replayed
    journal.done(_rec(5))  # starts a new line after the torn one; still dropped from there
    _same(load_state(str(path), torn), load_state(str(path)))


def _journal(path: str, n: int) -> Journal:
    journal = Journal(path)
    for i in range(n):
        journal.begin(f"g/p/m{i % 3}", f"{i:064x}")
        if i % 4 != 3:  # some actions stay interrupted
            journal.done(_rec(i), sync=False)
        if i == 5:
            journal.forget("g/p/m1")
    journal.damaged("g/p/m2", Damage(("build/g/p/m2_ctx.onnx",), "verify"))
    return journal


def _full(path: str) -> State:
    """A replay of the whole journal, its snapshot aside."""
    snapshot = Path(path + SNAPSHOT_SUFFIX)
    aside = snapshot.with_name("aside")
    if snapshot.exists():
        snapshot.rename(aside)
    try:
        return load_state(path)
    finally:
        if aside.exists():
            aside.rename(snapshot)


def _same_all(a: State, b: State) -> None:
    _same(a, b)
    assert a.damaged == b.damaged and list(a.records) == list(b.records)
    for action_id in a.records:
        assert a.records.committed(action_id) == b.records.committed(action_id)


def test_a_snapshot_stands_in_for_the_lines_it_covers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of a long journal writes a snapshot; the next load takes it and replays only
    the lines after it, and agrees with a full replay, record for record (those decoded
    only when asked for)."""
    monkeypatch.setattr(journal_module, "SNAPSHOT_EVERY", 4)
    path = str(tmp_path / "state.jsonl")
    journal = _journal(path, 9)
    snapshot = Path(path + SNAPSHOT_SUFFIX)
    first = load_state(path)
    assert snapshot.exists()
    decoded: list[str] = []
    from_json = ActionRecord.from_json
    monkeypatch.setattr(
        ActionRecord, "from_json", lambda data: decoded.append(data["id"]) or from_json(data)
    )
    again = load_state(path)
    assert decoded == []  # the snapshot stood in for every line
    assert again.records["g/p/m2"] == first.records["g/p/m2"] and decoded == ["g/p/m2"]
    _same_all(again, first)
    journal.done(_rec(10))  # appended after the snapshot: replayed
    journal.forget("g/p/m0")
    with_tail = load_state(path)
    _same_all(with_tail, _full(path))
    assert "g/p/m0" not in with_tail.records and with_tail.records["g/p/m1"] == _rec(10)
    # undecoded records decode to what a full replay gives, and compare equal to it
    assert load_state(path).records == _full(path).records


def test_a_stale_or_damaged_snapshot_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "SNAPSHOT_EVERY", 4)
    path = Path(tmp_path / "state.jsonl")
    _journal(str(path), 9)
    load_state(str(path))
    snapshot = Path(str(path) + SNAPSHOT_SUFFIX)
    good = snapshot.read_bytes()
    # the journal rewritten in place with other bytes (same length or longer)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"seconds":0.5', b'"seconds":0.7'))
    _same_all(load_state(str(path)), _full(str(path)))
    assert load_state(str(path)).records["g/p/m0"].seconds == 0.7
    # compacted: a shorter journal
    path.write_bytes(raw)
    snapshot.write_bytes(good)
    Journal(str(path)).compact_if_needed(replace(load_state(str(path)), lines=10_000))
    _same_all(load_state(str(path)), _full(str(path)))
    # a flipped byte in the snapshot, or a torn one
    path.write_bytes(raw)
    for damaged in (good.replace(b"build/g/p", b"build/g/q", 1), good[: len(good) // 2]):
        snapshot.write_bytes(damaged)
        _same_all(load_state(str(path)), _full(str(path)))


def test_damage_after_the_snapshot_is_reported_as_in_a_full_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "SNAPSHOT_EVERY", 4)
    path = str(tmp_path / "state.jsonl")
    journal = _journal(path, 9)
    load_state(path)
    with open(path, "ab") as f:
        f.write(b'{"op":"done","id":"g/p/m9","ke\n')
    journal.done(_rec(11))
    state = load_state(path)
    _same_all(state, _full(path))
    assert state.warnings and "line 20" in state.warnings[0], state.warnings


def test_a_snapshot_that_cannot_be_written_costs_nothing_but_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state directory that takes no new file (read-only, full): the load still answers,
    and the next one replays the journal in full."""
    monkeypatch.setattr(journal_module, "SNAPSHOT_EVERY", 4)
    path = str(tmp_path / "state.jsonl")
    _journal(path, 9)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module, "atomic_write_bytes", full_disk)
    state = load_state(path)
    assert not Path(path + SNAPSHOT_SUFFIX).exists() and not state.warnings
    _same_all(state, _full(path))
