"""The remote cache tier against a real S3 server (moto's server mode) on 127.0.0.1."""

from __future__ import annotations

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
