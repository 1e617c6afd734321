"""Text forms of the API's results, shared by ``build``, its no-op fast path, ``status`` and
``watch``. Imported on the fast path: the standard library and ``_names`` only, results
typed lazily."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from epbuild._names import is_left

if TYPE_CHECKING:
    from epbuild.inspection.verify import VerifyResult
    from epbuild.results import BuildResult, StatusResult
    from epbuild.shipping.package import PackageResult
    from epbuild.watching import Cycle

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
        if is_left(action_id):
            yield "              - outputs the manifest now puts elsewhere ([workspace] changed)"
        else:
            yield "              - no longer in the manifest; 'epbuild clean' removes its outputs"
    if result.orphaned_bytes:
        from epbuild.fs import format_bytes

        yield (
            f"orphaned    {format_bytes(result.orphaned_bytes)} of outputs no action of the "
            "manifest owns; 'epbuild clean --orphaned' removes them and nothing else"
        )
    for note in result.lock:
        yield f"lock        {note} (epbuild lock writes it again)"


def graph_text(result: StatusResult, fmt: str) -> str:
    """The build graph of ``status --graph``: each action a node (its id, kind and state),
    an edge from each action to every action that reads its outputs; ``fmt`` is
    ``mermaid`` or ``dot``."""
    ids = {a.id: f"a{i}" for i, a in enumerate(result.actions)}
    mermaid = fmt == "mermaid"
    lines = ["flowchart LR"] if mermaid else ["digraph epbuild {", "  rankdir=LR;"]
    for a in result.actions:
        state = "stale" if a.stale else "up to date"
        parts = (a.id, f"{a.kind}, {state}")
        if mermaid:
            lines.append(f'  {ids[a.id]}["{"<br/>".join(_mermaid_text(p) for p in parts)}"]')
        else:
            style = ', style=filled, fillcolor="#fde2e1"' if a.stale else ""
            label = "\\n".join(_dot_text(p) for p in parts)
            lines.append(f'  {ids[a.id]} [label="{label}", shape=box{style}];')
    for a in result.actions:
        for dep in a.deps:
            if dep in ids:
                lines.append(
                    f"  {ids[dep]} --> {ids[a.id]}" if mermaid else f"  {ids[dep]} -> {ids[a.id]};"
                )
    if mermaid:
        stale = [ids[a.id] for a in result.actions if a.stale]
        if stale:
            lines += ["  classDef stale fill:#fde2e1", f"  class {','.join(stale)} stale"]
    else:
        lines.append("}")
    return "\n".join(lines)


def _dot_text(text: str) -> str:
    """``text`` as itself inside a double-quoted DOT label: a backslash doubled (DOT reads
    ``\\n``, ``\\l``, ``\\N`` … as escapes, and a lone one before the closing quote as
    an escaped quote), a quote escaped, a line break written as one."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_MERMAID = {'"': "#quot;", "#": "#35;", "<": "#lt;", ">": "#gt;", "&": "#amp;", "`": "#96;"}
"""What a Mermaid label writes as an entity code: its quote, the code's own ``#``, what
its HTML labels would read as markup, and the backtick of its markdown strings."""


def _mermaid_text(text: str) -> str:
    """``text`` as itself inside a double-quoted Mermaid label (``_MERMAID``; a character
    a terminal would not show as its decimal code)."""
    return "".join(_MERMAID.get(c) or (c if c.isprintable() else f"#{ord(c)};") for c in text)


def build_lines(result: BuildResult) -> Iterator[str]:
    """``epbuild build``: what a dry run would build (with reasons), then the summary."""
    for a in result.actions:
        if a.outcome.value == "would_build":
            yield f"would build {a.id}: {'; '.join(a.reasons)}"
    yield summary_line(result.to_json()["summary"])


def verify_lines(result: VerifyResult, *, load: bool) -> Iterator[str]:
    """``epbuild verify``: problems, what could not be checked here, the checks that
    passed, then one summary line."""
    problems = result.lines()
    yield from problems
    for c in result.loads:
        if c.outcome.value == "not_loadable_here":
            yield f"{c.file}: not loadable here: {c.message}"
    for n in result.numerics:
        if n.status.value != "failed":
            yield n.line()
    for g in result.generations or ():
        if g.status.value != "failed":
            yield g.line()
    passed = sum(1 for c in result.loads if c.outcome.value == "passed")
    loads = f", {passed} loaded and matched the CPU EP" if load else ""
    warned = sum(1 for line in problems if line.startswith("warning: "))
    also = f", {warned} warning(s)" if warned else ""
    yield (
        f"epbuild: verified {len(result.checked)} model(s){loads}: "
        f"{len(problems) - warned} problem(s){also}"
    )


def package_lines(result: PackageResult) -> Iterator[str]:
    """``epbuild package``: what was deleted, written or kept, and the EP names apps
    register to select the variants."""
    s, files = result.stats, len(result.deployment["files"])
    if s.removed:
        yield f"epbuild: --force: deleted {', '.join(s.removed)} from {result.path}"
    what = f"{len(result.components)} component(s), {files} file(s)"
    if s.unchanged:
        yield f"epbuild: {result.path} is up to date ({what})"
    else:
        how = f"{len(s.linked)} linked from the outputs, {len(s.kept)} kept, "
        yield f"epbuild: packaged {what} into {result.path} ({how}{len(s.copied)} copied)"
    names = ", ".join(f"{n} ({p})" for p, n in result.deployment.get("ep_names", {}).items())
    yield (
        f"epbuild: apps select its variants by registering the execution provider as {names} "
        "([package] ep_names sets another name)"
    )


def watch_started(as_json: bool, c: Cycle) -> None:
    """``epbuild watch``: a cycle begins (what changed)."""
    if not as_json:
        what = "initial build" if c.number == 1 else ", ".join(c.changed) + " changed"
        print(f"epbuild watch: {what}", flush=True)
        _stop_unread()


def stdout_reader_gone() -> bool:
    """Whether the reader of the program's stdout went away (``epbuild watch | head``):
    the command line's stdout stream (``cli._Output``) drops the rest and says so."""
    buffer = getattr(sys.stdout, "buffer", None)
    raw = getattr(buffer, "raw", buffer)  # no buffer between them where stdout is unbuffered
    return bool(getattr(raw, "reader_gone", False))


def _stop_unread() -> None:
    """``watch`` ends as on Ctrl-C (exit 0) once nobody reads what it prints."""
    if stdout_reader_gone():
        raise KeyboardInterrupt


def watch_finished(as_json: bool, c: Cycle) -> None:
    """``epbuild watch``: a cycle ended (one JSON line, or its errors and summary)."""
    if as_json:
        print_json_line(c.to_json(), command="watch", ok=c.ok)
        _stop_unread()
        return
    for err in (c.manifest_error, c.error):
        if err:
            print(f"epbuild: error: {err}", file=sys.stderr)
    if c.manifest_error:
        print("epbuild watch: keeping the last good manifest", file=sys.stderr, flush=True)
    if c.result is not None:
        print(summary_line(c.result.summary()), flush=True)
    if c.again:
        again = ", ".join(c.again)
        print(f"epbuild watch: {again} changed while the build read it: building again", flush=True)
    _stop_unread()


def watch_message(text: str) -> None:
    """``epbuild watch``: a note (a directory it cannot watch, a stop)."""
    print(f"epbuild watch: {text}", file=sys.stderr, flush=True)


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
    sys.stdout.write(dumps_indented(envelope(command, _with_notes(data), ok=ok)) + "\n")
    _printed[0] += 1


class _Unusual(Exception):
    """A value ``dumps_indented`` leaves to ``json.dumps``."""


def dumps_indented(doc: Any) -> str:
    """``json.dumps(doc, indent=2)``, the same text, about twice as fast on a large document
    (``status --json`` of 5,000 actions): Python's C encoder does not indent, and its
    Python one is slow. Anything but dicts with string keys, lists, tuples, strings, ints,
    finite floats, booleans and None goes to ``json.dumps`` as before."""
    parts: list[str] = []
    try:
        _indent(doc, "\n", parts.append)
    except (_Unusual, RecursionError):
        return json.dumps(doc, indent=2)
    return "".join(parts)


_str = json.encoder.encode_basestring_ascii
_int = int.__repr__
_float = float.__repr__
_INF = float("inf")


def _indent(o: Any, at: str, put: Callable[[str], None]) -> None:
    if type(o) is str:
        put(_str(o))
    elif o is None:
        put("null")
    elif o is True:
        put("true")
    elif o is False:
        put("false")
    elif type(o) is int:
        put(_int(o))
    elif type(o) is float:
        if o != o or o in (_INF, -_INF):
            raise _Unusual
        put(_float(o))
    elif type(o) is dict:
        if not o:
            put("{}")
            return
        inner = at + "  "
        sep = "{" + inner
        for k, v in o.items():
            if type(k) is not str:
                raise _Unusual
            put(sep)
            put(_str(k))
            put(": ")
            _indent(v, inner, put)
            sep = "," + inner
        put(at + "}")
    elif type(o) is list or type(o) is tuple:
        if not o:
            put("[]")
            return
        inner = at + "  "
        sep = "[" + inner
        for v in o:
            put(sep)
            _indent(v, inner, put)
            sep = "," + inner
        put(at + "]")
    else:
        raise _Unusual


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


def terminal_columns(fallback: int = 80) -> int:
    """``shutil.get_terminal_size((fallback, _)).columns`` without importing ``shutil``:
    ``$COLUMNS``, else stdout's terminal, else ``fallback``."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or fallback
