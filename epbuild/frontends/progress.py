"""Rendering build progress: one updating status line on a terminal, plain lines otherwise."""

from __future__ import annotations

import os
import sys
import threading
from typing import TextIO

from epbuild.frontends.render import terminal_columns
from epbuild.kinds.contract import kind_named
from epbuild.results import ActionResult, Outcome, Reporter

_MARK = {
    Outcome.RESTORED: "restored",
    Outcome.UP_TO_DATE: "up to date",
    Outcome.FAILED: "FAILED",
    Outcome.SKIPPED: "skipped",
    Outcome.WOULD_BUILD: "would build",
}


class ConsoleReporter(Reporter):
    """Writes progress to a stream (stderr by default)."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() and os.environ.get("TERM") != "dumb"
        """Whether progress is one updating status line (a terminal that reads ANSI
        escapes: not ``TERM=dumb``, an editor's shell), else plain lines."""
        self.quiet = quiet
        self.total = 0
        self.done = 0
        self.running: list[str] = []
        self.progress: dict[str, str] = {}
        """A running action's last progress sentence (terminal status line)."""
        self.quarters: dict[str, int] = {}
        """How many quarters of its way each action's progress lines have said."""
        self._lock = threading.Lock()

    def _line(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + "\n")
            self._status()
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _status(self) -> None:
        if not self.tty or not self.running:
            if self.tty:
                self.stream.write("\r\x1b[K")
            return
        width = terminal_columns(100)
        names = [self.progress.get(a, a) for a in self.running]
        text = f"[{self.done}/{self.total}] compiling {', '.join(names)}"
        self.stream.write("\r\x1b[K" + text[: width - 1])
        self.stream.flush()

    def start(self, total: int, stale: int) -> None:
        self.total = stale
        if not self.quiet:
            self._line(f"epbuild: {stale} of {total} action(s) to build")

    def action_started(self, action_id: str) -> None:
        with self._lock:
            self.running.append(action_id)
            self._status()

    def action_finished(self, result: ActionResult) -> None:
        with self._lock:
            if result.id in self.running:
                self.running.remove(result.id)
            self.progress.pop(result.id, None)
            self.done += 1
            if result.outcome is Outcome.FAILED or not self.quiet:
                ran = result.outcome is Outcome.RAN
                extra = f" ({result.seconds:.1f}s)" if ran else ""
                mark = kind_named(result.kind).words.past if ran else _MARK[result.outcome]
                self._line(f"[{self.done}/{self.total}] {mark} {result.id}{extra}")
            if result.outcome is Outcome.FAILED:
                self._line(f"  error: {result.error}")
                if result.hint:
                    self._line(f"  hint: {result.hint}")
                for line in result.log_tail:
                    self._line(f"  | {line}")
            self._status()

    def action_progress(self, action_id: str, text: str) -> None:
        """On a terminal, the status line; otherwise a line at each quarter of the way."""
        with self._lock:
            if self.tty:
                self.progress[action_id] = text
                self._status()
                return
            done, _, rest = text.rpartition(": ")[2].partition("/")
            total = rest.split(" ")[0]
            if done.isdigit() and total.isdigit() and int(total):
                quarter = 4 * int(done) // int(total)
                if quarter > self.quarters.get(action_id, 0) and not self.quiet:
                    self.quarters[action_id] = quarter
                    self._line(text)

    def message(self, text: str) -> None:
        with self._lock:
            self._line(f"epbuild: {text}")
