"""The state journal: an append-only, versioned record of completed actions.

Each line is one JSON record. A ``begin`` record is appended before an action's outputs are
touched and a ``done`` record after they are all in place (Snakemake's incomplete marker):
an action whose last record is ``begin`` was interrupted and is stale. A damaged tail (a
crash mid-append) is dropped on load; a damaged header starts over. When the journal grows
well past its live records it is compacted by writing a new file and renaming it over the
old one (Ninja's build log).
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import time
from dataclasses import dataclass, field, replace
from json.scanner import make_scanner
from typing import Any

from epbuild.fs import atomic_write_bytes, is_safe_reference

HEADER = {"epbuild_state": 1}
_HEADER_LINE = json.dumps(HEADER, separators=(",", ":")).encode() + b"\n"


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


@dataclass
class State:
    """What the journal says, after replay."""

    records: dict[str, ActionRecord] = field(default_factory=dict)
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


def load_state(path: str, previous: State | None = None) -> State:
    """Replay the journal; never raises for damaged content.

    ``previous``: an earlier load of the same path. When the file still begins with the
    bytes it replayed (the journal is append-only; compaction writes a new file), only the
    lines appended since are replayed on a copy of it — the same result as a full replay.
    """
    state = State()
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return state
    except OSError as exc:
        state.warnings.append(f"cannot read state {path}: {exc.strerror}; starting over")
        return state
    if previous is not None and previous.replayed and raw.startswith(previous.replayed):
        done = previous.replayed
        state = State(
            dict(previous.records),
            set(previous.interrupted),
            dict(previous.damaged),
            previous.lines,
        )
        lines = raw[len(done) :].split(b"\n")
        first = done.count(b"\n") + 1
    else:
        if not raw.startswith(_HEADER_LINE):
            if raw.strip():
                state.warnings.append(f"state {path} has an unknown header; starting over")
            return state
        lines = raw.split(b"\n")[1:]
        first = 2
    for number, line in enumerate(lines, first):
        if not line:
            continue
        try:
            _apply(state, _want(_loads(line), dict))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            rest = sum(1 for x in lines[number - first :] if x)
            state.warnings.append(
                f"state {path}: dropped {rest} damaged record(s) from line {number} on"
            )
            break
        state.lines += 1
    if not state.warnings and raw.endswith(b"\n"):
        state.replayed = raw
    return state


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
        state.records.pop(_want(data["id"], str), None)
        state.interrupted.discard(data["id"])
        state.damaged.pop(data["id"], None)
    else:
        raise _Damaged(f"unknown op {op!r}")


def _line(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def _done_dict(rec: ActionRecord) -> dict[str, Any]:
    return {"op": "done", **rec.to_json()}


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``; a short write (the file-size limit reached) raises EFBIG."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        view = view[written:]


class Journal:
    """Appends records to the state file (callers hold the state lock)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _append(self, data: dict[str, Any], *, sync: bool = True) -> None:
        line = _line(data)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                line = _HEADER_LINE + line
            else:
                # A crash mid-append leaves a line without its newline: end it first so
                # this record does not merge into the damaged one.
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = b"\n" + line
            try:
                _write_all(fd, line)
            except OSError as exc:
                # A full disk or a file-size limit cut the record short: take it back, so
                # the journal keeps ending with a whole line and later records still load.
                os.ftruncate(fd, size)
                raise OSError(exc.errno, exc.strerror, self.path) from exc
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

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
        self._append({"op": "begin", "id": action_id, "key": key, "pid": os.getpid()}, sync=False)

    def done(self, rec: ActionRecord, *, sync: bool = True) -> None:
        """Record a completed action (``sync=False``: durable only at the next ``sync``; for
        restores, where a lost record just means restoring again)."""
        self._append(_done_dict(rec), sync=sync)

    def sync(self) -> None:
        """Make every appended record durable (one fsync for a batch of restores)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

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
            out.append(_line(_done_dict(rec)))
        for action_id in sorted(state.interrupted):
            out.append(_line(_begin_dict(action_id, state.damaged.get(action_id))))
        atomic_write_bytes(self.path, b"".join(out))
