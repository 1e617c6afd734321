"""The restore memo (``engine.restorememo``): a fresh checkout's ``build --cache-only``
answered from the directory cache's memo of the workspace, with the real QNN EP. It must
write exactly what the full path writes, miss on any difference (nothing written then), and
stay correct two at once and when a commit fails half-way."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import Workspace

from epbuild.cache.layout import RESTORES, object_path
from epbuild.engine import restorememo
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
def full_path_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any build that does not come from the memo fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the full build path ran")

    monkeypatch.setattr("epbuild.api.build", refuse)
    yield


@pytest.fixture
def memoized(simple_built: Workspace, tmp_path: Path) -> tuple[Workspace, Path, Path]:
    """A built workspace seeded into a directory cache, which writes the memo; and where
    its fresh checkouts go: (source workspace, cache, checkout path)."""
    cache = tmp_path / "cache"
    assert simple_built.build(cache=str(cache)).ok
    assert len(list((cache / RESTORES).iterdir())) == 1
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


def without_seconds(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    doc["summary"].pop("seconds")
    for a in doc["actions"]:
        a.pop("seconds")
    return doc


def test_fresh_checkout_restores_from_the_memo_as_the_full_path_does(
    memoized: tuple[Workspace, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, cache, where = memoized
    full = fresh(src.root, tmp_path / "full")
    with monkeypatch.context() as mp:
        mp.setattr(restorememo, "fast_restore", lambda *a: None)
        code, full_doc = restore(full, cache)  # the full path
    assert code == 0
    ws = fresh(src.root, where)
    with monkeypatch.context() as mp:
        mp.setattr("epbuild.api.build", lambda *a, **k: pytest.fail("the full path ran"))
        code, doc = restore(ws, cache)
    assert code == 0
    assert without_seconds(doc) == without_seconds(full_doc)
    assert tree(ws.root) == tree(full.root) == tree(src.root)
    assert journal_records(ws.root) == journal_records(full.root)
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


def test_restoring_keeps_the_entries_recently_used(
    memoized: tuple[Workspace, Path, Path], full_path_off: None
) -> None:
    src, cache, where = memoized
    entries = list((cache / "v1" / "entries").rglob("*.json"))
    for e in entries:
        os.utime(e, (1, 1))
    assert restore(fresh(src.root, where), cache)[0] == 0
    assert all(e.stat().st_mtime > 1 for e in entries)  # prune evicts by last use


def _changed_model(ws: Workspace) -> None:
    path = ws.root / "models" / "c.onnx"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, other bytes: only a content check sees it
    path.write_bytes(bytes(data))


def _edited_manifest(ws: Workspace) -> None:
    (ws.root / "epbuild.toml").write_text((ws.root / "epbuild.toml").read_text() + "\n")


def _journal_there(ws: Workspace) -> None:
    (ws.root / ".epbuild").mkdir()
    (ws.root / ".epbuild" / "state.jsonl").write_text('{"epbuild_state":1}\n')


def _output_there(ws: Workspace) -> None:
    (ws.root / "build" / "single" / "htp").mkdir(parents=True)
    (ws.root / "build" / "single" / "htp" / "c_ctx.onnx").write_text("mine")


@pytest.mark.parametrize(
    "change", [_changed_model, _edited_manifest, _journal_there, _output_there],
    ids=["input-bytes", "manifest", "journal", "output"],
)  # fmt: skip
def test_any_difference_is_a_miss_that_writes_nothing(
    memoized: tuple[Workspace, Path, Path], change: Any
) -> None:
    src, cache, where = memoized
    ws = fresh(src.root, where)
    change(ws)
    before = sorted(p.relative_to(ws.root) for p in ws.root.rglob("*"))
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is None
    assert sorted(p.relative_to(ws.root) for p in ws.root.rglob("*")) == before


def test_a_damaged_object_is_a_miss_and_the_full_path_discards_it(
    memoized: tuple[Workspace, Path, Path],
) -> None:
    src, cache, where = memoized
    ws = fresh(src.root, where)
    state = load_state(str(src.root / ".epbuild" / "state.jsonl"))
    digest = state.records["single/htp/c"].outputs["build/single/htp/c_ctx_qnn.bin"].digest
    obj = cache / object_path(digest)
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[100] ^= 0xFF
    obj.write_bytes(bytes(data))  # same size; its stat no longer the verified one
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is None
    assert not (ws.root / ".epbuild" / "state.jsonl").exists()
    assert not list(ws.root.glob("build/*/*/*"))
    code, doc = restore(ws, cache)  # the full path: discards the entry, restores the rest
    assert code == 1 and doc["summary"]["restored"] == 1 and doc["summary"]["failed"] == 1
    failed = [a for a in doc["actions"] if a["outcome"] == "failed"]
    assert "is damaged" in failed[0]["error"] and "discarded" in failed[0]["error"], doc


def test_a_removed_entry_is_a_miss(memoized: tuple[Workspace, Path, Path]) -> None:
    src, cache, where = memoized
    for entry in (cache / "v1" / "entries").rglob("*.json"):
        entry.unlink()
        break
    ws = fresh(src.root, where)
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is None
    assert not (ws.root / ".epbuild").exists()


def test_a_file_new_in_a_globbed_directory_is_a_miss(
    simple_built: Workspace, tmp_path: Path
) -> None:
    manifest = simple_built.root / "epbuild.toml"
    manifest.write_text(manifest.read_text().replace('"models/c.onnx"', '"models/c*.onnx"'))
    cache, where = tmp_path / "cache", tmp_path / "checkout"
    assert simple_built.build(cache=str(cache)).ok
    ws = fresh(simple_built.root, where)
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is not None
    ws = fresh(simple_built.root, where)
    (ws.root / "models" / "c2.onnx").write_bytes((ws.root / "models" / "c.onnx").read_bytes())
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is None


def test_an_installed_distribution_is_a_miss(
    simple_built: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    cache, where = tmp_path / "cache", tmp_path / "checkout"
    assert simple_built.build(cache=str(cache)).ok  # writes the memo
    (site / "onnxruntime_qnn-9.9.9.dist-info").mkdir()
    ws = fresh(simple_built.root, where)
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is None


def test_a_commit_that_fails_half_way_leaves_the_full_path_a_true_state(
    memoized: tuple[Workspace, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, cache, where = memoized
    real = restorememo.commit_journaled
    calls: list[str] = []

    def second_fails(*args: Any, **kwargs: Any) -> None:
        calls.append(args[4]["id"])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(*args, **kwargs)

    monkeypatch.setattr(restorememo, "commit_journaled", second_fails)
    ws = fresh(src.root, where)
    code, doc = restore(ws, cache)  # the memo commits one, then the full path takes over
    assert code == 0, doc
    assert len(calls) == 2
    assert doc["summary"]["restored"] == 1 and doc["summary"]["up_to_date"] == 1
    assert tree(ws.root) == tree(src.root)
    status = ws.cli_json("status")
    assert [a["stale"] for a in status["actions"]] == [False, False]


def test_no_memo_for_a_selection_or_without_a_directory_cache(
    simple_built: Workspace, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    assert simple_built.build("single", cache=str(cache)).ok
    assert not (cache / RESTORES).exists()
    assert simple_built.build().ok  # the cache is off (EPBUILD_CACHE=off)
    assert not (cache / RESTORES).exists()


def test_prune_drops_the_memos_of_evicted_entries(
    memoized: tuple[Workspace, Path, Path],
) -> None:
    src, cache, _ = memoized
    assert (
        main(["-C", str(src.root), "cache", "prune", "--max-size", "0", "--cache", str(cache)]) == 0
    )
    assert not list((cache / RESTORES).rglob("*.json"))


def test_two_restores_at_once_from_one_memo(
    memoized: tuple[Workspace, Path, Path], tmp_path: Path
) -> None:
    """Both wait on an action lock this test holds, then race: each action is committed
    once, both say success, and what they say is true."""
    src, cache, where = memoized
    ws = fresh(src.root, where)
    # the memo of a `python -m epbuild` process (its sys.path starts with its directory)
    env = {**os.environ, "EPBUILD_CACHE": "off"}
    cmd = [sys.executable, "-m", "epbuild", "-C", str(ws.root), "build", "--cache-only",
           "--cache", str(cache), "--json"]  # fmt: skip
    assert subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True).returncode == 0
    ws = fresh(src.root, where)  # (the racers run in it: another current directory)
    ids = sorted(load_state(str(src.root / ".epbuild" / "state.jsonl")).records)
    from epbuild.kinds.contract import ActionIdentity

    def lock_of(action_id: str) -> str:
        ident = ActionIdentity()
        ident.id = action_id
        return str(ws.root / ".epbuild" / "locks" / f"{ident.slug}.lock")

    lock = min(lock_of(i) for i in ids)  # the memo takes the action locks in path order
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
    assert sorted((d["restored"], d["up_to_date"]) for d in docs) == [(0, 2), (2, 0)]
    done = [r["id"] for r in journal_records(ws.root) if r.get("op") == "done"]
    assert sorted(done) == ids
    trace = json.loads((ws.root / ".epbuild" / "trace.json").read_text())
    assert "lock" in {e["name"] for e in trace["traceEvents"]}  # the memo's one span of locks
    assert tree(ws.root) == tree(src.root)


def _memo_of(cache: Path, ws: Workspace) -> Path:
    raw = (ws.root / "epbuild.toml").read_bytes()
    return cache / restorememo.memo_path_of(str(ws.root / "epbuild.toml"), raw, str(cache))


@pytest.mark.parametrize("tamper", ["truncated", "out_dir", "output", "input"])
def test_a_damaged_or_hostile_memo_is_a_miss(
    memoized: tuple[Workspace, Path, Path], tmp_path: Path, tamper: str
) -> None:
    """A shared cache directory is not trusted further than its entries: a memo of
    another shape, or one whose paths lead out of the workspace, is never followed."""
    src, cache, where = memoized
    ws = fresh(src.root, where)
    path = _memo_of(cache, ws)
    memo = json.loads(path.read_text())
    first = memo["actions"][0]
    if tamper == "truncated":
        path.write_text(path.read_text()[:200])
    else:
        if tamper == "out_dir":
            memo["out_dir"] = "../outside"
        elif tamper == "output":
            outputs = first["record"]["outputs"]
            outputs["../../outside.bin"] = outputs.popitem()[1]
        else:
            memo["inputs"]["/etc/hostname"] = ["0" * 64, None]
        path.write_text(json.dumps(memo))
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is None
    assert not (ws.root / ".epbuild").exists() and not (ws.root / "build").exists()
    assert not (tmp_path / "outside").exists() and not (tmp_path / "outside.bin").exists()
    code, doc = restore(ws, cache)  # the full path, from the entries: all restored
    assert code == 0 and doc["summary"]["restored"] == 2


def test_a_cache_keeps_only_its_most_recently_used_memos(
    simple_built: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(restorememo, "KEPT", 2)
    cache = tmp_path / "cache"
    manifest = simple_built.root / "epbuild.toml"
    for n in range(4):  # each edit of the manifest's bytes is another memo
        manifest.write_text(manifest.read_text() + f"# edit {n}\n")
        assert simple_built.build(cache=str(cache)).ok
    kept = list((cache / RESTORES).iterdir())
    assert len(kept) == 2 and _memo_of(cache, simple_built) in kept  # the latest among them


def test_a_checkout_at_another_path_restores_from_the_memo(
    memoized: tuple[Workspace, Path, Path], tmp_path: Path, full_path_off: None
) -> None:
    src, cache, _ = memoized
    for n in range(2):
        ws = fresh(src.root, tmp_path / f"elsewhere-{n}" / "ws")
        code, doc = restore(ws, cache)
        assert code == 0 and doc["summary"]["restored"] == 2
        assert tree(ws.root) == tree(src.root)


def test_a_memo_of_ctx_models_holding_absolute_paths_is_bound_to_its_path(
    simple_built: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full path's restore checks a ctx model's text against the checkout's paths:
    where the text holds any absolute path, the memo answers at its own path only."""
    monkeypatch.setattr(restorememo, "_paths_in_text", lambda *a: True)
    cache = tmp_path / "cache"
    assert simple_built.build(cache=str(cache)).ok
    memo = json.loads(_memo_of(cache, simple_built).read_text())
    assert memo["root"] == str(simple_built.root)
    elsewhere = fresh(simple_built.root, tmp_path / "elsewhere")
    assert restorememo.fast_restore(str(elsewhere.root), None, str(cache), None) is None
    shutil.rmtree(simple_built.root / "build")
    shutil.rmtree(simple_built.root / ".epbuild")
    doc = restorememo.fast_restore(str(simple_built.root), None, str(cache), None)
    assert doc is not None and doc["summary"]["restored"] == 2


def test_what_cannot_be_saved_after_the_commits_is_a_warning(
    memoized: tuple[Workspace, Path, Path], monkeypatch: pytest.MonkeyPatch, full_path_off: None
) -> None:
    """As the full path: a stat cache a full disk cannot take costs re-hashing later, never
    the restore; a dead run's staging directory is removed."""
    from epbuild.state.statcache import StatCache

    def full_disk(self: StatCache) -> None:
        raise OSError(28, "No space left on device", self.path)

    monkeypatch.setattr(StatCache, "save", full_disk)
    src, cache, where = memoized
    ws = fresh(src.root, where)
    dead = ws.root / "build" / ".staging" / "0123456789abcdef-999999999"
    dead.mkdir(parents=True)
    code, doc = restore(ws, cache)
    assert code == 0 and doc["summary"]["restored"] == 2
    (warning,) = doc["warnings"]
    assert warning["message"].startswith("the stat cache was not saved: ")
    assert "No space left on device" in warning["message"]
    assert tree(ws.root) == tree(src.root) and not dead.exists()


def test_models_of_real_exporters_with_external_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch.onnx CNN whose weights are in an external-data file, and a BERT export: the
    memo lists the data file as an input (by content), so a changed weight is a miss."""
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
    assert src.build(cache=str(cache)).ok  # writes the memo
    memo = json.loads(_memo_of(cache, src).read_text())
    assert "models/cnn.onnx.data" in memo["inputs"]
    ws = fresh(src.root, where)
    with monkeypatch.context() as mp:
        mp.setattr("epbuild.api.build", lambda *a, **k: pytest.fail("the full path ran"))
        code, doc = restore(ws, cache)
    assert code == 0 and doc["summary"]["restored"] == 2
    assert tree(ws.root) == tree(src.root)
    ws = fresh(src.root, where)
    data = ws.root / "models" / "cnn.onnx.data"
    weights = bytearray(data.read_bytes())
    weights[-1] ^= 1
    data.write_bytes(bytes(weights))
    assert restorememo.fast_restore(str(ws.root), None, str(cache), None) is None


def test_a_plain_build_in_a_fresh_checkout_restores_from_the_memo(
    memoized: tuple[Workspace, Path, Path], full_path_off: None
) -> None:
    """Without --cache-only too: a memo answers only where every action restores, which is
    what the full path would do there."""
    import contextlib
    import io

    src, cache, where = memoized
    ws = fresh(src.root, where)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["-C", str(ws.root), "build", "--cache", str(cache)]) == 0
    assert out.getvalue().startswith("epbuild: 2 restored in ")
    assert tree(ws.root) == tree(src.root)


def test_a_glob_over_the_directory_holding_the_outputs(
    simple_ws: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``out_dir`` inside the globbed directory: a fresh checkout lacks it, the memo's
    listing leaves it out (as globs do), so the memo still answers."""
    ws = simple_ws()
    manifest = ws.root / "epbuild.toml"
    text = manifest.read_text().replace('"models/c.onnx"', '"models/c*.onnx"')
    manifest.write_text('[workspace]\nout_dir = "models/build"\n\n' + text)
    cache, where = tmp_path / "cache", tmp_path / "checkout"
    assert ws.build(cache=str(cache)).ok  # writes the memo (its listing without build/)
    checkout = fresh(ws.root, where)
    with monkeypatch.context() as mp:
        mp.setattr("epbuild.api.build", lambda *a, **k: pytest.fail("the full path ran"))
        code, doc = restore(checkout, cache)
    assert code == 0 and doc["summary"]["restored"] == 2
