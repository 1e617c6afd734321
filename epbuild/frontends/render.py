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


SCHEMA_VERSION = 1
"""The version of the ``--json`` documents' shared frame (``envelope``)."""


def envelope(command: str, data: Mapping[str, Any], *, ok: bool = True) -> dict[str, Any]:
    """Every ``--json`` document: ``command``, ``schema_version``, ``ok`` and ``warnings``
    (structured problems: ``{"severity", "message"}``), then the command's own keys."""
    warnings = [
        w if isinstance(w, Mapping) else {"severity": "warning", "message": str(w)}
        for w in data.get("warnings", ())
    ]
    return {
        "command": command,
        "schema_version": SCHEMA_VERSION,
        "ok": ok,
        **{k: v for k, v in data.items() if k not in ("command", "schema_version", "ok")},
        "warnings": warnings,
    }


_printed = [0]
"""How many ``--json`` documents this process printed (``documents_printed``)."""
_notes: list[str] = []
"""Warnings about the command line itself (a deprecated spelling), for every document."""


def command_notes(notes: list[str]) -> None:
    """Warnings about how the command was written (a deprecated option): they join the
    ``warnings`` of each ``--json`` document this command prints."""
    _notes[:] = notes


def _with_notes(data: Mapping[str, Any]) -> Mapping[str, Any]:
    if not _notes:
        return data
    return {**data, "warnings": [*data.get("warnings", ()), *_notes]}


def documents_printed() -> int:
    """How many ``--json`` documents went to stdout so far: the CLI adds an error document
    only to a command that printed none (stdout carries one document, never two)."""
    return _printed[0]


def print_json(data: Mapping[str, Any], *, command: str, ok: bool = True) -> None:
    """One indented JSON document on stdout (the ``--json`` form of a command), in the
    shared envelope."""
    sys.stdout.write(json.dumps(envelope(command, _with_notes(data), ok=ok), indent=2) + "\n")
    _printed[0] += 1


def print_json_line(data: Mapping[str, Any], *, command: str, ok: bool = True) -> None:
    """One JSON document on one line of stdout, flushed (a stream of documents: ``watch``)."""
    sys.stdout.write(json.dumps(envelope(command, _with_notes(data), ok=ok)) + "\n")
    sys.stdout.flush()
    _printed[0] += 1


def print_error_json(command: str, error: Mapping[str, Any]) -> None:
    """The ``--json`` document of a command that failed before printing its own: the
    envelope with ``ok: false`` and ``error`` (``class``, ``kind``, ``message``, ``hint``,
    ``exit_code``; ``file``, ``line``, ``key`` where known). One line for ``watch``, whose
    documents are a stream of lines."""
    show = print_json_line if command == "watch" else print_json
    show({"error": dict(error)}, command=command, ok=False)
