"""The build trace (Chrome trace-event JSON) and the HTML report, rendered in a real browser."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import waits

from epbuild.api import Outcome

if TYPE_CHECKING:
    from conftest import Workspace

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests watch real compiles: keep a shared action cache out of them."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


def _check_trace(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Structure a trace viewer needs; returns the complete ('X') events."""
    assert set(doc) >= {"traceEvents"}
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ph"] in ("X", "M")
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
    return [e for e in events if e["ph"] == "X"]


def test_trace_of_a_build(simple_ws: Callable[..., Workspace], tmp_path: Path) -> None:
    ws = simple_ws()
    path = tmp_path / "trace.json"
    proc = ws.main("build", "-j", "2", "--trace", str(path))
    assert proc.returncode == 0, proc.stderr
    spans = _check_trace(json.loads(path.read_text()))
    names = {e["tid"]: e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    assert names[0] == "coordinator" and all(n.startswith("slot ") for t, n in names.items() if t)
    assert [e["cat"] for e in spans if e["tid"] == 0] == ["plan"]
    for action in ("pair/htp", "single/htp/c"):
        mine = [e for e in spans if e["args"].get("action") == action]
        kinds = [e["cat"] for e in sorted(mine, key=lambda e: e["ts"])]
        assert kinds == ["lock", "hash", "compile", "verify", "commit"], (action, kinds)
        assert len({e["tid"] for e in mine}) == 1 and mine[0]["tid"] > 0  # one slot's lane
        assert all(action in e["name"] for e in mine)
        compile_ = next(e for e in mine if e["cat"] == "compile")
        assert compile_["args"]["ok"] is True and compile_["args"]["peak_rss"] > 0
    for tid in {e["tid"] for e in spans}:  # spans in one lane never overlap
        lane = sorted((e for e in spans if e["tid"] == tid), key=lambda e: e["ts"])
        for a, b in itertools.pairwise(lane):
            assert a["ts"] + a["dur"] <= b["ts"] + 1, (a, b)
    # The last build's trace is kept for `epbuild report`.
    assert (ws.root / ".epbuild" / "trace.json").is_file()


def test_noop_build_writes_a_trace_too(simple_built: Workspace, tmp_path: Path) -> None:
    ws = simple_built  # built once per session, copied: this build only re-hashes
    assert ws.build().ok
    path = tmp_path / "noop.json"
    result = ws.build(trace=path)
    assert result.count(Outcome.UP_TO_DATE) == 2
    assert [e["cat"] for e in _check_trace(json.loads(path.read_text()))] == ["plan"]


def _report(ws: Workspace, tmp_path: Path, name: str) -> Path:
    page = tmp_path / name
    proc = ws.main("report", "--html", str(page))
    assert proc.returncode == 0, proc.stderr
    return page


def test_report_is_self_contained(simple_built: Workspace, tmp_path: Path) -> None:
    ws = simple_built
    text = _report(ws, tmp_path, "r.html").read_text()
    assert not re.search(r"<link|<img|<iframe|\ssrc=|url\(|@import", text)
    urls = set(re.findall(r"https?://[^\s\"'<>]+", text))
    assert urls <= {"http://www.w3.org/2000/svg"}  # an XML namespace name, never fetched
    for action in ("pair/htp", "single/htp/c"):
        assert f"<td>{action}</td>" in text
    assert text.count("<td>miss</td>") == 2
    assert "EPContext <small>from" in text and "MB" in text
    assert "(compiled) <small>the compile API</small>" in text


def test_report_cli_needs_html(simple_ws: Callable[..., Workspace]) -> None:
    proc = simple_ws().main("report")
    assert proc.returncode == 2 and "--html" in proc.stderr


def _chromium(args: list[str], user_data: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={user_data}"]  # fmt: skip
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True,
                          timeout=waits.scaled(120))  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_report_renders_in_headless_chromium(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    ws = simple_ws()
    empty = _report(ws, tmp_path, "before.html")  # never built: no timeline yet
    assert ws.build(jobs=2).ok
    page = _report(ws, tmp_path, "after.html")
    for html_page, drawn in ((empty, False), (page, True)):
        dom = _chromium(["--dump-dom", html_page.as_uri()], tmp_path / "profile").stdout
        assert 'data-rendered="ok"' in dom, dom[:2000]  # the script ran to its end
        assert 'data-errors="' not in dom  # and no script error was raised
        assert ("<rect" in dom) is drawn
        assert ('<div id="timeline">No build timeline' in dom) is not drawn
    # The check above can fail: a page whose script throws is caught.
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("</body>", "<script>null.x;</script></body>"))
    dom = _chromium(["--dump-dom", broken.as_uri()], tmp_path / "profile").stdout
    assert 'data-errors="' in dom
    shot = tmp_path / "report.png"
    _chromium([f"--screenshot={shot}", "--window-size=1200,800", page.as_uri()],
              tmp_path / "profile")  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
