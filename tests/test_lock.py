"""``epbuild.lock``: written and read back byte-identically, out of date with the manifest
(``lock --check``, ``status``), and ``build --locked`` refusing drifted environments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import HTP73, HTP75, Workspace
from modelgen import matmul_model

from epbuild.toolchains.lockfile import LOCK_NAME, Lock

QNN_TOOLCHAIN = {**HTP75, "toolchain": {"python": sys.executable}}
"""A ``python`` toolchain (the tests' own interpreter): locked without making anything."""


def _ws(workspace: Workspace, *, toolchain: bool = False) -> Workspace:
    workspace.model("models/a.onnx", matmul_model(1))
    providers = {"htp73": HTP73, **({"tc": QNN_TOOLCHAIN} if toolchain else {})}
    workspace.manifest(
        {
            "providers": providers,
            "groups": {"g": {"models": ["models/a.onnx"], "providers": sorted(providers)}},
        }
    )
    return workspace


def _lock(ws: Workspace) -> Path:
    ws.cli("lock", check=True)
    return ws.root / LOCK_NAME


def test_lock_written_and_read_back_byte_identically(
    workspace: Workspace, private_toolchains: Path
) -> None:
    path = _lock(_ws(workspace, toolchain=True))
    text = path.read_text()
    lock = Lock.from_toml(text)
    assert lock.to_toml() == text
    qnn = lock.providers["htp73"]
    assert qnn.environment == "epbuild"
    assert qnn.versions["onnxruntime-qnn"] != "absent" and qnn.versions["qnn-sdk"]
    assert qnn.library == "onnxruntime_qnn/libonnxruntime_providers_qnn.so"
    assert len(qnn.library_sha256 or "") == 64
    env = lock.environments["epbuild"]
    assert env.distributions["onnxruntime-qnn"].version == qnn.versions["onnxruntime-qnn"]
    assert env.python.count(".") == 2 and env.platform
    tc = lock.environments[lock.providers["tc"].environment]
    assert tc.interpreter == sys.executable and "onnxruntime-qnn" in tc.distributions
    again = workspace.cli("lock", check=True)
    assert "unchanged" in again.stdout and path.read_text() == text  # stable: same bytes


def test_lock_check_and_status_say_when_out_of_date(workspace: Workspace) -> None:
    ws = _ws(workspace)
    assert ws.cli("lock", "--check").returncode == 1  # no lock yet
    _lock(ws)
    assert ws.cli("lock", "--check").returncode == 0
    assert ws.cli_json("status")["lock"] == []
    _ws(workspace, toolchain=True)  # a provider with a toolchain joins the manifest
    check = ws.cli("lock", "--check")
    assert check.returncode == 1
    assert "provider tc is not in the lock" in check.stderr
    assert any("provider tc is not in the lock" in n for n in ws.cli_json("status")["lock"])
    assert "lock        epbuild.lock is out of date" in ws.cli("status").stdout


def test_locked_refuses_a_drifted_default_environment(workspace: Workspace) -> None:
    ws = _ws(workspace)
    path = _lock(ws)
    installed = Lock.from_toml(path.read_text()).providers["htp73"].versions["onnxruntime-qnn"]
    path.write_text(
        path.read_text().replace(f'onnxruntime-qnn = "{installed}"', 'onnxruntime-qnn = "2.6.0"')
    )
    for args, env in ((("build", "--locked"), {}), (("build",), {"EPBUILD_LOCKED": "1"})):
        proc = _cli_env(ws, env, *args)
        assert proc.returncode == 2, proc.stderr
        assert f"onnxruntime-qnn 2.6.0 (lock) ≠ {installed} (installed)" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (ws.root / "build").exists()  # nothing compiled
    ws.cli("lock", check=True)  # accept the installed versions
    doc = ws.cli_json("build", "--locked")
    assert doc["summary"]["compiled"] == 1, doc


def test_locked_refuses_a_drifted_toolchain(workspace: Workspace, private_toolchains: Path) -> None:
    ws = _ws(workspace, toolchain=True)
    path = _lock(ws)
    text = path.read_text()
    numpy = Lock.from_toml(text).environments["tc"].distributions["numpy"].version
    head, _, tail = text.partition("[environments.tc.distributions]")
    path.write_text(
        head
        + "[environments.tc.distributions]"
        + tail.replace(f'numpy = "{numpy}"', 'numpy = "1.0.0"', 1)
    )
    proc = ws.cli("build", "--locked", "g/tc")
    assert proc.returncode == 2, proc.stderr
    assert f"toolchain tc: numpy 1.0.0 (lock) ≠ {numpy} (installed)" in proc.stderr


def test_locked_without_a_lock_is_a_clear_error(workspace: Workspace) -> None:
    proc = _ws(workspace).cli("build", "--locked")
    assert proc.returncode == 2
    assert "no epbuild.lock beside the manifest" in proc.stderr and "epbuild lock" in proc.stderr


@pytest.mark.parametrize("text", ["format = 1\n[providers.x]\nep = 'qnn'\n", "not toml ["])
def test_malformed_lock_names_the_file(workspace: Workspace, text: str) -> None:
    ws = _ws(workspace)
    (ws.root / LOCK_NAME).write_text(text)
    proc = ws.cli("build", "--locked")
    assert proc.returncode == 2 and LOCK_NAME in proc.stderr and "epbuild lock" in proc.stderr
    assert "Traceback" not in proc.stderr


def _cli_env(ws: Workspace, env: dict[str, str], *args: str) -> object:
    import os
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(ws.root), *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )  # fmt: skip


@pytest.fixture
def private_toolchains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty toolchain directory of the test's own."""
    root = tmp_path / "toolchains"
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(root))
    return root
