"""A fresh checkout's restore and the ``cache`` commands under a careless user or another
user of a shared cache, with the real QNN EP on tiny models: a restore that cannot write
the workspace blames the disk, not the cache; an object that cannot be read, or a link
planted in its place, is damage that the next build repairs; ``--cache-only`` with the
cache turned off is one user error; an export never writes into the cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
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
