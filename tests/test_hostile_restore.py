"""A fresh checkout's restore and the ``cache`` commands under a careless user or another
user of a shared cache, with the real QNN EP on tiny models: a restore that cannot write
the workspace blames the disk, not the cache; an object that cannot be read, or a link
planted in its place, is damage that the next build repairs; ``--cache-only`` with the
cache turned off is one user error; an export never writes into the cache."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import Workspace
from test_fresh_restore import fresh

from epbuild.cache.layout import object_path
from epbuild.state.journal import load_state

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def seeded(simple_built: Workspace, tmp_path: Path) -> tuple[Workspace, Path]:
    """A built workspace and a directory cache seeded with its two actions."""
    cache = tmp_path / "cache"
    assert simple_built.build(cache=str(cache)).ok
    return simple_built, cache


def c_binary(ws: Workspace, cache: Path) -> Path:
    """The cache object of ``single/htp/c``'s context binary."""
    state = load_state(str(ws.root / ".epbuild" / "state.jsonl"))
    digest = state.records["single/htp/c"].outputs["build/single/htp/c_ctx_qnn.bin"].digest
    return cache / object_path(digest)


def test_an_export_into_the_cache_or_a_directory_is_refused(
    seeded: tuple[Workspace, Path], tmp_path: Path
) -> None:
    """``cache export`` over one of the cache's own objects replaced it by the archive (exit
    0, the object damaged); into a directory it was exit 1 with a hint about free space."""
    ws, cache = seeded
    obj = c_binary(ws, cache)
    before = obj.read_bytes()
    for dest, said in (
        (obj, "is inside the cache directory"),
        (cache / "ci.tar", "is inside the cache directory"),
        (cache, "is a directory"),
        (tmp_path, "is a directory"),
    ):
        proc = ws.main("cache", "export", str(dest), "--cache", str(cache))
        assert proc.returncode == 2 and said in proc.stderr, (dest, proc.stderr)
    assert obj.read_bytes() == before and not (cache / "ci.tar").exists()
    proc = ws.main("cache", "export", "", "--cache", str(cache))
    assert proc.returncode == 2 and "archive's file name" in proc.stderr, proc.stderr
    archive = tmp_path / "ci.tar"
    assert ws.main("cache", "export", str(archive), "--cache", str(cache)).returncode == 0
    assert archive.is_file()


def _cli(ws: Workspace, *args: str, preexec: Any = None, prefix: tuple[str, ...] = ()) -> Any:
    """``epbuild -C ws ARGS`` in a process of its own (started through ``prefix``)."""
    command = [*prefix, sys.executable, "-m", "epbuild", "-C", str(ws.root), *args]
    proc = waits.run(command, f"epbuild {' '.join(args)}", timeout=300, preexec_fn=preexec)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _file_size_limit(limit: int) -> Any:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.fixture
def elsewhere(seeded: tuple[Workspace, Path]) -> Iterator[Path]:
    """A copy of the seeded cache on another file system (``/dev/shm``): a restore from it
    copies its objects instead of linking them."""
    _, cache = seeded
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == cache.stat().st_dev:
        pytest.skip("no second file system to put the cache on")
    top = Path(tempfile.mkdtemp(prefix="epbuild-test-", dir="/dev/shm"))
    try:
        shutil.copytree(cache, top / "cache")
        yield top / "cache"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_restore_that_cannot_write_the_workspace_blames_the_disk(
    seeded: tuple[Workspace, Path], elsewhere: Path, tmp_path: Path
) -> None:
    """A full disk under a restore (here a file-size limit below the pair's context binary,
    copied from a cache on another file system) said ``not in the cache: cache unusable``,
    with the hint to build where the toolchain is installed: the disk was to blame."""
    ws, _ = seeded
    checkout = fresh(ws.root, tmp_path / "checkout")
    args = ("build", "--cache-only", "--cache", str(elsewhere), "--json")
    proc = _cli(checkout, *args, preexec=_file_size_limit(64 << 10))
    assert proc.returncode == 1, proc.stderr
    failed = {a["id"]: a for a in json.loads(proc.stdout)["actions"] if a["outcome"] == "failed"}
    assert list(failed) == ["pair/htp"], proc.stdout
    error, hint = failed["pair/htp"]["error"], failed["pair/htp"]["hint"]
    assert error.startswith("cannot restore pair/htp into build/pair/htp: "), error
    assert "File too large" in error and "not in the cache" not in error, error
    assert "free space" in hint, hint
    assert _cli(checkout, *args).returncode == 0
    assert _cli(checkout, "verify").returncode == 0


def _without_dac_override() -> tuple[str, ...]:
    """A command prefix under which file modes hold (root ignores them otherwise)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    caps = "-dac_override,-dac_read_search"
    prefix = (setpriv or "setpriv", "--bounding-set", caps, "--inh-caps", caps)
    if setpriv is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("root ignores file modes, and setpriv cannot drop that here")
    return prefix


@pytest.mark.parametrize("plant", ["unreadable", "link"])
def test_an_object_that_cannot_be_used_is_stored_anew_by_the_next_build(
    seeded: tuple[Workspace, Path], tmp_path: Path, plant: str
) -> None:
    """Another user's object made unreadable: a restore named a staging file of the
    workspace (``Permission denied``), kept the entry, and a build's store took the object
    for present, so no build ever cached that action again. A link planted in an object's
    place: every store failed on it. Now the restore names the object, and the build after
    it stores the object anew, which the next fresh checkout restores."""
    ws, cache = seeded
    obj = c_binary(ws, cache)
    user = tmp_path / "user.bin"
    user.write_bytes(b"the user's own bytes")
    prefix: tuple[str, ...] = ()
    if plant == "unreadable":
        prefix = _without_dac_override()
        obj.chmod(0)
    else:
        obj.unlink()
        obj.symlink_to(user)
    checkout = fresh(ws.root, tmp_path / "checkout")
    only = ("build", "--cache-only", "--cache", str(cache))
    proc = _cli(checkout, *only, prefix=prefix)
    assert proc.returncode == 1 and str(obj) in proc.stdout + proc.stderr, proc.stderr
    said = "cannot be read" if plant == "unreadable" else "symbolic link"
    assert said in proc.stdout + proc.stderr
    assert ".staging" not in proc.stdout + proc.stderr
    proc = _cli(checkout, "build", "--cache", str(cache), "--json", prefix=prefix)
    assert proc.returncode == 0 and "not stored" not in proc.stderr, proc.stderr
    if plant == "link":
        assert f"{obj} was a symbolic link to {user}" in proc.stderr, proc.stderr
        assert "replaced by the object" in proc.stderr
    assert obj.is_file() and not obj.is_symlink()
    assert user.read_bytes() == b"the user's own bytes"
    again = fresh(ws.root, tmp_path / "again")
    proc = _cli(again, *only, "--json", prefix=prefix)
    assert proc.returncode == 0 and json.loads(proc.stdout)["summary"]["restored"] == 2


def test_cache_verify_discards_an_object_that_cannot_be_read(
    seeded: tuple[Workspace, Path],
) -> None:
    """``cache verify`` stopped at the first unreadable object with exit 2."""
    ws, cache = seeded
    prefix = _without_dac_override()
    obj = c_binary(ws, cache)
    obj.chmod(0)
    proc = _cli(ws, "cache", "verify", "--cache", str(cache), prefix=prefix)
    assert proc.returncode == 1, proc.stderr
    assert "c_ctx_qnn.bin missing or damaged; discarded" in proc.stderr, proc.stderr
    assert not obj.exists()


def test_cache_only_with_the_cache_off_is_one_user_error(
    seeded: tuple[Workspace, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``build --cache-only`` with the cache turned off (``--no-cache``, an empty or ``off``
    ``EPBUILD_CACHE``: a CI variable that was not set, ``[workspace] cache = "off"``) failed
    every action with exit 1, "not in the cache: the cache is off" and the hint to build
    where the toolchain is installed. It is one message naming the setting, exit 2."""
    ws, _ = seeded
    checkout = fresh(ws.root, tmp_path / "checkout")
    for env, args, said in (
        ("off", ["--no-cache"], "(set by --no-cache)"),
        ("", [], "(set by EPBUILD_CACHE='')"),
        (None, [], "(set by [workspace] cache)"),
    ):
        if env is None:
            monkeypatch.delenv("EPBUILD_CACHE")
            manifest = checkout.root / "epbuild.toml"
            manifest.write_text('[workspace]\ncache = "off"\n\n' + manifest.read_text())
        else:
            monkeypatch.setenv("EPBUILD_CACHE", env)
        proc = checkout.main("build", "--cache-only", *args)
        assert proc.returncode == 2, proc.stderr
        assert f"--cache-only needs a cache, and the cache is off {said}" in proc.stderr
        assert proc.stderr.count("error:") == 1, proc.stderr
    assert not (checkout.root / "build").exists()
    monkeypatch.setenv("EPBUILD_CACHE", str(checkout.root / "epbuild.toml"))
    proc = checkout.main("build")
    assert proc.returncode == 2, proc.stderr
    assert "is not a directory (set by EPBUILD_CACHE=" in proc.stderr, proc.stderr


def test_cache_only_from_a_cache_that_does_not_exist_says_so(
    seeded: tuple[Workspace, Path], tmp_path: Path
) -> None:
    """A mistyped cache path (or a CI cache not restored there) read as an ordinary miss."""
    ws, _ = seeded
    checkout = fresh(ws.root, tmp_path / "checkout")
    proc = checkout.main("build", "--cache-only", "--cache", str(tmp_path / "typo"))
    assert proc.returncode == 1
    said = f"no entry for pair/htp in the cache ({tmp_path / 'typo'}, a directory that did not"
    assert said in proc.stderr, proc.stderr


def test_a_directory_where_an_output_goes_is_named_and_left_alone(
    seeded: tuple[Workspace, Path], tmp_path: Path
) -> None:
    """A directory at an output's name failed the restore half-way with "cannot put the
    outputs in place … Is a directory" and the hint to check free space; the outputs before
    it were already replaced. Now nothing is touched, and the message names the directory."""
    ws, cache = seeded
    checkout = fresh(ws.root, tmp_path / "checkout")
    folder = checkout.root / "build" / "pair" / "htp"
    (folder / "b_ctx.onnx").mkdir(parents=True)
    (folder / "b_ctx.onnx" / "mine.txt").write_text("mine")
    (folder / "a_ctx.onnx").write_text("an old file")
    proc = checkout.main("build", "--cache-only", "--cache", str(cache))
    assert proc.returncode == 1
    said = "build/pair/htp/b_ctx.onnx is a directory, where pair/htp puts an output file"
    assert said in proc.stderr and "move that directory away" in proc.stderr, proc.stderr
    assert (folder / "a_ctx.onnx").read_text() == "an old file"
    assert (folder / "b_ctx.onnx" / "mine.txt").read_text() == "mine"
    shutil.rmtree(folder / "b_ctx.onnx")
    assert checkout.main("build", "--cache-only", "--cache", str(cache)).returncode == 0
    assert checkout.cli("verify").returncode == 0


def test_status_does_not_promise_a_restore_whose_object_is_gone(
    seeded: tuple[Workspace, Path], tmp_path: Path
) -> None:
    """An entry whose object is gone (pruned by hand, lost): ``status`` said "in the cache: a
    build restores it", and the build compiled it."""
    ws, cache = seeded
    c_binary(ws, cache).unlink()
    checkout = fresh(ws.root, tmp_path / "checkout")
    doc = checkout.main_json("status", "--cache", str(cache))
    reasons = {a["id"]: a["reasons"][-1] for a in doc["actions"]}
    assert reasons == {
        "pair/htp": f"in the cache ({cache}): a build restores it",
        "single/htp/c": "not in the cache: its entry lacks the object of c_ctx_qnn.bin (a build "
        "discards it and runs this)",
    }
    proc = checkout.main("build", "--cache-only", "--cache", str(cache), "--json")
    outcomes = {a["id"]: a["outcome"] for a in json.loads(proc.stdout)["actions"]}
    assert outcomes == {"pair/htp": "restored", "single/htp/c": "failed"}
