"""The command line run the ways shells and CI systems run it: standard streams closed, a
pipe whose reader went away, a full disk behind stdout, a locale that cannot spell the
workspace's names, a working directory deleted under it, a terminal that reads no escapes,
a hang-up. Each run is one message at most, never a traceback or an internal error, and an
exit code that is true: the command's own where only its output was lost."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import waits
from conftest import Workspace, write_simple

from epbuild._names import LOG_NAME

REPO = Path(__file__).resolve().parent.parent
BAD = ("Traceback", "internal error", "Exception ignored")


def run(
    root: Path | None,
    *args: str,
    shell: str = "",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``epbuild [-C root] ARGS`` through bash with the redirections ``shell`` adds
    (``>&-``, ``| true``); the exit code is epbuild's, whatever a pipe's reader did."""
    words = [sys.executable, "-m", "epbuild", *(["-C", str(root)] if root else []), *args]
    quoted = " ".join(shlex.quote(w) for w in words)
    script = f"{quoted} {shell}; exit ${{PIPESTATUS[0]}}"
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return waits.run(["bash", "-c", script], f"epbuild {shlex.join(args)} {shell}",
                     env=full_env, cwd=cwd, errors="replace")  # fmt: skip


def clean(proc: subprocess.CompletedProcess[str], code: int) -> None:
    """Exit ``code``, and nothing on stderr a user should never see."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr)
    for bad in BAD:
        assert bad not in proc.stderr + proc.stdout, proc.stderr


@pytest.fixture
def built(simple_ws: Callable[..., Workspace]) -> Workspace:
    ws = simple_ws()
    ws.cli("build", check=True)
    return ws


STATUS = (["status"], ["status", "--json"], ["build"], ["build", "--json"], ["schema"])


@pytest.mark.parametrize("args", STATUS, ids=" ".join)
def test_closed_stdout_is_output_thrown_away(built: Workspace, args: list[str]) -> None:
    """``>&-``: the command runs, its exit code is its own (the first report found
    ``status >&-`` an internal error); both streams closed alike."""
    clean(run(built.root, *args, shell=">&-"), 0)
    proc = run(built.root, *args, shell=">&- 2>&-")
    assert proc.returncode == 0


def test_closed_stdout_keeps_a_failure_its_code(built: Workspace) -> None:
    proc = run(built.root, "status", "nothing-like-this", "--json", shell=">&-")
    clean(proc, 2)
    assert "no action matches 'nothing-like-this'" in proc.stderr


def test_a_closed_descriptor_is_not_reused_for_a_file(built: Workspace) -> None:
    """Closed stdout and stdin: a build still compiles and records (no file it opens takes
    descriptor 0 or 1, where a child's output would land)."""
    built.main("clean", check=True)
    proc = run(built.root, "build", shell=">&- <&-")
    clean(proc, 0)
    assert "2 compiled" not in proc.stdout  # thrown away
    assert built.main("status", "--json", check=True).stdout.count('"stale": false') == 2


@pytest.mark.parametrize("args", STATUS, ids=" ".join)
def test_a_reader_that_goes_away_ends_nothing(built: Workspace, args: list[str]) -> None:
    """``| true`` and ``| head -c 1``: the reader left; no message, the command's own code."""
    for shell in ("| true", "| head -c 1"):
        proc = run(built.root, *args, shell=shell)
        clean(proc, 0)
        assert "Broken pipe" not in proc.stderr


def test_a_long_output_into_a_closed_pipe(workspace: Workspace) -> None:
    """Hundreds of actions: the output is far beyond a pipe's buffer."""
    write_simple(workspace)
    models = workspace.root / "models"
    for i in range(400):
        (models / f"m{i:03}.onnx").write_bytes((models / "c.onnx").read_bytes())
    text = (workspace.root / "epbuild.toml").read_text()
    (workspace.root / "epbuild.toml").write_text(text.replace('"models/c.onnx"', '"models/*.onnx"'))
    for args in (["status"], ["status", "--json"], ["status", "--graph", "dot"], ["--help"]):
        clean(run(workspace.root, *args, shell="| head -c 1"), 0)


@pytest.mark.parametrize("args", [["watch"], ["watch", "--json"]], ids=" ".join)
def test_watch_ends_when_nobody_reads_it(built: Workspace, args: list[str]) -> None:
    """``watch | true``: it ends at its first cycle, as on Ctrl-C (it had become a loop
    writing to nobody; before, a traceback)."""
    clean(run(built.root, *args, shell="| true"), 0)


def test_a_progress_reader_that_goes_away_fails_no_build(built: Workspace) -> None:
    """``2>&1 | true`` during a build: stderr's reader is gone too; the build completes."""
    built.main("clean", check=True)
    proc = run(built.root, "build", shell="2>&1 | true")
    clean(proc, 0)
    assert built.main("status", "--json", check=True).stdout.count('"stale": false') == 2


@pytest.mark.parametrize(
    "args", [*STATUS, ["--help"], ["--version"], ["--version", "--json"]], ids=" ".join
)
def test_stdout_on_a_full_disk_is_one_message(built: Workspace, args: list[str]) -> None:
    proc = run(built.root, *args, shell=">/dev/full")
    clean(proc, 1)
    assert proc.stderr.count("epbuild: error: cannot write to standard output") == 1


def test_stderr_on_a_full_disk_fails_nothing(built: Workspace) -> None:
    built.main("clean", check=True)
    proc = run(built.root, "build", "--json", shell="2>/dev/full")
    clean(proc, 0)
    assert '"compiled": 2' in proc.stdout


def test_an_error_document_with_stdout_on_a_full_disk(built: Workspace) -> None:
    """The command's own failure keeps its code; that its document was lost is said too."""
    proc = run(built.root, "report", "--json", shell=">/dev/full")
    clean(proc, 2)
    assert proc.stderr.count("epbuild: error: report needs -o") == 1
    assert proc.stderr.count("epbuild: error: cannot write to standard output") == 1


@pytest.fixture
def unicode_ws(tmp_path: Path) -> Workspace:
    """A workspace in a folder named ``ünïcødé``, its models named in three scripts."""
    from conftest import HTP73
    from modelgen import matmul_model

    ws = Workspace(tmp_path / "ünïcødé" / "ws")
    ws.model("models/mödel_ä.onnx", matmul_model(1))
    ws.model("models/日本.onnx", matmul_model(2))
    group = {"models": ["models/*.onnx"], "providers": ["htp"]}
    ws.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    return ws


ASCII_STDOUT = [
    {"PYTHONIOENCODING": "ascii"},
    {"PYTHONIOENCODING": "latin-1"},
    {"LC_ALL": "C", "LANG": "C"},
    {"LC_ALL": "POSIX"},
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "env", ASCII_STDOUT, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items())
)
def test_names_stdout_cannot_spell_are_escaped(unicode_ws: Workspace, env: dict[str, str]) -> None:
    """A model named ``日本`` on a stdout in ASCII or Latin-1: written as escapes, exit 0
    (``status`` was an internal error)."""
    unicode_ws.cli("build", check=True)
    for args in (["status"], ["status", "--graph", "mermaid"], ["build"], ["verify"]):
        proc = run(unicode_ws.root, *args, env=env)
        clean(proc, 0)
        if args == ["status"] and env == ASCII_STDOUT[0]:
            assert "up to date  g/htp/\\u65e5\\u672c" in proc.stdout


@pytest.mark.slow
def test_a_file_name_encoding_that_cannot_spell_the_models(unicode_ws: Workspace) -> None:
    """``LC_ALL=C PYTHONUTF8=0``: Python's file names are ASCII; a model named ``mödel_ä``
    cannot be opened. The pattern's match is named (exit 2), and a workspace whose own
    folder is ``ünïcødé`` (bytes Python carries as escapes) builds (every compile failed)."""
    env = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    proc = run(unicode_ws.root, "build", env=env)
    assert proc.returncode == 2, proc.stderr
    for bad in BAD:
        assert bad not in proc.stderr
    assert "not text in the file-name encoding (ascii)" in proc.stderr
    assert "PYTHONUTF8=1" in proc.stderr
    (unicode_ws.root / "models" / "mödel_ä.onnx").rename(unicode_ws.root / "models" / "a.onnx")
    (unicode_ws.root / "models" / "日本.onnx").rename(unicode_ws.root / "models" / "b.onnx")
    for args in (["build"], ["status"], ["verify"], ["status", "--json"]):
        clean(run(unicode_ws.root, *args, env=env), 0)


def test_a_glob_matching_a_name_that_is_not_utf8(built: Workspace) -> None:
    """A file named with bytes that are not UTF-8, matched by ``models/*.onnx``: one
    manifest error naming it (the build was an internal error)."""
    models = built.root / "models"
    os.rename(models / "a.onnx", os.fsencode(models) + b"/\xff.onnx")
    manifest = built.root / "epbuild.toml"
    manifest.write_text(manifest.read_text().replace('"models/a.onnx", ', '"models/*.onnx", '))
    proc = built.main("build")
    assert proc.returncode == 2, proc.stderr
    assert "matches 'models/\\udcff.onnx', whose name is not text" in proc.stderr


def test_deleted_working_directory(built: Workspace, tmp_path: Path) -> None:
    """``cd dir; rm -rf ../dir; epbuild status``: one message naming it; with ``-C`` an
    absolute path, a command that needs no relative path runs."""
    gone = tmp_path / "gone"
    for args, code in (
        ("status", 2),
        ("status --json", 2),
        ("init", 2),
        (f"-C {built.root} status", 0),
        (f"-C {built.root} package -o out", 2),
    ):
        script = f"mkdir {gone} && cd {gone} && rmdir {gone} && {sys.executable} -m epbuild {args}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = waits.run(["sh", "-c", script], f"epbuild {args} in a deleted folder", env=env)
        clean(proc, code)
        if code == 2:
            assert "the current directory no longer exists" in proc.stderr, proc.stderr


def test_a_dumb_terminal_gets_no_escapes(built: Workspace) -> None:
    """``TERM=dumb`` on a pty (an editor's shell): progress as plain lines."""
    built.main("clean", check=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb", "COLUMNS": "10"}
    out = _on_pty([sys.executable, "-m", "epbuild", "-C", str(built.root), "build"], env)
    assert b"\x1b[" not in out and b"2 compiled" in out, out


def _on_pty(argv: list[str], env: dict[str, str]) -> bytes:
    """What ``argv`` writes to a pseudo-terminal (stdout and stderr both), to its end."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=waits.scaled(120)) == 0, out
    return out


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=lambda s: s.name)
def test_a_hang_up_stops_a_build_like_ctrl_c(built: Workspace, tmp_path: Path, signum: int) -> None:
    """SIGHUP (the terminal or SSH session closed) and SIGTERM, twice in a row: workers
    stopped, exit 130, one message; the next build compiles what was interrupted."""
    built.main("clean", check=True)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO), "EPBUILD_TEST_HOOK": f"wait:c.onnx:{go}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "epbuild", "-C", str(built.root), "build", "-j", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    seen = ""
    while "compiled pair/htp" not in seen:  # pair done; c held by the hook
        line = proc.stderr.readline()
        assert line, seen
        seen += line
    waits.wait_for(lambda: _compiling(built.root), "the held compile of c", proc=proc)
    proc.send_signal(signum)
    proc.send_signal(signum)
    _, err = waits.communicate(proc, "the interrupted build")
    assert proc.returncode == 130, (seen, err)
    for bad in BAD:
        assert bad not in seen + err
    assert "interrupted" in err
    doc = built.main_json("status")
    assert [a["id"] for a in doc["actions"] if a["stale"]] == ["single/htp/c"]


def _compiling(root: Path) -> bool:
    """Whether a worker is in the test hook's wait (its log says so)."""
    return any(b"test hook: wait" in p.read_bytes() for p in root.rglob(LOG_NAME))
