"""A ``python`` toolchain that is not what epbuild needs gets one clear message; helpers
(the interpreter's probe, installers) run in their own process group, which ends with
them; an installer still running holds the toolchain's lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epbuild.errors import ToolchainError
from epbuild.procs import run_group
from epbuild.toolchains.env import ask, interpreter_path
from epbuild.toolchains.spec import ToolchainSpec


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('echo \'{"version": [3, 11, 0], "sites": []}\'\n', 'it printed \'{"version"'),
        ("echo 'hello, I am not python'\n", "it printed 'hello, I am not python'"),
        ("exit 3\n", "exits with status 3 (no output)"),
        ("echo 'no such module' >&2; exit 3\n", "exits with status 3: no such module"),
        ("true\n", "it printed 'nothing'"),
    ],
)
def test_interpreter_that_does_not_answer_is_named(tmp_path: Path, body: str, needle: str) -> None:
    python = _script(tmp_path / "python", body)
    with pytest.raises(ToolchainError) as err:
        ask(python, "ov")
    assert f"provider 'ov': toolchain python {python}" in err.value.message
    assert needle in err.value.message, err.value.message


def test_interpreter_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "envs" / "python").mkdir(parents=True)
    with pytest.raises(ToolchainError, match="is a directory, not an interpreter"):
        interpreter_path(ToolchainSpec(python="envs/python"), str(tmp_path), "ov")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by its new parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def _wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_helper_cut_by_its_timeout_takes_its_children_along(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    hang = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_group([sys.executable, "-c", hang], timeout=3)
    assert pidfile.exists()
    assert _wait_gone(int(pidfile.read_text()))


INSTALLER = """\
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
"""

COORDINATOR = """\
import sys
from epbuild.toolchains import create
from epbuild.toolchains.spec import ToolchainSpec

def make(spec, directory, provider, locked=None, keep=()):
    create._run([sys.executable, sys.argv[1], sys.argv[2], sys.argv[3]], directory + ".log",
                spec, provider, keep)
    raise SystemExit(0)

create._make = make
create.ensure(ToolchainSpec(requirements=("onnxruntime-openvino==1.24.1",)), "ov")
"""


def test_an_installer_outliving_its_coordinator_keeps_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator is killed (SIGKILL) while its installer runs: the toolchain's lock
    stays held until the installer ends, so the next build waits rather than trusting a
    half-written environment."""
    from filelock import FileLock, Timeout

    from epbuild.toolchains.env import env_dir

    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(tmp_path / "toolchains"))
    installer = tmp_path / "installer.py"
    installer.write_text(INSTALLER)
    started, go = tmp_path / "installer.pid", tmp_path / "go"
    coordinator = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR, str(installer), str(started), str(go)],
        env={**os.environ},
    )
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text()):
            assert time.monotonic() < deadline and coordinator.poll() is None
            time.sleep(0.05)
        os.kill(coordinator.pid, signal.SIGKILL)
        coordinator.wait(30)
        lock = FileLock(env_dir(ToolchainSpec(requirements=("onnxruntime-openvino==1.24.1",)))
                        + ".lock")  # fmt: skip
        with pytest.raises(Timeout):
            lock.acquire(timeout=0.5)  # the installer still holds it
        go.write_text("")
        assert _wait_gone(int(started.read_text()), 30)
        lock.acquire(timeout=10)
        lock.release()
    finally:
        go.write_text("")
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
