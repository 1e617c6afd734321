"""The one file-writing API (``epbuild.fs``) and the one lock helper (``state.locks``)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

import pytest

from epbuild import fs
from epbuild.errors import LockTimeoutError
from epbuild.state import locks


def _fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record what each fsync made durable: 'dir' or 'file'."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_a_durable_write_fsyncs_the_file_and_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _fsynced(monkeypatch)
    fs.atomic_write_bytes(str(tmp_path / "a" / "f"), b"one", mode=0o600)
    assert seen == ["file", "dir"]
    assert (tmp_path / "a" / "f").read_bytes() == b"one"
    assert stat.S_IMODE((tmp_path / "a" / "f").stat().st_mode) == 0o600


def test_a_cheap_write_fsyncs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fsynced(monkeypatch)
    fs.atomic_write_text(str(tmp_path / "f"), "é", durable=False)
    fs.atomic_copy(str(tmp_path / "f"), str(tmp_path / "g"))
    assert seen == []
    assert (tmp_path / "g").read_text(encoding="utf-8") == "é"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), fs.atomic_output(str(target), durable=True) as tmp:
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("killed half-way")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_new_directory_made_twice_keeps_the_first(tmp_path: Path) -> None:
    final = tmp_path / "d"
    with fs.new_directory(str(final)) as first:
        Path(first, "x").write_text("1")
    with fs.new_directory(str(final)) as second:
        Path(second, "x").write_text("2")  # another process got there first
    assert (final / "x").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_directory_swaps_whole_directories(tmp_path: Path, exchange: bool) -> None:
    dest, new = tmp_path / "dest", tmp_path / "new"
    dest.mkdir()
    (dest / "old").write_text("old")
    new.mkdir()
    (new / "fresh").write_text("new")
    fs.replace_directory(str(new), str(dest), aside=str(tmp_path / "aside"), exchange=exchange)
    assert [p.name for p in dest.iterdir()] == ["fresh"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


def test_try_hold_yields_none_while_the_lock_is_taken(tmp_path: Path) -> None:
    lock = str(tmp_path / "x.lock")
    with locks.hold(lock, "a test"):
        with locks.try_hold(lock, "a second taker") as held:
            assert held is None
        third = locks.hold(lock, "a third taker", timeout=0.1)
        with pytest.raises(LockTimeoutError, match="held by a test"), third:
            pass
    with locks.try_hold(lock, "a second taker") as held:
        assert held is not None


def test_making_a_toolchain_honours_the_lock_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build with ``--lock-timeout`` does not wait for ever on another build making the
    same toolchain (it used to wait without a bound)."""
    from epbuild.toolchains import create
    from epbuild.toolchains.env import env_dir
    from epbuild.toolchains.spec import ToolchainSpec

    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(tmp_path / "toolchains"))
    spec = ToolchainSpec(requirements=("onnxruntime==1.0.0",))
    said: list[str] = []
    held = locks.hold(env_dir(spec, None) + ".lock", "another build", note=False)
    with held, pytest.raises(LockTimeoutError):
        create.ensure(spec, "p", say=said.append, lock_timeout=0.2)
    assert said == ["waiting for epbuild making the toolchain of p (onnxruntime==1.0.0) to "
                    "release its lock"]  # fmt: skip


def test_sha256_is_the_same_from_either_implementation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter's own sha256 while the budget lasts, then OpenSSL's: one digest."""
    data = os.urandom(3 * fs.CHUNK // 2)
    (tmp_path / "f").write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    for budget in (0, 1 << 30):
        monkeypatch.setattr(fs, "_own_budget", budget)
        assert fs.sha256_hex(data) == want
        assert fs.digest_file(str(tmp_path / "f")) == (len(data), want, None)
        assert fs.sha256_hex(memoryview(data)[:10]) == hashlib.sha256(data[:10]).hexdigest()
    monkeypatch.setattr(fs, "_own_budget", 100)
    assert "_hashlib" not in type(fs.new_sha256(60)).__module__
    assert "_hashlib" in type(fs.new_sha256(60)).__module__  # the budget is spent


@pytest.mark.parametrize("kernel", [True, False])
def test_copy_range_copies_a_slice_to_an_offset_in_the_kernel_or_by_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    data = os.urandom(3 * fs.CHUNK + 17)
    (tmp_path / "src").write_bytes(data)
    if not kernel:  # another filesystem, or a platform without copy_file_range

        def refuse(*_: object) -> int:
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dest", "w+b") as dest:
        dest.write(b"head")
        dest.flush()
        assert fs.copy_range(src.fileno(), dest.fileno(), 5, len(data) - 10, 4096) == len(data) - 10
        # the source ends first: what is there is copied, and the count says so
        assert fs.copy_range(src.fileno(), dest.fileno(), len(data) - 3, 10, 0) == 3
    written = (tmp_path / "dest").read_bytes()
    assert written[:3] == data[-3:]
    assert written[3:4096] == b"d" + b"\0" * (4096 - 4)
    assert written[4096:] == data[5:-5]


def test_a_commit_leaves_outputs_already_in_place_as_they_are(tmp_path: Path) -> None:
    from epbuild.engine.staging import commit

    out = tmp_path / "build" / "g" / "p"
    out.mkdir(parents=True)
    staged = tmp_path / "build" / ".staging" / "x"
    staged.mkdir(parents=True)
    for name, body in (("same.bin", b"same"), ("new.bin", b"new")):
        (out / name).write_bytes(b"old" if name == "new.bin" else body)
        (staged / name).write_bytes(body)
    before = {p.name: p.stat().st_ino for p in out.iterdir()}
    old = ["build/g/p/same.bin", "build/g/p/new.bin"]
    commit(
        str(tmp_path), "build/.staging/x", "build/g/p", ["same.bin", "new.bin"], old, ["same.bin"]
    )
    assert (out / "same.bin").stat().st_ino == before["same.bin"]  # kept, not replaced
    assert (out / "new.bin").read_bytes() == b"new"
    assert (out / "new.bin").stat().st_ino != before["new.bin"]
    assert not staged.exists()  # the kept one's staged copy went with the staging directory
