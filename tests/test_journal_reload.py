"""Incremental journal reloads replay only appended lines and agree with a full replay."""

from __future__ import annotations

from pathlib import Path

from epbuild.state.journal import ActionRecord, Journal, OutputRecord, State, load_state


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
