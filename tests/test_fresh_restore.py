"""A fresh checkout's restore from a directory cache (the CI case), with the real QNN EP:
``build --cache-only`` (or a plain ``build``) in a copy of the sources without outputs or
state writes what the build wrote, and what it records is what the next command trusts;
two at once, a damaged object, a checkout at another path, a disk that cannot take the stat
cache."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import Workspace

from epbuild.cache.layout import object_path
from epbuild.frontends.cli import main
from epbuild.state import locks
from epbuild.state.journal import load_state

pytestmark = pytest.mark.timeout(600)


def fresh(src: Path, dest: Path) -> Workspace:
    """A fresh checkout of ``src`` at ``dest``: its sources, no outputs, no state."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("build", ".epbuild"))
    return Workspace(dest)


def restore(ws: Workspace, cache: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """``epbuild build --cache-only --cache CACHE --json`` in this process: (code, doc)."""
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["-C", str(ws.root), "build", "--cache-only", "--cache", str(cache),
                     "--json", *extra])  # fmt: skip
    return code, json.loads(out.getvalue())


@pytest.fixture
def seeded(simple_built: Workspace, tmp_path: Path) -> tuple[Workspace, Path, Path]:
    """A built workspace seeded into a directory cache; and where its fresh checkouts go:
    (source workspace, cache, checkout path)."""
    cache = tmp_path / "cache"
    assert simple_built.build(cache=str(cache)).ok
    return simple_built, cache, tmp_path / "checkout"


def journal_records(root: Path) -> list[dict[str, Any]]:
    """The journal's lines, without what differs run to run (time, pid; the order of
    actions committed by two slots)."""
    lines = (root / ".epbuild" / "state.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        r.pop("at", None)
        r.pop("pid", None)
    return sorted(records, key=lambda r: (r.get("id", ""), r.get("op", "")))  # any order


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted((root / "build").rglob("*")) if p.is_file()}  # fmt: skip


def test_a_fresh_checkout_restores_what_the_build_wrote(
    seeded: tuple[Workspace, Path, Path],
) -> None:
    src, cache, where = seeded
    ws = fresh(src.root, where)
    code, doc = restore(ws, cache)
    assert code == 0 and doc["summary"]["restored"] == 2, doc
    assert tree(ws.root) == tree(src.root)
    state = load_state(str(ws.root / ".epbuild" / "state.jsonl"))
    assert all(r.restored for r in state.records.values()) and not state.interrupted
    for name in ("statcache.json", "trace.json"):
        assert (ws.root / ".epbuild" / name).is_file()
    assert not list((ws.root / "build").glob(".staging/*"))
    # what the fast path wrote is what the full path trusts: up to date, nothing to do
    status = ws.cli_json("status")
    assert [a["stale"] for a in status["actions"]] == [False, False]
    again = ws.cli_json("build")
    assert again["summary"]["up_to_date"] == 2


def test_restoring_keeps_the_entries_recently_used(seeded: tuple[Workspace, Path, Path]) -> None:
    src, cache, where = seeded
    entries = list((cache / "v1" / "entries").rglob("*.json"))
    for e in entries:
        os.utime(e, (1, 1))
    assert restore(fresh(src.root, where), cache)[0] == 0
    assert all(e.stat().st_mtime > 1 for e in entries)  # prune evicts by last use


def test_a_restore_imports_only_what_it_uses(seeded: tuple[Workspace, Path, Path]) -> None:
    """The one path stays lean: no onnx, no numpy, no worker machinery (it starts no
    worker), not the standard ``dataclasses`` (it imports ``inspect``; the package's
    dataclasses are made without it)."""
    src, cache, where = seeded
    ws = fresh(src.root, where)
    code = (
        "import sys; from epbuild.frontends.cli import main; "
        "rc = main(['-C', sys.argv[1], 'build', '--cache-only', '--cache', sys.argv[2]]); "
        "heavy = ('dataclasses', 'inspect', 'onnx', 'onnxruntime', 'numpy', "
        "'epbuild.executors.local'); "
        "print('LOADED', [m for m in heavy if m in sys.modules]); sys.exit(rc)"
    )
    env = {**os.environ, "EPBUILD_CACHE": "off"}
    proc = waits.run([sys.executable, "-c", code, str(ws.root), str(cache)], "the restore", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
    assert "2 restored" in proc.stdout + proc.stderr


def test_a_damaged_object_is_discarded_and_the_rest_restored(
    seeded: tuple[Workspace, Path, Path],
) -> None:
    src, cache, where = seeded
    ws = fresh(src.root, where)
    state = load_state(str(src.root / ".epbuild" / "state.jsonl"))
    digest = state.records["single/htp/c"].outputs["build/single/htp/c_ctx_qnn.bin"].digest
    obj = cache / object_path(digest)
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[100] ^= 0xFF
    obj.write_bytes(bytes(data))  # same size; its stat no longer the verified one
    code, doc = restore(ws, cache)  # discards the entry, restores the rest
    assert code == 1 and doc["summary"]["restored"] == 1 and doc["summary"]["failed"] == 1
    failed = [a for a in doc["actions"] if a["outcome"] == "failed"]
    assert "is damaged" in failed[0]["error"] and "discarded" in failed[0]["error"], doc


def test_two_restores_at_once(seeded: tuple[Workspace, Path, Path], tmp_path: Path) -> None:
    """Both wait on an action lock this test holds, then race: each action is committed
    once, both say success, and what they say is true."""
    src, cache, where = seeded
    ws = fresh(src.root, where)
    env = {**os.environ, "EPBUILD_CACHE": "off"}
    cmd = [sys.executable, "-m", "epbuild", "-C", str(ws.root), "build", "--cache-only",
           "--cache", str(cache), "--json"]  # fmt: skip
    ids = sorted(load_state(str(src.root / ".epbuild" / "state.jsonl")).records)
    from epbuild.kinds.contract import ActionIdentity

    def lock_of(action_id: str) -> str:
        ident = ActionIdentity()
        ident.id = action_id
        return str(ws.root / ".epbuild" / "locks" / f"{ident.slug}.lock")

    lock = lock_of(ids[0])
    errs = [tmp_path / f"err-{i}" for i in range(2)]
    docs = []
    with contextlib.ExitStack() as files:
        handles = [files.enter_context(e.open("w")) for e in errs]
        with locks.hold(lock, "the test"):
            procs = [subprocess.Popen(cmd, cwd=ws.root, env=env, stdout=subprocess.PIPE,
                                      stderr=h, text=True) for h in handles]  # fmt: skip
            waits.wait_for(
                lambda: all("waiting for the test" in e.read_text() for e in errs),
                "both restores to wait for the held lock",
            )
        for p in procs:
            out, _ = waits.communicate(p, "a restore to finish")
            assert p.returncode == 0, out
            docs.append(json.loads(out)["summary"])
    assert all(d["restored"] + d["up_to_date"] == 2 for d in docs), docs
    assert sum(d["restored"] for d in docs) == 2, docs
    done = [r["id"] for r in journal_records(ws.root) if r.get("op") == "done"]
    assert sorted(done) == ids
    assert tree(ws.root) == tree(src.root)


def test_checkouts_at_other_paths_restore(
    seeded: tuple[Workspace, Path, Path], tmp_path: Path
) -> None:
    src, cache, _ = seeded
    for n in range(2):
        ws = fresh(src.root, tmp_path / f"elsewhere-{n}" / "ws")
        code, doc = restore(ws, cache)
        assert code == 0 and doc["summary"]["restored"] == 2
        assert tree(ws.root) == tree(src.root)


def test_what_cannot_be_saved_after_the_commits_is_a_warning(
    seeded: tuple[Workspace, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stat cache a full disk cannot take costs re-hashing later, never
    the restore; a dead run's staging directory is removed."""
    from epbuild.state.statcache import StatCache

    def full_disk(self: StatCache) -> None:
        raise OSError(28, "No space left on device", self.path)

    monkeypatch.setattr(StatCache, "save", full_disk)
    src, cache, where = seeded
    ws = fresh(src.root, where)
    dead = ws.root / "build" / ".staging" / "0123456789abcdef-999999999"
    dead.mkdir(parents=True)
    code, doc = restore(ws, cache)
    assert code == 0 and doc["summary"]["restored"] == 2
    (warning,) = doc["warnings"]
    assert warning["message"].startswith("the stat cache was not saved: ")
    assert "No space left on device" in warning["message"]
    assert tree(ws.root) == tree(src.root) and not dead.exists()


def test_models_of_real_exporters_with_external_data(tmp_path: Path) -> None:
    """A torch.onnx CNN whose weights are in an external-data file, and a BERT export,
    restore; the data file is an input (by content): a changed weight is a miss."""
    import onnx
    from conftest import HTP73

    corpus = Path(__file__).parent / "corpus"
    src = Workspace(tmp_path / "src")
    (src.root / "models").mkdir(parents=True)
    cnn = onnx.load(str(corpus / "cnn_torchscript.onnx"))
    onnx.save(cnn, str(src.root / "models" / "cnn.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="cnn.onnx.data", size_threshold=0)  # fmt: skip
    shutil.copy(corpus / "bert_torchscript.onnx", src.root / "models" / "bert.onnx")
    src.manifest({
        "providers": {"htp": HTP73},
        "groups": {
            "cnn": {"models": ["models/cnn.onnx"], "providers": ["htp"]},
            "bert": {"models": ["models/bert.onnx"], "providers": ["htp"],
                     "free_dimensions": {"batch": 1, "sequence_length": 8}},
        },
    })  # fmt: skip
    cache, where = tmp_path / "cache", tmp_path / "checkout"
    assert src.build(cache=str(cache)).ok
    ws = fresh(src.root, where)
    code, doc = restore(ws, cache)
    assert code == 0 and doc["summary"]["restored"] == 2
    assert tree(ws.root) == tree(src.root)
    ws = fresh(src.root, where)
    data = ws.root / "models" / "cnn.onnx.data"
    weights = bytearray(data.read_bytes())
    weights[-1] ^= 1
    data.write_bytes(bytes(weights))
    code, doc = restore(ws, cache)
    assert code == 1 and doc["summary"]["restored"] == 1 and doc["summary"]["failed"] == 1
    (failed,) = [a for a in doc["actions"] if a["outcome"] == "failed"]
    assert failed["id"] == "cnn/htp/cnn" and "not in the cache" in failed["error"], doc


def test_a_plain_build_in_a_fresh_checkout_restores(
    seeded: tuple[Workspace, Path, Path],
) -> None:
    """Without --cache-only too: every action restores, none compiles."""
    import contextlib
    import io

    src, cache, where = seeded
    ws = fresh(src.root, where)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["-C", str(ws.root), "build", "--cache", str(cache)]) == 0
    assert out.getvalue().startswith("epbuild: 2 restored in ")
    assert tree(ws.root) == tree(src.root)


def test_a_glob_over_the_directory_holding_the_outputs(simple_ws: Any, tmp_path: Path) -> None:
    """``out_dir`` inside the globbed directory: a fresh checkout lacks it, the glob leaves
    it out, every action restores."""
    ws = simple_ws()
    manifest = ws.root / "epbuild.toml"
    text = manifest.read_text().replace('"models/c.onnx"', '"models/c*.onnx"')
    manifest.write_text('[workspace]\nout_dir = "models/build"\n\n' + text)
    cache, where = tmp_path / "cache", tmp_path / "checkout"
    assert ws.build(cache=str(cache)).ok
    checkout = fresh(ws.root, where)
    code, doc = restore(checkout, cache)
    assert code == 0 and doc["summary"]["restored"] == 2
