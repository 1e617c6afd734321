"""The remote cache tier against a real S3 server (moto's server mode) on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
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
