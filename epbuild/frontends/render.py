"""Text forms of the API's results, shared by ``build``, its no-op fast path, ``status`` and
``watch``. Imported on the fast path: standard library only, results typed lazily."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epbuild.results import StatusResult

_NOT_COUNTS = ("total", "seconds")


def summary_line(summary: Mapping[str, Any]) -> str:
    """``epbuild: 2 compiled, 1 up to date in 0.04s`` from a build's JSON ``summary``.

    Takes the JSON form because the no-op fast path has only the recorded document; the
    counts come in ``Outcome`` order, as ``BuildResult.summary`` writes them.
    """
    counts = [(n, key) for key, n in summary.items() if key not in _NOT_COUNTS and n]
    parts = [f"{n} {key.replace('_', ' ')}" for n, key in counts]
    return f"epbuild: {', '.join(parts) or 'nothing to do'} in {summary['seconds']:.2f}s"


def status_lines(result: StatusResult) -> Iterator[str]:
    """``epbuild status``: each action up to date or stale (with reasons), then orphans."""
    for a in result.actions:
        if a.stale:
            yield f"stale       {a.id}"
            yield from (f"              - {r}" for r in a.reasons)
        else:
            yield f"up to date  {a.id}"
    for action_id in result.orphaned:
        yield f"orphaned    {action_id}"
        yield "              - no longer in the manifest; 'epbuild clean' removes its outputs"
    for note in result.lock:
        yield f"lock        {note} (epbuild lock writes it again)"


def print_json(data: Any) -> None:
    """One indented JSON document on stdout (the ``--json`` form of a command)."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
