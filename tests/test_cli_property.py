"""Every command on generated hostile manifests and arguments: one clear outcome, never a
traceback or a hang.

Manifests come in every form TOML allows (header tables, inline tables, dotted keys, tables
spread over the file, ``[[groups.NAME.models]]``), in several encodings and line endings,
with a byte-order mark, duplicate keys, deep nesting and wrongly typed values. Each runs
through every command (``main()`` in-process, plus a few real subprocesses), which must
exit 0, 1 or 2, print no ``Traceback`` and no internal error, leave the manifest
byte-identical when an edit is refused, and finish within a bound. Under ``--json`` (every
hostile argument, and a drawn share of the commands on each manifest) stdout is exactly one
JSON document in the shared envelope -- the command's own, or the error document of a
failure (``ok: false``, ``error`` with the exit code) -- whatever went wrong. ``gc.collect()`` after
each command turns a file left open into a ``ResourceWarning`` error (pytest runs with
``filterwarnings = error``).

CI runs a few deterministic examples; a longer hunt: ``EPBUILD_PROPERTY_EXAMPLES=150
EPBUILD_PROPERTY_RANDOM=1 pytest tests/test_cli_property.py -s`` (150 manifests x 25
commands took 8.7 min on 2 cores).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import toml_key as _key
from conftest import toml_value, value_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelgen import matmul_model, save

from epbuild.frontends import cli, render

COMMAND_SECONDS = 60.0
"""The bound on one command (a real compile of a tiny model takes about a second)."""

# ---------------------------------------------------------------------------------------
# Manifests

BASE: dict[str, Any] = {
    "workspace": {"out_dir": "build"},
    "providers": {"htp": {"ep": "qnn", "options": {"htp_arch": "73", "soc_model": "60"}}},
    "groups": {
        "main": {"models": ["models/a.onnx"], "providers": ["htp"]},
        "more": {"models": ["models/b*.onnx"], "providers": ["htp"]},
    },
}

_odd_values = st.sampled_from(
    [
        5, -1, 0, 2**63 - 1, 99999999999, 1.5, float("inf"), float("nan"), True, "", "x",
        "../../etc", "/abs", "models", "build", ".epbuild", "\u202e", "ü" * 3, [], [1], [[]],
        {}, {"x": 1}, [{}], {"batch": 99999999999}, {"batch": 0}, "tcp://x", "http://x:1",
        "models/br[1].onnx", "s3://no-bucket/p",
    ]
)  # fmt: skip
_keys = st.sampled_from(
    [
        "models", "providers", "ep", "options", "share_weights", "embed_mode", "free_dimensions",
        "out_dir", "state_dir", "cache", "scheduler", "executor", "jobs", "memory_budget",
        "toolchain", "load", "name", "path", "x", "",
    ]
)  # fmt: skip


@st.composite
def _data(draw: st.DrawFn) -> dict[str, Any]:
    """BASE with up to three values replaced, removed or added."""
    import copy

    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from([p for p in value_paths(data) if p]))
        parent: Any = data
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "delete", "add"]))
        value = copy.deepcopy(draw(_odd_values))  # sampled values are shared objects
        if op == "delete":
            del parent[path[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(_keys)] = value
        else:
            parent[path[-1]] = value
    return data


def _value(v: Any) -> str:
    return toml_value(v, _key)  # inline tables with bare keys where TOML allows


def _render(data: dict[str, Any], form: str) -> str:
    """``data`` as TOML in one of the forms a person might write."""
    top: list[str] = []
    tables: list[str] = []
    for family, body in data.items():
        nested = isinstance(body, dict) and all(isinstance(v, dict) for v in body.values())
        if not isinstance(body, dict):
            top.append(f"{_key(family)} = {_value(body)}")
        elif form == "inline" or not nested:
            if form == "inline":
                top.append(f"{_key(family)} = {_value(body)}")
            else:
                tables.append(f"[{_key(family)}]\n" + _lines(body))
        elif form == "dotted":
            for name, table in body.items():
                for k, v in table.items():
                    top.append(f"{_key(family)}.{_key(name)}.{_key(k)} = {_value(v)}")
        else:
            for name, table in body.items():
                models = table.get("models") if isinstance(table, dict) else None
                if form == "aot" and isinstance(models, list) and all(
                    isinstance(m, str) for m in models
                ):  # fmt: skip
                    rest = {k: v for k, v in table.items() if k != "models"}
                    text = f"[{_key(family)}.{_key(name)}]\n" + _lines(rest)
                    for m in models:
                        text += f"\n[[{_key(family)}.{_key(name)}.models]]\npath = {_value(m)}\n"
                    tables.append(text)
                else:
                    tables.append(f"[{_key(family)}.{_key(name)}]\n" + _lines(table))
    if form == "spread":  # tables of one family apart
        tables = tables[::2] + tables[1::2]
    return "\n".join(top) + ("\n\n" if top else "") + "\n".join(tables)


def _lines(table: dict[str, Any]) -> str:
    return "".join(f"{_key(k)} = {_value(v)}\n" for k, v in table.items())


@st.composite
def manifests(draw: st.DrawFn) -> bytes:
    """Hostile manifest bytes: a mutated manifest in some form, then textual damage."""
    form = draw(st.sampled_from(["tables", "inline", "dotted", "aot", "spread"]))
    text = _render(draw(_data()), form)
    damage = draw(
        st.sampled_from(["none", "none", "duplicate", "nested", "truncate", "garbage", "swap"])
    )
    lines = text.split("\n")
    if damage == "duplicate":
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        lines.insert(i, lines[i])
    elif damage == "nested":
        lines.insert(0, "deep = " + "[" * 500 + "]" * 500)
    elif damage == "swap" and len(lines) > 1:
        i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    text = "\n".join(lines)
    if damage == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    if damage == "garbage":
        at = draw(st.integers(0, len(text)))
        text = (
            text[:at]
            + draw(st.sampled_from(["\x00", "[", "]]", '"', "=", "\\", "\u00e9"]))
            + text[at:]
        )
    ending = draw(st.sampled_from(["\n", "\n", "\r\n", "\r"]))
    text = text.replace("\n", ending)
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "latin-1", "utf-16"]))
    return text.encode(encoding, "replace")


# ---------------------------------------------------------------------------------------
# Commands

COMMANDS: list[list[str]] = [
    ["build", "-n"],
    ["build", "--cache-only", "--json"],
    ["build", "main", "-j", "1"],
    ["status"],
    ["status", "--json", "nope/nope"],
    ["status", "--detail"],
    ["verify", "--json"],
    ["report", "--html", "report.html"],
    ["package", "-o", "pkg", "--json"],
    ["clean", "more"],
    ["-f", "new.toml", "init", "--from", "models"],
    ["add", "model", "models/c.onnx", "--group", "main"],
    ["add", "model", "models/br[1].onnx", "--group", "fresh", "-p", "htp"],
    ["add", "model", "models/*.onnx"],
    ["add", "provider", "v75", "--ep", "qnn", "--option", "htp_arch=75"],
    ["add", "provider", "htp", "--ep", "qnn", "--replace", "--option", "soc_model=60"],
    ["add", "provider", "ov", "--ep", "openvino", "--python", "envs/none/bin/python"],
    ["add", "target", "snapdragon-8-gen-3", "--to", "main"],
    ["add", "target", "v79", "--ep", "qnn", "--option", "htp_arch=79"],
    ["cache", "key"],
    ["cache", "verify", "--cache", "localcache"],
    ["cache", "prune", "--max-size", "1G", "--cache", "localcache"],
    ["cache", "export", "out.tar", "--cache", "localcache"],
    ["toolchains", "--json"],
    ["lock", "--check", "--json"],
    ["watch", "--debounce", "0"],
]
"""Every command, with ordinary arguments (each manifest decides whether they make sense)."""

HOSTILE_ARGS: list[list[str]] = [
    ["build", "-j", "0"],
    ["build", "-j", "-3"],
    ["build", "--memory-budget", "lots"],
    ["build", "--lock-timeout", "nan"],
    ["build", "--executor", "dask", "--scheduler", "garbage"],
    ["build", "--executor", "dask", "--scheduler", "http://127.0.0.1:1"],
    ["build", "--cache", "", "--no-cache"],
    ["build", "--trace", "epbuild.toml/x"],
    ["status", "../../etc", "", "/"],
    ["status", "--cache", "epbuild.toml"],
    ["verify", "a/b/c/d"],
    ["package", "-o", "epbuild.toml/x"],
    ["package", "-o", "/"],
    ["package", "-o", ""],
    ["report", "--html", ""],
    ["report", "--html", "models"],
    ["clean", "../.."],
    ["init", "--from", "nowhere"],
    ["init", "--from", "../.."],
    ["-f", "new.toml", "init", "--from", "models", "--target", "nope"],
    ["add", "model"],
    ["add", "model", "/etc/passwd", "--group", "main"],
    ["add", "model", "models/../../x.onnx"],
    ["add", "model", "models/a.onnx", "--group", "bad name!"],
    ["add", "provider", "x", "--ep", "nope"],
    ["add", "provider", "x", "--ep", "qnn", "--option", "noequals"],
    ["add", "provider", "x", "--ep", "qnn", "--option", "a=1", "--option", "a=2"],
    ["add", "target"],
    ["add", "target", "nope"],
    ["add", "target", "snapdragon-8-gen-3", "--ep", "openvino"],
    ["add", "target", "snapdragon-8-gen-3", "--to", "nogroup"],
    ["cache", "prune", "--max-size", "-1"],
    ["cache", "import", "does-not-exist.tar", "--cache", "localcache"],
    ["cache", "verify", "--cache", "epbuild.toml"],
    ["watch", "--debounce", "-1"],
    ["watch", "--poll", "--debounce", "nan"],
    ["-C", "nowhere", "status"],
    ["build", "--nope"],
    ["build", "-j", "x"],
    ["frobnicate"],
    ["cache"],
    ["cache", "nope"],
    ["add"],
    ["add", "target", "--list"],
    ["report"],
    ["verify", "--tokens", "many"],
    ["package", "--jobs", "2"],
    ["status", "--detail", "--cache", "c"],
    ["--file", "nowhere.toml", "status"],
    ["--file", "models", "status"],
]
"""Arguments no manifest makes right."""

EDITS = ("add", "init")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace with three tiny models (one with pattern characters in its name)."""
    base = tmp_path_factory.mktemp("property") / "ws"
    for name, seed in (("a", 1), ("b", 2), ("c", 3), ("br[1]", 4)):
        save(matmul_model(seed, n=8), base / "models" / f"{name}.onnx")
    return base


@pytest.fixture(autouse=True)
def _private_places(root: Path, monkeypatch: pytest.MonkeyPatch, frozen_heap: object) -> None:
    """Each test's own places; the heap frozen for the module, which makes the
    ``gc.collect()`` after each command cheap (it scanned the whole heap: ~0.1 s a command)."""
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(root.parent / "toolchains"))
    monkeypatch.chdir(root)


RAN = {"commands": 0, "manifests": 0}


@contextlib.contextmanager
def _watch_stops_after_its_first_cycle(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``watch`` as ``watch --once`` would be: its first cycle, then Ctrl-C (exit 130)."""
    original = render.watch_finished

    def finished(as_json: bool, cycle: Any) -> None:
        original(as_json, cycle)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(render, "watch_finished", finished)
        yield


def run_in_process(root: Path, argv: list[str]) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    args = argv if argv[0] in ("-C", "-f", "--file") else ["-C", str(root), *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(args)
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 2
    gc.collect()  # a file left open is a ResourceWarning, an error here (cheap: frozen_heap)
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - started


ENVELOPE = ("command", "schema_version", "ok", "warnings")


def _json_form(argv: list[str]) -> list[str]:
    return argv if "--json" in argv else [*argv, "--json"]


def one_document(argv: list[str], rc: int, out: str, where: str) -> None:
    """Under ``--json``: stdout is one JSON document in the envelope (``watch``: one per
    cycle, one line each), ``ok`` says whether the exit code is 0, and a failure's
    ``error`` names that exit code."""
    import json

    watch = "watch" in argv
    texts = out.splitlines() if watch else [out]
    assert texts and all(t.strip() for t in texts), where
    for text in texts:
        try:
            doc = json.loads(text)
        except ValueError:
            raise AssertionError(f"stdout is not one JSON document\n{where}") from None
        assert isinstance(doc, dict) and all(k in doc for k in ENVELOPE), where
        assert isinstance(doc["warnings"], list) and doc["schema_version"] == 1, where
        if not watch:
            assert doc["ok"] is (rc == 0), where
        if "error" in doc:  # only a failed command's document has one
            error = doc["error"]
            assert doc["ok"] is False and error["exit_code"] == rc, where
            assert error["message"] and error["class"] and error["kind"], where


def check(root: Path, argv: list[str], before: bytes | None, *, as_json: bool = False) -> None:
    """One command: a clear outcome, and a refused edit changed nothing."""
    argv = _json_form(argv) if as_json else argv
    rc, out, err, seconds = run_in_process(root, argv)
    RAN["commands"] += 1
    allowed = {0, 1, 2, 130} if argv[0] == "watch" else {0, 1, 2}
    where = f"epbuild {' '.join(argv)} -> {rc}\n{out[-2000:]}\n{err[-2000:]}"
    assert rc in allowed, where
    assert "Traceback" not in out + err, where
    assert "internal error" not in err, where
    assert seconds < COMMAND_SECONDS, where
    if rc != 0 and before is not None and argv[0] in EDITS:
        assert (root / "epbuild.toml").read_bytes() == before, where
    if as_json:
        one_document(argv, rc, out, where)


def _reset(root: Path, raw: bytes) -> None:
    for name in ("new.toml", "report.html", "out.tar"):
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
    for name in ("pkg", "envs"):
        shutil.rmtree(root / name, ignore_errors=True)
    (root / "epbuild.toml").write_bytes(raw)


@settings(
    max_examples=int(os.environ.get("EPBUILD_PROPERTY_EXAMPLES", "4")),
    deadline=None,
    derandomize="EPBUILD_PROPERTY_RANDOM" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    raw=manifests(),
    as_json=st.lists(st.booleans(), min_size=len(COMMANDS), max_size=len(COMMANDS)),
)
def test_every_command_on_hostile_manifests(
    root: Path, raw: bytes, as_json: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    RAN["manifests"] += 1
    _reset(root, raw)
    with _watch_stops_after_its_first_cycle(monkeypatch):
        for argv, json_form in zip(COMMANDS, as_json, strict=True):
            if argv[0] in EDITS:  # each edit starts from the generated manifest
                _reset(root, raw)
            before = (root / "epbuild.toml").read_bytes()
            check(root, argv, before, as_json=json_form)


def test_hostile_arguments(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _reset(root, _render(BASE, "tables").encode())
    with _watch_stops_after_its_first_cycle(monkeypatch):
        for argv in HOSTILE_ARGS:
            for as_json in (False, True):
                before = (root / "epbuild.toml").read_bytes()
                check(root, argv, before, as_json=as_json)


@pytest.mark.parametrize(
    ("form", "argv"),
    [
        ("inline", ["add", "model", "models/c.onnx", "--group", "main"]),
        ("dotted", ["status"]),
        ("bom-crlf", ["add", "target", "snapdragon-8-gen-3"]),
        ("bom-crlf", ["build", "--executor", "dask", "--scheduler", "garbage"]),
    ],
)
def test_real_processes(root: Path, argv: list[str], form: str) -> None:
    """The console entry point, as a user runs it (no in-process shortcuts)."""
    text = _render(BASE, "tables" if form == "bom-crlf" else form)
    raw = text.replace("\n", "\r\n").encode("utf-8-sig") if form == "bom-crlf" else text.encode()
    _reset(root, raw)
    proc = subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(root), *argv],
        capture_output=True, text=True, timeout=COMMAND_SECONDS,
    )  # fmt: skip
    where = f"{argv} {form} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode in (0, 1, 2), where
    assert "Traceback" not in proc.stdout + proc.stderr, where
    if form == "bom-crlf":  # argument errors first, then the manifest's
        assert proc.returncode == 2, where
        assert ("byte-order mark" in proc.stderr) != ("garbage" in argv), where
        assert (root / "epbuild.toml").read_bytes() == raw


def test_report_count() -> None:
    """Runs last in this module: says how much was run (``-s`` shows it)."""
    print(f"\nproperty test: {RAN['commands']} commands on {RAN['manifests']} manifests")
    assert RAN["commands"] >= 2 * len(HOSTILE_ARGS)


def test_error_document_names_the_file_key_and_exit_code(root: Path) -> None:
    """A failure under ``--json``: stdout is the error document alone (the manifest's file,
    line and key where known), stderr keeps the human message."""
    import json

    _reset(root, b'[workspace]\nout_dir = "build"\nbogus = 1\n')
    rc, out, err, _ = run_in_process(root, ["status", "--json"])
    doc = json.loads(out)
    assert rc == 2 and doc["ok"] is False and doc["command"] == "status"
    error = doc["error"]
    assert error["kind"] == "manifest" and error["class"] == "ManifestError"
    assert error["file"].endswith("epbuild.toml") and error["key"] == "workspace.bogus"
    assert error["exit_code"] == 2 and "bogus" in error["message"]
    assert err.startswith("epbuild: error: ") and "bogus" in err and "{" not in err
    rc, out, err, _ = run_in_process(root, ["cache", "prune", "--max-size", "--json"])
    doc = json.loads(out)
    assert rc == 2 and doc["command"] == "cache prune" and doc["error"]["kind"] == "usage"
    assert "usage: epbuild cache prune" in err and "expected one argument" in err
