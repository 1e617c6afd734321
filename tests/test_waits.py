"""The tests' wait helper (tests/waits.py): a withheld event fails naming the event and
showing what the process was doing, Python stacks included for epbuild's processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import waits

# A stand-in for an epbuild process stuck in its work: registers the stack dump like the CLI
# and the worker do, says so, then waits for an event that never comes.
_STUCK = """
import sys, time
from epbuild import _stacks
_stacks.register()
print("registered", flush=True)
def stuck_in_the_slow_part():
    sys.stdin.read()
stuck_in_the_slow_part()
"""


def test_a_withheld_event_fails_naming_it_with_the_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(waits.SCALE_VAR, "0.01")  # 120 s → 1.2 s: the event never comes anyway
    proc = subprocess.Popen([sys.executable, "-c", _STUCK], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "registered\n"
        with pytest.raises(waits.WaitExpired) as info:
            waits.wait_for(lambda: False, "the go file to appear", proc=proc,
                           output=lambda: "first line\nlast line\n")  # fmt: skip
    finally:
        proc.kill()
        proc.communicate()
    message = str(info.value)
    assert message.startswith("timed out after 1 s waiting for the go file to appear\n"), message
    assert f"pid {proc.pid} [" in message and "_stacks.register()" in message  # its command
    assert "Python stacks (faulthandler):" in message
    assert "stuck_in_the_slow_part" in message, message  # the frame it sits in
    assert "  | last line" in message


def test_an_exit_ends_the_wait_at_once(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('bye')"], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    with pytest.raises(waits.WaitExpired, match=r"waiting for the file x: the process exited"):
        waits.wait_for((tmp_path / "x").exists, "the file x", proc=proc)
    proc.communicate()
    assert waits.wait_for(lambda: 42, "an answer") == 42


def test_communicate_names_what_it_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(waits.SCALE_VAR, "0.01")
    code = "import threading; print('started', flush=True); threading.Event().wait()"
    pipe = subprocess.PIPE
    with (
        subprocess.Popen([sys.executable, "-c", code], stdout=pipe, stderr=pipe, text=True) as proc,
        pytest.raises(waits.WaitExpired) as info,
    ):
        waits.communicate(proc, "the build to finish", timeout=100)
    message = str(info.value)
    assert "timed out after 1 s waiting for the build to finish" in message
    assert "last stdout:\n  | started" in message
    assert proc.returncode is not None  # killed, not left behind


def test_the_scale_multiplies_every_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(waits.SCALE_VAR, "3")
    assert waits.scaled(10) == 30
    monkeypatch.setenv(waits.SCALE_VAR, "fast")
    with pytest.raises(ValueError, match="EPBUILD_TEST_TIMEOUT_SCALE='fast' is not a number"):
        waits.scale()


def test_epbuild_processes_register_their_stacks_only_when_asked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != waits.STACKS_VAR}
    code = "from epbuild import _stacks; _stacks.register(); print(len(_stacks._held))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=waits.scaled(60), check=True).stdout  # fmt: skip
    assert out.strip() == "0"
    env[waits.STACKS_VAR] = str(tmp_path)
    with subprocess.Popen([sys.executable, "-m", "epbuild", "--help"], env=env,
                          stdout=subprocess.DEVNULL) as proc:  # fmt: skip
        waits.communicate(proc, "epbuild --help")
    assert proc.returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == [f"{proc.pid}.txt"]
