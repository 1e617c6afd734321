"""A running job's progress, read from the file it writes in its staging directory
(``_names.PROGRESS_NAME``) while the building process waits for it, and handed to the
reporter whenever it changes. Any kind's job may write one; none has to."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

INTERVAL = 0.5
"""Seconds between looks at the file."""


@contextmanager
def watching(path: str, said: Callable[[str], None]) -> Iterator[None]:
    """While the body runs, call ``said(text)`` each time the file at ``path`` holds new
    text (a thread that stops when the body ends)."""
    stop = threading.Event()

    def watch() -> None:
        last = ""
        while not stop.wait(INTERVAL):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read().strip()
            except (OSError, ValueError):
                continue
            if text and text != last:
                last = text
                said(text)

    thread = threading.Thread(target=watch, name="epbuild-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
