"""Writing commands beside another command on the same workspace, and killed mid-way: every
verdict stays true (verify, status, exit 0) and nothing half-written is left in a user's
folder. (Two builds: tests/test_concurrency.py; two of one command: tests/test_two_at_once.py;
kills of a build: tests/test_crash.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import Workspace
from modelgen import matmul_model
from test_concurrency import _hold

from epbuild.api import status
from epbuild.cache.operations import export_cache, prune_cache, verify_cache
from epbuild.cache.store import Store
from epbuild.frontends import lock_cli
from epbuild.fs import atomic_write_bytes, temp_name
from epbuild.inspection import verify as verify_module
from epbuild.planning.workspace import open_workspace
from epbuild.shipping import writer
from epbuild.state.journal import load_state


def test_verify_beside_a_build_that_replaces_the_outputs_finds_nothing_wrong(
    simple_built: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that recompiles an action after verify read the journal and before it hashed
    the files: the new outputs are checked against the new record, not reported damaged."""
    ws = simple_built
    ws.model("models/c.onnx", matmul_model(77))
    opened = verify_module.open_workspace

    def open_then_rebuild(*args: Any, **kw: Any) -> Any:
        found = opened(*args, **kw)  # the journal as it was: single/htp/c's old record
        ws.cli("build", check=True)  # another process recompiles single/htp/c meanwhile
        return found

    monkeypatch.setattr(verify_module, "open_workspace", open_then_rebuild)
    result = verify_module.verify_outputs(ws.root)
    assert result.ok, result.lines()
    state = load_state(str(ws.root / ".epbuild" / "state.jsonl"))
    assert not state.damaged, state.damaged
    assert (ws.root / "build" / "single" / "htp" / "c_ctx.onnx").is_file()


def test_a_killed_writers_temp_is_removed_by_the_next_write(tmp_path: Path) -> None:
    """Of the temps beside a user's file, those whose writers died on this host go; a live
    writer's, another host's and look-alikes stay."""
    target = tmp_path / "epbuild.lock"
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    dead = Path(temp_name(str(target)).replace(f"-{os.getpid()}-", f"-{done.pid}-", 1))
    live = Path(temp_name(str(target)))  # this process's: it is alive
    other_host = Path(f"{target}.tmp-{done.pid}-00000000-0badcafe")
    mine = tmp_path / f"epbuild.lock.tmp-{done.pid}-notes"
    for p in (dead, live, other_host, mine):
        p.write_text("half")
    atomic_write_bytes(str(target), b"whole", leftovers=True)
    assert target.read_bytes() == b"whole"
    assert not dead.exists()
    assert live.exists() and other_host.exists() and mine.exists()


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


@pytest.mark.slow  # export killed until a kill lands mid-write
def test_an_export_killed_mid_write_leaves_nothing_once_run_again(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    ws = simple_ws()
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    assert ws.build(cache=str(cache)).ok
    archive = out / "ci.tar"
    export = ("cache", "export", str(archive), "--cache", str(cache))
    landed = 0
    for _ in range(20):  # each try kills the export once its temp is there, if it is still running
        proc = subprocess.Popen([sys.executable, "-m", "epbuild", "-C", str(ws.root), *export],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        waits.wait_for(lambda: _temps(out) or proc.poll() is not None,  # noqa: B023
                       "the export's temp file (or its end)", interval=0.001)  # fmt: skip
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        if proc.returncode == -signal.SIGKILL and _temps(out):
            landed += 1
            if landed == 2:
                break
    assert landed, "no kill landed while the export wrote its temp file"
    again = ws.cli(*export)
    assert again.returncode == 0, again.stderr
    assert _temps(out) == [], "a killed export's temp file was left in the user's folder"
    imported = ws.cli("cache", "import", str(archive), "--cache", str(tmp_path / "other"))
    assert imported.returncode == 0 and "2 entr(ies), 5 object(s)" in imported.stdout, imported


def test_prune_beside_a_build_storing_an_entry_that_shares_an_evicted_object(
    simple_ws: Callable[..., Workspace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build stores an entry whose object an entry being evicted also uses (a ctx model
    recompiled with new weights: the same ctx file, a new binary) while prune runs: the
    object is spared, as the store marked it used, and the new entry stays whole."""
    ws = simple_ws()
    cache = tmp_path / "cache"
    assert ws.build(cache=str(cache)).ok
    ws.model("models/c.onnx", matmul_model(77))
    discard = Store.discard
    stored: list[str] = []

    def discard_after_a_store(self: Store, *args: Any, **kw: Any) -> None:
        if not stored:  # prune listed the entries; another process stores meanwhile
            stored.append(ws.cli("build", "--cache", str(cache), check=True).stderr)
        discard(self, *args, **kw)

    monkeypatch.setattr(Store, "discard", discard_after_a_store)
    prune_cache(1, ws.root, cache=str(cache))
    assert stored and "compiled single/htp/c" in stored[0], stored
    monkeypatch.undo()
    checked = ws.cli("cache", "verify", "--cache", str(cache))
    assert checked.returncode == 0 and "0 discarded" in checked.stdout, checked
    ws.cli("clean", check=True)
    restored = ws.cli("build", "--cache-only", "single", "--cache", str(cache))
    assert restored.returncode == 0 and "restored single/htp/c" in restored.stderr, restored


def test_verify_honours_lock_timeout_when_recording_damage(simple_built: Workspace) -> None:
    """Recording damage takes the state lock: verify --lock-timeout bounds that wait (it
    waited a minute whatever was asked); the damage is still reported, the failed record
    named in a warning with the holder."""
    ws = simple_built
    binary = ws.root / "build" / "single" / "htp" / "c_ctx_qnn.bin"
    data = bytearray(binary.read_bytes())
    data[100] ^= 0xFF
    binary.write_bytes(bytes(data))
    holder = _hold(ws.root / ".epbuild" / "state.lock")
    try:
        proc = ws.cli("verify", "--lock-timeout", "0.5")
    finally:
        holder.kill()
        holder.communicate()
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout + proc.stderr
    assert "c_ctx_qnn.bin: content does not match the digest recorded" in out, out
    assert "could not record the damage" in out and "timed out after 0.5s" in out, out
    assert f"pid {holder.pid}" in out and "Traceback" not in out, out


def test_cache_verify_beside_a_prune_reports_no_damage(
    simple_ws: Callable[..., Workspace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries a prune removes after cache verify listed them are gone, not damaged: cache
    verify reported each as "missing or damaged; discarded" and exited 1."""
    ws = simple_ws()
    cache = tmp_path / "cache"
    assert ws.build(cache=str(cache)).ok
    get_entry = Store.get_entry
    pruned: list[str] = []

    def read_then_prune(self: Store, key: str) -> Any:
        entry = get_entry(self, key)
        if not pruned:  # another process prunes everything once verify read an entry
            prune = ws.cli("cache", "prune", "--max-size", "1", "--cache", str(cache), check=True)
            pruned.append(prune.stdout)
        return entry

    monkeypatch.setattr(Store, "get_entry", read_then_prune)
    report = verify_cache(ws.root, cache=str(cache))
    assert pruned and "removed 2 entr(ies)" in pruned[0], pruned
    assert report.problems == [], report.problems


def test_cache_export_beside_a_prune_lists_what_went_missing(
    simple_ws: Callable[..., Workspace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries a prune removes after export read them are listed as missing (exit 1), and
    the archive holds the others whole; the export failed on the first vanished object
    with a message that blamed the disk."""
    ws = simple_ws()
    cache = tmp_path / "cache"
    assert ws.build(cache=str(cache)).ok
    get_entry = Store.get_entry
    pruned: list[str] = []

    def read_then_prune(self: Store, key: str) -> Any:
        entry = get_entry(self, key)
        if entry is not None and entry.id == "single/htp/c" and not pruned:
            # once export read both entries, another process evicts pair/htp's (the larger)
            size = sum(o.size for o in entry.outputs.values()) + 1
            args = ("cache", "prune", "--max-size", str(size), "--cache", str(cache))
            pruned.append(ws.cli(*args, check=True).stdout)
        return entry

    monkeypatch.setattr(Store, "get_entry", read_then_prune)
    archive = tmp_path / "ci.tar"
    report = export_cache(archive, ws.root, cache=str(cache))
    assert pruned, "the prune did not run"
    (missing,) = report.missing
    assert missing.startswith("pair/htp: ") and "removed from the cache" in missing, missing
    assert report.entries == 1 and archive.is_file()
    imported = ws.cli("cache", "import", str(archive), "--cache", str(tmp_path / "other"))
    assert imported.returncode == 0 and "imported 1 entr(ies)" in imported.stdout, imported


def test_lock_beside_an_edit_of_the_manifest_writes_the_lock_of_the_edited_one(
    simple_ws: Callable[..., Workspace], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``add`` lands while ``lock`` gathers the environments: the lock written is the edited
    manifest's (it said "written" and was out of date with the manifest at once)."""
    ws = simple_ws()
    gather = lock_cli.gather
    edits: list[str] = []

    def gather_beside_an_edit(*args: Any, **kw: Any) -> Any:
        found = gather(*args, **kw)
        if not edits:
            edit = ("add", "provider", "v75", "--ep", "qnn", "--option", "htp_arch=75")
            edits.append(ws.cli(*edit, "--option", "soc_model=57", check=True).stdout)
        return found

    monkeypatch.setattr(lock_cli, "gather", gather_beside_an_edit)
    assert ws.main("lock", check=True).returncode == 0
    assert edits and "added provider v75" in edits[0], edits
    checked = ws.main("lock", "--check")
    assert checked.returncode == 0, checked.stderr
    assert "[providers.v75]" in (ws.root / "epbuild.lock").read_text()


def test_package_beside_a_clean_says_the_outputs_went(
    simple_built: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean removes the outputs while package links them: package fails naming the
    output that went and what to do, nothing half-made left (the message blamed
    permissions and free space)."""
    ws = simple_built
    dest = tmp_path / "pkg"
    try_link = writer._try_link
    cleaned: list[str] = []

    def clean_then_link(source: str, target: str) -> bool:
        if not cleaned:
            cleaned.append(ws.cli("clean", check=True).stdout)
        return try_link(source, target)

    monkeypatch.setattr(writer, "_try_link", clean_then_link)
    proc = ws.main("package", "-o", str(dest))
    assert cleaned and proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "was removed while it was packaged" in proc.stderr, proc.stderr
    assert "free space" not in proc.stderr and "Traceback" not in proc.stderr
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if ".pkg.epbuild-" in p.name]


def test_clean_orphaned_goes_by_the_manifest_as_it_is_once_it_holds_the_state_lock(
    simple_built: Workspace,
) -> None:
    """``clean --orphaned`` read a manifest without ``single``, then waited for the state
    lock while ``single`` came back and was built: the action is no orphan any more, and its
    outputs stay."""
    ws = simple_built
    manifest = ws.root / "epbuild.toml"
    full = manifest.read_text()
    lock = Path(open_workspace(ws.root).state_lock)
    kept = ws.root / "build" / "single" / "htp"
    assert any(kept.iterdir())
    holder = _hold(lock)
    err_path = ws.root.parent / "clean.err"
    try:
        manifest.write_text(full.split("[groups.single]")[0])  # single removed
        with open(err_path, "w+") as err:
            clean = subprocess.Popen(
                [sys.executable, "-m", "epbuild", "-C", str(ws.root), "clean", "--orphaned"],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
            waits.wait_for(
                lambda: "waiting for" in err_path.read_text(),
                "clean --orphaned to wait for the state lock",
                proc=clean,
                output=err_path.read_text,
            )
            manifest.write_text(full)  # single back (as an add would put it)
    finally:
        waits.communicate(holder, "the holder to release the state lock")
    waits.communicate(clean, "clean --orphaned to finish")
    assert clean.returncode == 0, err_path.read_text()
    assert any(kept.iterdir()), "clean --orphaned removed the outputs of an action it has"
    assert not any(a.stale for a in status(ws.root).actions)
