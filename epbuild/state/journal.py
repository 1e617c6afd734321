"""The state journal: an append-only, versioned record of completed actions.

Each line is one JSON record. A ``begin`` record is appended before an action's outputs are
touched and a ``done`` record after they are all in place (Snakemake's incomplete marker):
an action whose last record is ``begin`` was interrupted and is stale. A damaged tail (a
crash mid-append) is dropped on load; a damaged header starts over. When the journal grows
well past its live records it is compacted by writing a new file and renaming it over the
old one (Ninja's build log).

A large journal is read through a *snapshot* beside it (``state.jsonl.snapshot``): each
action's key and outputs after replaying the journal's first N bytes, with the sha256 of
those bytes. A load whose journal still begins with them takes the snapshot and replays only
what was appended since; a record's other fields (components, detail, ...) are decoded from
its journal line when first asked for. The snapshot is a cache: a missing, damaged or stale
one (the journal compacted or rewritten) only costs a full replay, which writes a new one.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from collections.abc import Iterator, MutableMapping
from json.scanner import make_scanner
from typing import Any, TypeVar, overload

from epbuild._dataclass import dataclass, field, replace
from epbuild._names import SNAPSHOT_SUFFIX
from epbuild.fs import atomic_write_bytes, is_safe_reference, open_read, sha256_hex
from epbuild.state import journalfile
from epbuild.state.journalfile import HEADER_LINE, encode_line

_HEADER_LINE = HEADER_LINE


@dataclass(frozen=True)
class OutputRecord:
    """One committed output file."""

    size: int
    digest: str


@dataclass(frozen=True)
class ActionRecord:
    """The last completed run of an action."""

    id: str
    key: str
    components: dict[str, Any]
    outputs: dict[str, OutputRecord]
    """Workspace-relative path → size and digest."""
    seconds: float
    peak_rss: int
    at: float
    detail: dict[str, Any] = field(default_factory=dict)
    """Per-model coverage and sizes, for reports."""
    restored: bool = False

    @property
    def action_id(self) -> str:
        """``id``, under the name a cache entry gives it."""
        return self.id

    @property
    def size(self) -> int:
        """Bytes of all outputs."""
        return sum(o.size for o in self.outputs.values())

    def to_json(self) -> dict[str, Any]:
        """The one JSON form of a record: a journal ``done`` line holds it, and so does a
        cache entry (``cache.store``), whose outputs are named by file."""
        return {
            "id": self.id,
            "key": self.key,
            "components": self.components,
            "outputs": {p: {"size": o.size, "digest": o.digest} for p, o in self.outputs.items()},
            "seconds": round(self.seconds, 4),
            "peak_rss": self.peak_rss,
            "at": self.at or time.time(),
            "detail": self.detail,
            "restored": self.restored,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ActionRecord:
        """A record written by ``to_json`` (raises ``ValueError`` for one of another shape:
        wrong types, a negative size, an output path that is absolute or climbs out)."""
        outputs: dict[str, OutputRecord] = {}
        for path, out in _want(data["outputs"], dict).items():
            size = _want(out, dict)["size"]
            if type(size) is not int:  # bool is not a size
                raise _Damaged(f"unexpected {type(size).__name__}")
            if size < 0:
                raise _Damaged("negative size")
            if not is_safe_reference(path):  # never let a damaged record point clean elsewhere
                raise _Damaged(f"unsafe output path {path!r}")
            outputs[path] = OutputRecord(size, _want(out["digest"], str))
        return cls(
            id=_want(data["id"], str),
            key=_want(data["key"], str),
            components=_want(data["components"], dict),
            outputs=outputs,
            seconds=float(_want(data["seconds"], (int, float))),
            peak_rss=int(_want(data.get("peak_rss", 0), int)),
            at=float(_want(data.get("at", 0), (int, float))),
            detail=_want(data.get("detail", {}), dict),
            restored=bool(data.get("restored", False)),
        )

    def named(self) -> ActionRecord:
        """This record with its outputs named by file (a cache entry's form)."""
        outputs = {posixpath.basename(p): o for p, o in self.outputs.items()}
        return replace(self, outputs=outputs)

    def placed(self, out_dir: str) -> ActionRecord:
        """This record (outputs named by file) with its outputs in ``out_dir``."""
        return replace(
            self, outputs={posixpath.join(out_dir, n): o for n, o in self.outputs.items()}
        )


@dataclass(frozen=True)
class Damage:
    """Outputs of a committed action that a check found changed (``verify``, a hash check)."""

    outputs: tuple[str, ...]
    by: str
    """What found it: ``verify``, ``open_action(check="hash")``, ``package``."""

    def reason(self) -> str:
        """Why the action is stale, in the words ``status`` prints."""
        more = f" (and {len(self.outputs) - 1} more)" if len(self.outputs) > 1 else ""
        return f"{self.by} found output {self.outputs[0]}{more} damaged"


Committed = tuple[str, dict[str, tuple[int, str]]]
"""An action's recorded key and outputs (workspace-relative path → size, digest): what
planning reads of its record."""

_T = TypeVar("_T")

_Lazy = tuple[str, dict[str, Any], int, int]
"""A record not decoded yet: its key, outputs (path → [size, digest]) and the span of its
``done`` line in the journal's bytes."""


class Records(MutableMapping[str, ActionRecord]):
    """Action id → its last completed run: a dict whose records read from a snapshot are
    decoded from their journal line when first asked for (``committed`` answers planning
    without decoding)."""

    __slots__ = ("_items", "_raw")

    def __init__(self, raw: bytes = b"") -> None:
        self._items: dict[str, ActionRecord | _Lazy] = {}
        self._raw = raw
        """The journal's bytes, which the spans of undecoded records point into."""

    def _decode(self, action_id: str, value: ActionRecord | _Lazy) -> ActionRecord:
        if type(value) is not tuple:
            return value  # type: ignore[return-value]
        start, end = value[2], value[3]
        rec = ActionRecord.from_json(_want(_loads(self._raw[start:end]), dict))
        self._items[action_id] = rec
        return rec

    def __getitem__(self, action_id: str) -> ActionRecord:
        return self._decode(action_id, self._items[action_id])

    @overload
    def get(self, action_id: str, /) -> ActionRecord | None: ...
    @overload
    def get(self, action_id: str, /, default: ActionRecord | _T) -> ActionRecord | _T: ...
    def get(self, action_id: str, /, default: object = None) -> object:
        value = self._items.get(action_id)
        return default if value is None else self._decode(action_id, value)

    def __setitem__(self, action_id: str, rec: ActionRecord) -> None:
        self._items[action_id] = rec

    def __delitem__(self, action_id: str) -> None:
        del self._items[action_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, action_id: object) -> bool:
        return action_id in self._items

    def __repr__(self) -> str:
        return f"Records({dict(self.items())!r})"

    def discard(self, action_id: str) -> None:
        """Drop a record if there is one (without decoding it)."""
        self._items.pop(action_id, None)

    def committed(self, action_id: str) -> Committed | None:
        """The action's recorded key and outputs (None: not built), decoded or not."""
        value = self._items.get(action_id)
        if value is None:
            return None
        if type(value) is tuple:
            return value[0], value[1]
        rec: ActionRecord = value  # type: ignore[assignment]
        return rec.key, {p: (o.size, o.digest) for p, o in rec.outputs.items()}

    def copy(self, raw: bytes) -> Records:
        """A copy reading undecoded records from ``raw`` (the journal's bytes: the same ones,
        or ones that begin with them)."""
        new = Records(raw)
        new._items = dict(self._items)
        return new


@dataclass
class State:
    """What the journal says, after replay."""

    records: Records = field(default_factory=Records)
    interrupted: set[str] = field(default_factory=set)
    damaged: dict[str, Damage] = field(default_factory=dict)
    """Interrupted actions whose outputs a check found damaged (the reason they are stale)."""
    lines: int = 0
    warnings: list[str] = field(default_factory=list)
    replayed: bytes = field(default=b"", repr=False, compare=False)
    """The journal bytes this state replays (whole, undamaged): a reload that finds the file
    still starting with them replays only what was appended since."""


class _Damaged(ValueError):
    """A record that parses as JSON but does not have the shape epbuild writes."""


def _want(value: Any, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _Damaged(f"unexpected {type(value).__name__}")
    return value


def _record(data: dict[str, Any]) -> ActionRecord:
    return ActionRecord.from_json(data)


def _damage(data: dict[str, Any]) -> Damage:
    outputs = tuple(_want(p, str) for p in _want(data["damaged"], list))
    if not outputs:
        raise _Damaged("no damaged outputs")
    return Damage(outputs, _want(data.get("by", "a check"), str))


def _begin_dict(action_id: str, damage: Damage | None) -> dict[str, Any]:
    data: dict[str, Any] = {"op": "begin", "id": action_id, "key": ""}
    if damage is not None:
        data["damaged"] = list(damage.outputs)
        data["by"] = damage.by
    return data


SNAPSHOT_EVERY = 1000
"""A full replay of at least this many journal lines beyond the snapshot writes a new one."""
_SNAPSHOT_VERSION = 1


def load_state(path: str, previous: State | None = None) -> State:
    """Replay the journal; never raises for damaged content.

    ``previous``: an earlier load of the same path. When the file still begins with the
    bytes it replayed (the journal is append-only; compaction writes a new file), only the
    lines appended since are replayed on a copy of it — the same result as a full replay.
    Otherwise the snapshot beside the journal, when it still describes the journal's first
    bytes, stands in for replaying them (the same result too).
    """
    state = State()
    try:
        with open_read(path) as f:  # a link planted there: a warning, then compacted over
            raw = f.read()
    except FileNotFoundError:
        return state
    except OSError as exc:
        state.warnings.append(f"cannot read state {path}: {exc.strerror}; starting over")
        return state
    snapshot: tuple[int, int] | None = None
    if previous is not None and previous.replayed and raw.startswith(previous.replayed):
        done = previous.replayed
        state = State(
            previous.records.copy(raw),
            set(previous.interrupted),
            dict(previous.damaged),
            previous.lines,
        )
        offset, first = len(done), done.count(b"\n") + 1
    else:
        if not raw.startswith(_HEADER_LINE):
            if raw.strip():
                state.warnings.append(f"state {path} has an unknown header; starting over")
            return state
        state.records = Records(raw)
        offset, first = len(_HEADER_LINE), 2
        found = _read_snapshot(path + SNAPSHOT_SUFFIX, raw, state)
        if found is not None:
            offset, first = found
        snapshot = (offset, first)
    spans: dict[str, tuple[int, int]] = {}
    number = _replay(state, raw, offset, first, spans, path)
    if not state.warnings and raw.endswith(b"\n"):
        state.replayed = raw
        if snapshot is not None and number - snapshot[1] >= SNAPSHOT_EVERY:
            _write_snapshot(path + SNAPSHOT_SUFFIX, raw, state, spans, number)
    return state


def _replay(
    state: State, raw: bytes, start: int, number: int, spans: dict[str, tuple[int, int]], path: str
) -> int:
    """Replay the lines of ``raw`` from byte ``start`` (line ``number``) onto ``state``,
    noting where each ``done`` line is in ``spans``; stops at the first damaged one (a
    warning). Returns the number the line after the last would have."""
    while start < len(raw):
        end = raw.find(b"\n", start)
        if end < 0:
            end = len(raw)
        if end > start:
            try:
                data = _want(_loads(raw[start:end]), dict)
                _apply(state, data)
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                rest = sum(1 for x in raw[start:].split(b"\n") if x)
                state.warnings.append(
                    f"state {path}: dropped {rest} damaged record(s) from line {number} on"
                )
                break
            if data["op"] == "done":
                spans[data["id"]] = (start, end)
            state.lines += 1
        start = end + 1
        number += 1
    return number


def _read_snapshot(path: str, raw: bytes, state: State) -> tuple[int, int] | None:
    """Load the snapshot at ``path`` into ``state`` if it describes the first bytes of
    ``raw``; returns where replay goes on (byte offset, line number), None if it does not."""
    try:
        with open(path, "rb") as f:
            head, _, body = f.read().partition(b"\n")
        header = json.loads(head)
        if not isinstance(header, dict) or header.get("version") != _SNAPSHOT_VERSION:
            return None
        size, line = header["size"], header["line"]
        if type(size) is not int or type(line) is not int or not 0 < size <= len(raw):
            return None
        if raw[size - 1 : size] != b"\n" or header.get("body") != _sha256(body):
            return None
        if header.get("journal") != _sha256(memoryview(raw)[:size]):
            return None
        data = json.loads(body)
        records = _want(data["records"], dict)
        interrupted = {_want(i, str) for i in _want(data["interrupted"], list)}
        damaged = {_want(i, str): _damage(d) for i, d in _want(data["damaged"], dict).items()}
        lines = _want(data["lines"], int)
        items: dict[str, Any] = {}
        for action_id, (key, outputs, start, end) in records.items():
            if type(key) is not str or type(outputs) is not dict or not 0 < start < end <= size:
                return None
            items[action_id] = (key, outputs, start, end)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    state.records._items = items
    state.interrupted, state.damaged, state.lines = interrupted, damaged, lines
    return size, line


def _write_snapshot(
    path: str, raw: bytes, state: State, spans: dict[str, tuple[int, int]], line: int
) -> None:
    """Write the snapshot of ``state`` (all of ``raw`` replayed); best effort: a state
    directory that cannot be written to is read in full next time."""
    records: dict[str, list[Any]] = {}
    for action_id, value in state.records._items.items():
        if type(value) is tuple:
            records[action_id] = list(value)
        else:
            rec: ActionRecord = value  # type: ignore[assignment]
            outputs = {p: [o.size, o.digest] for p, o in rec.outputs.items()}
            records[action_id] = [rec.key, outputs, *spans[action_id]]
    damaged = {i: {"damaged": list(d.outputs), "by": d.by} for i, d in state.damaged.items()}
    body = json.dumps(
        {
            "records": records,
            "interrupted": sorted(state.interrupted),
            "damaged": damaged,
            "lines": state.lines,
        },
        separators=(",", ":"),
    ).encode()
    header = {
        "version": _SNAPSHOT_VERSION,
        "size": len(raw),
        "line": line,
        "journal": _sha256(raw),
        "body": _sha256(body),
    }
    try:
        atomic_write_bytes(path, json.dumps(header).encode() + b"\n" + body, durable=False)
    except OSError:
        pass


def _sha256(data: bytes | memoryview) -> str:
    return sha256_hex(data)


_scan_once = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # (json's own use)


def _loads(line: bytes) -> Any:
    """``json.loads(line)``, without its per-call overhead for a line that is one UTF-8 JSON
    value with nothing around it (every line epbuild writes); anything else goes to
    ``json.loads``, which accepts or refuses it as before."""
    try:
        text = line.decode()
        value, end = _scan_once(text, 0)
    except (UnicodeDecodeError, StopIteration):
        return json.loads(line)
    if end != len(text):
        return json.loads(line)
    return value


def _apply(state: State, data: dict[str, Any]) -> None:
    """Replay one journal record onto ``state`` (raises on a damaged one)."""
    op = data["op"]
    if op == "begin":
        action_id = _want(data["id"], str)
        state.interrupted.add(action_id)
        if "damaged" in data:
            state.damaged[action_id] = _damage(data)
    elif op == "done":
        rec = _record(data)
        state.records[rec.id] = rec
        state.interrupted.discard(rec.id)
        state.damaged.pop(rec.id, None)
    elif op == "forget":
        state.records.discard(_want(data["id"], str))
        state.interrupted.discard(data["id"])
        state.damaged.pop(data["id"], None)
    else:
        raise _Damaged(f"unknown op {op!r}")


_line = encode_line


def done_line(rec: ActionRecord) -> dict[str, Any]:
    """A ``done`` line of the journal: the record's JSON under ``op: done``."""
    return {"op": "done", **rec.to_json()}


class Journal:
    """Appends records to the state file (callers hold the state lock)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _append(self, data: dict[str, Any], *, sync: bool = True) -> None:
        journalfile.append(self.path, data, sync=sync)

    def begin(self, action_id: str, key: str) -> None:
        """Mark an action's outputs as being replaced.

        Not fsynced. A process crash cannot lose a completed ``write`` (the page cache
        survives it), so only an OS crash or power loss can drop it — together with every
        later unsynced record, and the outputs' renames and bytes are not synced either.
        Losing it is then safe: the journal still ends with the action's previous ``done``
        (or nothing), and the planner trusts that record only if its key still matches and
        every output it lists still has its recorded size and digest (``outputs_intact``,
        which re-hashes any file whose stat changed). A begun action was stale (new key, or
        outputs missing or damaged), and a replacement only half on disk leaves it so: a
        replaced file has other bytes or its old key is wrong. Any ``done`` that is fsynced
        flushes the ``begin`` before it, so a durable ``done`` is never missing its begin.
        """
        self._append(journalfile.begin_line(action_id, key), sync=False)

    def done(self, rec: ActionRecord, *, sync: bool = True) -> None:
        """Record a completed action (``sync=False``: durable only at the next ``sync``; for
        restores, where a lost record just means restoring again)."""
        self._append(done_line(rec), sync=sync)

    def sync(self) -> None:
        """Make every appended record durable (one fsync for a batch of restores)."""
        journalfile.sync(self.path)

    def damaged(self, action_id: str, damage: Damage) -> None:
        """Record that a check found a committed action's outputs damaged: the action is then
        stale (as if interrupted: an older epbuild reading this journal agrees) until it is
        built again, whatever the stat cache says of the damaged files."""
        self._append({**_begin_dict(action_id, damage), "pid": os.getpid()})

    def forget(self, action_id: str) -> None:
        """Drop an action's record (its outputs were removed)."""
        self._append({"op": "forget", "id": action_id})

    def compact_if_needed(self, state: State) -> None:
        """Rewrite the journal with only live records when it has grown too long."""
        live = len(state.records) + len(state.interrupted)
        if state.lines <= 2 * live + 200 and not state.warnings:
            return
        out = [_HEADER_LINE]
        for rec in state.records.values():
            out.append(_line(done_line(rec)))
        for action_id in sorted(state.interrupted):
            out.append(_line(_begin_dict(action_id, state.damaged.get(action_id))))
        atomic_write_bytes(self.path, b"".join(out))
