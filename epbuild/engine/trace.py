"""The build timeline: spans recorded by the builder, written as Chrome trace-event JSON.

The file opens in Perfetto and chrome://tracing. Lane (``tid``) 0 is the coordinator
(planning); lanes 1..N are the worker slots. Each span is a complete event (``ph: "X"``)
labelled with what it was (hashing, waiting on a lock, compiling, verifying, committing,
restoring) and carries the action id in ``args``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from epbuild.fs import atomic_write_bytes

"""The last build's trace, kept in the state directory for ``epbuild report``."""

KINDS = ("plan", "hash", "lock", "compile", "verify", "commit", "restore")
"""Span categories; the HTML report colours by these."""


class Tracer:
    """Collects spans from the coordinator and the worker-slot threads (thread-safe)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self.wall_start = time.time()
        self._events: list[dict[str, Any]] = []
        self._lanes: dict[int, int] = {threading.get_ident(): 0}
        self._slot_lane: int | None = None
        """The lane of the actions run in the coordinator's thread (``slot``)."""
        self._in_slot: set[int] = set()
        """The threads recording in that lane now."""
        self._lock = threading.Lock()

    def now(self) -> float:
        """Seconds since the trace began."""
        return time.perf_counter() - self._t0

    def _lane(self) -> int:
        ident = threading.get_ident()
        if ident in self._in_slot and self._slot_lane is not None:
            return self._slot_lane
        lane = self._lanes.get(ident)
        if lane is None:
            lane = self._lanes[ident] = len(self._lanes)
        return lane

    def add(self, kind: str, start: float, action_id: str | None = None, **args: Any) -> None:
        """Record a span from ``start`` (a ``now()`` value) until now."""
        end = self.now()
        with self._lock:
            event: dict[str, Any] = {
                "name": f"{kind} {action_id}" if action_id else kind,
                "cat": kind,
                "ph": "X",
                "ts": round(start * 1e6, 1),
                "dur": round(max(0.0, end - start) * 1e6, 1),
                "pid": 1,
                "tid": self._lane(),
                "args": {"action": action_id, **args} if action_id else dict(args),
            }
            self._events.append(event)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Record this thread's spans in the block in a slot's lane: an action the scheduler
        runs in the coordinator's own thread (``schedule``'s one restore) is in the lane of
        the slot it stands for, as one run by a slot thread is."""
        ident = threading.get_ident()
        with self._lock:
            if self._slot_lane is None:
                self._slot_lane = len(self._lanes)
            self._in_slot.add(ident)
        try:
            yield
        finally:
            with self._lock:
                self._in_slot.discard(ident)

    @contextmanager
    def span(self, kind: str, action_id: str | None = None, **args: Any) -> Iterator[None]:
        """Record the enclosed block as a span."""
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, start, action_id, **args)

    def events(self) -> list[dict[str, Any]]:
        """The trace events, with lane-name metadata first."""
        with self._lock:
            lanes = sorted({*self._lanes.values(), *_present(self._slot_lane)})
            meta = [_metadata("process_name", 0, "epbuild build")]
            for lane in lanes:
                name = "coordinator" if lane == 0 else f"slot {lane}"
                meta.append(_metadata("thread_name", lane, name))
            return meta + sorted(self._events, key=lambda e: (e["ts"], e["tid"]))

    def document(self) -> dict[str, Any]:
        """The whole trace-event JSON object."""
        return {
            "traceEvents": self.events(),
            "displayTimeUnit": "ms",
            "otherData": {"tool": "epbuild", "started": self.wall_start},
        }

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the trace (temp file + rename; not synced: a power cut may lose a timeline,
        never leave half of one)."""
        data = json.dumps(self.document(), separators=(",", ":")).encode()
        atomic_write_bytes(os.fspath(path), data, durable=False)


def load_trace(path: str) -> dict[str, Any] | None:
    """A trace written by ``Tracer.write``; None when absent or unreadable."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        return None
    return data


def _present(lane: int | None) -> tuple[int, ...]:
    return () if lane is None else (lane,)


def _metadata(kind: str, tid: int, name: str) -> dict[str, Any]:
    """A trace-event metadata record that names the process or a lane."""
    return {"name": kind, "ph": "M", "pid": 1, "tid": tid, "ts": 0, "args": {"name": name}}
