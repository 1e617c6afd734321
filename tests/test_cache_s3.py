"""The remote cache tier against a real S3 server (moto's server mode) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import waits
from conftest import Workspace

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("moto", "s3fs", "fsspec")),
    reason="needs moto[server], s3fs and fsspec (pip install -e '.[dev]')",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto S3 server process on a free loopback port; yields its endpoint URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def accepts() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return True
            except OSError:
                return False

        waits.wait_for(accepts, f"the moto S3 server to accept connections on port {port}",
                       proc=proc, interval=0.1)  # fmt: skip
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url}  # fmt: skip
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with urllib.request.urlopen(urllib.request.Request(f"{url}/ci-cache", method="PUT")):
            pass
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=waits.scaled(60))


def _list(url: str) -> str:
    with urllib.request.urlopen(f"{url}/ci-cache?list-type=2") as r:
        return str(r.read().decode())


@pytest.mark.slow
def test_s3_round_trip(simple_ws: Callable[..., Workspace], s3_server: str, tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    remote = "s3://ci-cache/epbuild"
    ws = simple_ws()
    # the compile machine: its own local tier, pushes to S3
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "compile-machine"))
    doc = ws.cli_json("build", "--cache", remote, "--cache-push")
    assert doc["summary"]["compiled"] == 2, doc
    listing = _list(s3_server)
    assert listing.count("epbuild/v1/entries/") == 2 and listing.count("epbuild/v1/objects/") == 5
    # a CI job elsewhere: empty local tier, no compiles allowed
    other = Workspace(tmp_path / "ci" / "ws")
    shutil.copytree(ws.root, other.root, ignore=shutil.ignore_patterns("build", ".epbuild"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ci-runner"))
    doc = other.cli_json("build", "--cache-only", "--cache", remote)
    assert doc["summary"]["restored"] == 2 and doc["summary"]["compiled"] == 0, doc
    a = {p.relative_to(ws.root): p.read_bytes() for p in (ws.root / "build").rglob("*.onnx*")}
    a |= {p.relative_to(ws.root): p.read_bytes() for p in (ws.root / "build").rglob("*.bin")}
    b = {p.relative_to(other.root): p.read_bytes() for p in (other.root / "build").rglob("*.onnx*")}
    b |= {p.relative_to(other.root): p.read_bytes() for p in (other.root / "build").rglob("*.bin")}
    assert a == b and len(a) == 5
    # pulled into the runner's local tier on the way
    assert list((tmp_path / "ci-runner" / "epbuild" / "v1" / "entries").rglob("*.json"))
    # without --cache-push nothing is written to S3
    from modelgen import matmul_model

    ws.model("models/c.onnx", matmul_model(5))
    assert ws.cli_json("build", "--cache", remote)["summary"]["compiled"] == 1
    assert _list(s3_server).count("epbuild/v1/entries/") == 2


class _Silent:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = threading.Event()
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.conns.append(conn)  # held open, never read from or written to
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _down_endpoint(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "EPBUILD_CACHE_TIMEOUT": "1"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _check_outage(ws: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The build compiles everything and says the outage once; the local tier still
    restores; --cache-only with nothing local fails, naming the outage."""
    remote = "s3://ci-cache/epbuild"
    proc = ws.cli("build", "--cache", remote, "--cache-push", "--json", timeout=240)
    doc = json.loads(proc.stdout or "{}")
    assert proc.returncode == 0 and doc["summary"]["compiled"] == 2, (doc, proc.stderr)
    said = [line for line in proc.stderr.splitlines() if "remote cache" in line]
    assert len(said) == 1, proc.stderr
    assert "unavailable" in said[0] and remote in said[0], said
    warned = [w for a in doc["actions"] for w in a.get("warnings", []) if "remote cache" in w]
    assert len(warned) == 1, doc
    ws.cli("clean", check=True)
    doc = ws.cli_json("build", "--cache", remote)
    assert doc["summary"]["restored"] == 2, doc
    ws.cli("clean", check=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-local-tier"))
    proc = ws.cli("build", "--cache", remote, "--cache-only", timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("not in the cache: the remote cache is unavailable") == 2, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_s3_endpoint_refusing_connections_fails_nothing(
    simple_ws: Callable[..., Workspace], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _down_endpoint(monkeypatch, _free_port())  # bound and closed again: connections refused
    _check_outage(simple_ws(), monkeypatch, tmp_path)


@pytest.mark.slow
def test_s3_endpoint_that_never_answers_does_not_hang(
    simple_ws: Callable[..., Workspace], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server = _Silent()
    try:
        _down_endpoint(monkeypatch, server.port)
        _check_outage(simple_ws(), monkeypatch, tmp_path)
        assert server.accepted.is_set()  # it was asked, and the build did not wait for it
    finally:
        server.close()


def test_cache_only_against_a_missing_bucket_names_the_bucket(
    simple_ws: Callable[..., Workspace], s3_server: str
) -> None:
    """Not "no entry": the bucket itself is missing, and the message says so."""
    ws = simple_ws()
    proc = ws.cli("build", "--cache-only", "--cache", "s3://no-such-bucket/epbuild")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "s3://no-such-bucket/epbuild: bucket 'no-such-bucket' does not exist" in proc.stderr


class _Dying:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that dies mid-operation: at the
    first request starting with ``trigger`` it forwards ``keep`` bytes of the answer (0:
    none), then closes every connection and its port (``died`` is set)."""

    def __init__(self, upstream: int, trigger: bytes, keep: int = 0) -> None:
        self.upstream, self.trigger, self.keep = upstream, trigger, keep
        self.died = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # died
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.conns += [conn, up]
            armed = threading.Event()
            threading.Thread(target=self._pipe, args=(conn, up, armed, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, armed, False), daemon=True).start()

    def _pipe(
        self, src: socket.socket, dst: socket.socket, armed: threading.Event, request: bool
    ) -> None:
        left = self.keep
        try:
            while data := src.recv(65536):
                if request and data.startswith(self.trigger):
                    armed.set()
                    if not self.keep:
                        return self.die()
                if not request and armed.is_set():
                    data = data[:left]
                    left -= len(data)
                dst.sendall(data)
                if not request and armed.is_set() and left <= 0:
                    return self.die()
        except OSError:
            pass
        return None

    def die(self) -> None:
        self.died.set()
        self.sock.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


def _through(monkeypatch: pytest.MonkeyPatch, proxy: _Dying) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("EPBUILD_CACHE_TIMEOUT", "5")


@pytest.mark.slow
def test_a_server_dying_mid_push_is_one_warning_and_stores_nothing_false(
    simple_ws: Callable[..., Workspace], s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server dies at the first object upload: the build compiles, says so once, exits
    0; no entry that names a missing object is left in S3; the next push fills it in."""
    remote = "s3://ci-cache/epbuild"
    ws = simple_ws()
    proxy = _Dying(int(s3_server.rsplit(":", 1)[1]), b"PUT /ci-cache/epbuild/v1/objects/")
    _through(monkeypatch, proxy)
    proc = ws.cli("build", "--cache", remote, "--cache-push", "--json")
    doc = json.loads(proc.stdout or "{}")
    assert proxy.died.is_set()
    assert proc.returncode == 0 and doc["summary"]["compiled"] == 2, (doc, proc.stderr)
    assert "Traceback" not in proc.stderr
    said = [line for line in proc.stderr.splitlines() if "remote cache" in line]
    assert len(said) == 1 and "unavailable" in said[0], proc.stderr
    assert "epbuild/v1/entries/" not in _list(s3_server)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0, 300])
def test_a_server_dying_mid_restore_is_compiled_around_or_named(
    simple_ws: Callable[..., Workspace],
    s3_server: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    keep: int,
) -> None:
    """The server dies at the first object download (before its answer, or inside its
    body): a build compiles with one warning, and nothing half-downloaded is kept;
    --cache-only exits 1 naming the outage. Never "restored"."""
    remote = "s3://ci-cache/epbuild"
    ws = simple_ws()
    ws.cli("build", "--cache", remote, "--cache-push", check=True)
    ws.cli("clean", check=True)
    for only in (True, False):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"runner-{only}"))
        proxy = _Dying(int(s3_server.rsplit(":", 1)[1]), b"GET /ci-cache/epbuild/v1/objects/", keep)
        _through(monkeypatch, proxy)
        args = ("--cache-only",) if only else ()
        proc = ws.cli("build", "--cache", remote, *args, "--json")
        doc = json.loads(proc.stdout or "{}")
        assert proxy.died.is_set()
        assert "Traceback" not in proc.stderr
        assert doc["summary"]["restored"] == 0, (doc, proc.stderr)
        if only:
            assert proc.returncode == 1, proc.stderr
            assert "not in the cache: the remote cache is unavailable" in proc.stderr
        else:
            assert proc.returncode == 0 and doc["summary"]["compiled"] == 2, proc.stderr
            said = [line for line in proc.stderr.splitlines() if "remote cache" in line]
            assert len(said) == 1, proc.stderr
        objects = tmp_path / f"runner-{only}" / "epbuild" / "v1" / "objects"
        kept = [p for p in objects.rglob("*") if p.is_file()]
        assert all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in kept), kept
        ws.cli("clean", check=True)
