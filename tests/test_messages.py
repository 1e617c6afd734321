"""One clear message for each mistake the trust review found: no traceback, no hang, the
file, key or path named and what to do."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Workspace


def epbuild(root: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(root), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def clean_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("epbuild: error: ")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: connecting is refused


@pytest.mark.parametrize(
    ("address", "needle"),
    [
        ("garbage", "--scheduler 'garbage' is not a scheduler address"),
        ("http://127.0.0.1:8787", "http:// is not a Dask transport"),
        ("tcp://127.0.0.1:99999", "port 99999 is out of range"),
    ],
)
def test_bad_scheduler_address_is_an_argument_error(
    simple_ws: Callable[..., Workspace], address: str, needle: str
) -> None:
    ws = simple_ws()
    started = time.monotonic()
    proc = epbuild(ws.root, "build", "--executor", "dask", "--scheduler", address)
    clean_error(proc, 2, needle, "tcp://HOST:PORT")
    assert time.monotonic() - started < 15
    assert not (ws.root / ".epbuild").exists()  # refused before anything started


def test_unreachable_scheduler_fails_fast(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    address = f"tcp://127.0.0.1:{_refused_port()}"
    started = time.monotonic()
    proc = epbuild(ws.root, "build", "--executor", "dask", "--scheduler", address)
    clean_error(proc, 2, f"cannot reach the Dask scheduler at {address}: Connection refused")
    assert time.monotonic() - started < 15


def test_a_server_that_is_not_dask_is_named(simple_ws: Callable[..., Workspace]) -> None:
    """A port that answers but speaks another protocol: a clean error at once, not Dask's
    MemoryError and its client's 40-second close."""
    import threading

    ws = simple_ws()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def reply(conn: socket.socket) -> None:
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 64)
            with contextlib.suppress(OSError):
                conn.recv(1024)

    def answer() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=reply, args=(conn,), daemon=True).start()

    threading.Thread(target=answer, daemon=True).start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    started = time.monotonic()
    try:
        proc = epbuild(ws.root, "build", "--executor", "dask", "--scheduler", address)
    finally:
        server.close()
    clean_error(proc, 2, f"cannot connect to the Dask scheduler at {address}")
    assert time.monotonic() - started < 30


def test_manifest_scheduler_is_checked(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    text = (ws.root / "epbuild.toml").read_text()
    (ws.root / "epbuild.toml").write_text(
        '[workspace]\nexecutor = "dask"\nscheduler = "http://farm:8787"\n' + text
    )
    clean_error(epbuild(ws.root, "status"), 2, "epbuild.toml:3: workspace.scheduler: ")


@pytest.mark.parametrize("value", ["99999999999", "2147483648", str(2**64 - 1)])
def test_free_dimensions_are_bounded(simple_ws: Callable[..., Workspace], value: str) -> None:
    ws = simple_ws()
    text = (ws.root / "epbuild.toml").read_text()
    (ws.root / "epbuild.toml").write_text(
        text.replace(
            "share_weights = true", f"share_weights = true\nfree_dimensions = {{ batch = {value} }}"
        )
    )
    proc = epbuild(ws.root, "build")
    if value == str(2**64 - 1):  # beyond TOML's 64-bit integers: the TOML parser says so
        clean_error(proc, 2, "epbuild.toml:")
    else:
        clean_error(proc, 2, "groups.pair.free_dimensions.batch: must be at most 16777216")


@pytest.mark.parametrize("command", [["build"], ["status"], ["status", "--detail"], ["clean"]])
def test_deeply_nested_manifest(workspace: Workspace, command: list[str]) -> None:
    workspace.root.mkdir(parents=True)
    (workspace.root / "epbuild.toml").write_text("x = " + "[" * 500 + "]" * 500 + "\n")
    clean_error(epbuild(workspace.root, *command), 2, "nested too deeply")


def test_bom_is_named(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    path = ws.root / "epbuild.toml"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    clean_error(epbuild(ws.root, "build"), 2, "epbuild.toml:1: starts with a UTF-8 byte-order mark")


def test_disk_full_during_a_compile_says_so(workspace: Workspace) -> None:
    """A real full disk (a 150 kB tmpfs as the output directory, in a private mount
    namespace): the big model's action fails naming the space and the path, not the
    worker's "Fatal Python error" at shutdown (whether the worker could still write its
    result or not)."""
    import shutil

    from modelgen import matmul_model

    unshare = shutil.which("unshare")
    probe = subprocess.run(
        [unshare or "unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1k tmpfs /mnt"],
        capture_output=True,
    )
    if unshare is None or probe.returncode != 0:
        pytest.skip("no private mount namespaces here (unshare -rm)")
    workspace.model("m/a.onnx", matmul_model(1, n=256))
    workspace.model("m/b.onnx", matmul_model(2))
    workspace.manifest(
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
        '[groups.g1]\nmodels = ["m/a.onnx"]\nproviders = ["htp"]\n'
        '[groups.g2]\nmodels = ["m/b.onnx"]\nproviders = ["htp"]\n'
    )
    out = workspace.root / "build"
    out.mkdir()
    script = (
        f"mount -t tmpfs -o size=150k tmpfs {out} && "
        f"{sys.executable} -m epbuild -C {workspace.root} build -k --json"
    )
    proc = subprocess.run(
        [unshare, "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "Fatal Python" not in proc.stderr
    import json

    actions = {a["id"]: a for a in json.loads(proc.stdout)["actions"]}
    assert actions["g1/htp/a"]["outcome"] == "failed"  # the small one may fit, or not
    for action in actions.values():
        if action["outcome"] == "failed":
            assert "No space left on device: " in action["error"], action
            assert "build/.staging/" in action["error"] and "free disk space" in action["hint"]


def test_models_inside_the_output_directory_are_named(
    simple_ws: Callable[..., Workspace],
) -> None:
    ws = simple_ws()
    path = ws.root / "epbuild.toml"
    text = path.read_text()
    path.write_text('[workspace]\nout_dir = "models"\n' + text)
    clean_error(
        epbuild(ws.root, "status"), 2, "groups.pair.models: model 'models/a.onnx' is inside "
        "the output directory 'models'", 'out_dir = "build"'
    )  # fmt: skip
    path.write_text('[workspace]\nout_dir = "models"\n' + text.replace(
        '["models/a.onnx", "models/b.onnx"]', '["models/*.onnx"]'))  # fmt: skip
    clean_error(
        epbuild(ws.root, "status"), 2, "pattern 'models/*.onnx' matches no files outside "
        "epbuild's own directories", "it matches only 'models/a.onnx' and 2 more there"
    )  # fmt: skip


def test_package_under_a_file_says_it_is_a_file(simple_built: Workspace) -> None:
    ws = simple_built
    for out in ("epbuild.toml/x", "epbuild.toml/x/y"):
        proc = epbuild(ws.root, "package", "-o", out)
        clean_error(proc, 1, "epbuild.toml is a file, so nothing can be created under it")
        assert "ulimit" not in proc.stderr and "-o DIR" in proc.stderr


def test_a_cache_that_is_a_file(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    (ws.root / "cachefile").write_text("")
    for args in (["cache", "verify"], ["cache", "prune", "--max-size", "1G"], ["build"]):
        proc = epbuild(ws.root, *args, "--cache", "cachefile")
        clean_error(proc, 2, "cachefile is not a directory")
        assert "checked 0" not in proc.stdout


def test_cache_warnings_name_the_path_not_a_repr(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    (ws.root / "c2" / "v1").mkdir(parents=True)
    (ws.root / "c2" / "v1" / "entries").write_text("")  # the cache's own layout is blocked
    proc = ws.main("build", "--cache", "c2")
    assert proc.returncode == 0, proc.stderr
    assert "warning: cache unusable for" in proc.stderr
    assert "[Errno" not in proc.stderr and "Not a directory" in proc.stderr


def test_debug_shows_the_traceback(
    simple_ws: Callable[..., Workspace], monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = simple_ws()
    (ws.root / "cachefile").write_text("")
    args = ["cache", "verify", "--cache", "cachefile"]
    plain = epbuild(ws.root, *args)
    clean_error(plain, 2, "cachefile is not a directory")
    for how in (["--debug"], []):
        if not how:
            monkeypatch.setenv("EPBUILD_DEBUG", "1")
        proc = subprocess.run(
            [sys.executable, "-m", "epbuild", *how, "-C", str(ws.root), *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2
        assert proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr
        assert "open_cache" in proc.stderr  # where it came from
        assert proc.stderr.rstrip().endswith(plain.stderr.rstrip())


def test_a_bug_is_one_line_and_a_hint(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from epbuild.frontends import cli

    def broken(args: object) -> int:
        raise RuntimeError("an invariant broke")

    monkeypatch.setitem(cli.COMMANDS, "clean", broken)
    workspace.root.mkdir(parents=True)
    assert cli.main(["-C", str(workspace.root), "clean"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("epbuild: internal error: RuntimeError: an invariant broke\n")
    assert "--debug" in err and "Traceback" not in err
    assert cli.main(["--debug", "-C", str(workspace.root), "clean"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err


def test_every_json_document_shares_one_envelope(simple_built: Workspace) -> None:
    """Changing commands have --json too; each document says its command, schema version,
    whether it went well, and its warnings as structured problems."""
    import json

    ws = simple_built  # built once per session, copied: the build compiles what is added
    ws.model("models/d.onnx")
    commands = [
        ["add", "model", "models/d.onnx", "--group", "single", "--json"],
        ["add", "target", "snapdragon-8-gen-3", "--group", "single", "--json"],
        ["build", "--json"],
        ["build", "--json"],  # the no-op fast path
        ["status", "--json"],
        ["status", "--detail", "--json"],
        ["verify", "--json"],
        ["report", "--html", str(ws.root / "r.html"), "--json"],
        ["package", "-o", "pkg", "--json"],
        ["cache", "key", "--json"],
        ["cache", "verify", "--cache", "c", "--json"],
        ["cache", "prune", "--max-size", "1G", "--cache", "c", "--json"],
        ["cache", "export", str(ws.root / "x.tar"), "--cache", "c", "--json"],
        ["toolchains", "--json"],
        ["clean", "single", "--json"],
        ["-f", "other.toml", "init", "--from", "models", "--json"],
    ]
    for argv in commands:  # in this process (no interpreter start each), verify aside
        proc = epbuild(ws.root, *argv, timeout=300) if argv[0] == "verify" else ws.main(*argv)
        assert "Traceback" not in proc.stderr, (argv, proc.stderr)
        doc = json.loads(proc.stdout)
        name = (
            argv[argv.index("init")]
            if "init" in argv
            else " ".join(argv[:2])
            if argv[0] == "cache"
            else argv[0]
        )
        assert doc["command"] == name and doc["schema_version"] == 1, (argv, doc)
        assert doc["ok"] is (proc.returncode == 0), (argv, proc.returncode, doc)
        assert all(set(w) == {"severity", "message"} for w in doc["warnings"]), doc["warnings"]


def test_status_detail_takes_no_cache_flags(simple_ws: Callable[..., Workspace]) -> None:
    clean_error(epbuild(simple_ws().root, "status", "--detail", "--no-cache"), 2, "do not apply")


def test_package_build_takes_builds_options(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    clean_error(epbuild(ws.root, "package", "-o", "pkg", "-j", "2"), 2, "package --build only")
    clean_error(epbuild(ws.root, "package", "-o", "pkg", "--build", "-j", "0"), 2, "-j must be")
    proc = ws.main("package", "-o", "pkg", "--build", "-j", "1", "-k", "--no-cache")
    assert proc.returncode == 0, proc.stderr
    assert "[1/2]" in proc.stderr and "[2/2]" in proc.stderr  # built first, one at a time


def test_open_package_check_is_stat_or_hash(tmp_path: Path) -> None:
    from epbuild.errors import UserError
    from epbuild.shipping.opening import open_package

    with pytest.raises(UserError, match="check must be 'stat' or 'hash'"):
        open_package(tmp_path, "g", check="quick")  # type: ignore[arg-type]


def test_epbuild_exports_the_result_types_its_functions_return() -> None:
    import inspect

    import epbuild

    exported = {name: getattr(epbuild, name) for name in epbuild.__all__}
    for name, obj in exported.items():
        if not inspect.isfunction(obj):
            continue
        returned = inspect.signature(obj).return_annotation
        for word in str(returned).replace("[", " ").replace("]", " ").replace("|", " ").split():
            if word[:1].isupper() and word not in ("None", "Path"):
                assert word in exported, f"epbuild.{name} returns {word}, which is not exported"


def test_not_built_is_one_error_everywhere(simple_ws: Callable[..., Workspace]) -> None:
    """``package`` and ``open_action`` say "not what a build committed" with one class and
    one exit code."""
    from epbuild import open_action, package
    from epbuild.errors import NotBuiltError, OutOfDateError

    ws = simple_ws()
    with pytest.raises(NotBuiltError) as packaged:
        package(ws.root, out="pkg")
    with pytest.raises(NotBuiltError) as opened:
        open_action("single/htp", ws.root)
    assert OutOfDateError is NotBuiltError
    assert packaged.value.exit_code == opened.value.exit_code == 1
