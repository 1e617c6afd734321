"""The cache, restore and output-directory flows of a compile workspace under a hostile user
or CI runner, with the real QNN EP on tiny models: a verdict ("restored", "up to date",
exit 0) is true, and no command removes an output the manifest still owns or a user's
file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Workspace

pytestmark = pytest.mark.timeout(600)


def stale(ws: Workspace) -> dict[str, list[str]]:
    """``status``: each stale action's reasons."""
    doc = ws.main_json("status")
    return {a["id"]: a["reasons"] for a in doc["actions"] if a["stale"]}


def files(ws: Workspace, top: str = "build") -> list[str]:
    """The files under ``top`` (workspace-relative), less staging."""
    base = ws.root / top
    return sorted(str(p.relative_to(ws.root)) for p in base.rglob("*")
                  if p.is_file() and ".staging" not in p.parts)  # fmt: skip


def test_a_restore_under_a_renamed_group_and_provider_is_recorded_under_the_new_names(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    """The names of a group and its provider are not in the key: a renamed pair restores the
    entry the old names stored, and that restore is recorded under the new action id (not
    the id the entry was stored under), so the workspace is up to date after it and
    ``clean --orphaned`` removes the old names' outputs, not the new ones."""
    ws = simple_ws()
    cache = str(tmp_path / "cache")
    assert ws.main_json("build", "--cache", cache)["ok"]
    text = (ws.root / "epbuild.toml").read_text()
    renamed = text.replace("[groups.pair]", "[groups.duo]")
    renamed = renamed.replace("[providers.htp]", "[providers.npu]").replace('"htp"', '"npu"')
    (ws.root / "epbuild.toml").write_text(renamed)

    doc = ws.main_json("build", "--cache", cache)
    assert doc["ok"] and {a["outcome"] for a in doc["actions"]} == {"restored"}, doc
    assert stale(ws) == {}
    assert ws.main_json("build", "--cache", cache)["summary"]["restored"] == 0

    now = files(ws, "build/duo") + files(ws, "build/single/npu")
    assert ws.main("clean", "--orphaned").returncode == 0
    assert files(ws) == now
    assert stale(ws) == {}


def test_clean_orphaned_after_out_dir_became_its_own_link_target_keeps_the_outputs(
    simple_ws: Callable[..., Workspace],
) -> None:
    """``out_dir`` named a link to a directory of the workspace, then that directory: the old
    place's outputs are the new place's files, reached by another path, and
    ``clean --orphaned`` leaves them."""
    ws = simple_ws()
    (ws.root / "real").mkdir()
    (ws.root / "link").symlink_to("real")
    manifest = ws.root / "epbuild.toml"
    text = manifest.read_text()
    manifest.write_text('[workspace]\nout_dir = "link"\n\n' + text)
    assert ws.main_json("build")["ok"]
    manifest.write_text('[workspace]\nout_dir = "real"\n\n' + text)
    assert ws.main_json("build")["ok"]
    now = files(ws, "real")
    assert ws.main("clean", "--orphaned").returncode == 0
    assert files(ws, "real") == now
    assert stale(ws) == {}


def test_an_import_into_a_cache_that_cannot_be_written_blames_the_cache(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    """A whole archive into a cache where nothing can be written (a file where its objects'
    directory goes: what a read-only or full disk says too): the command fails naming the
    cache, not the archive, and imports nothing."""
    ws = simple_ws()
    cache = tmp_path / "cache"
    assert ws.main_json("build", "--cache", str(cache))["ok"]
    archive = str(tmp_path / "cache.tgz")
    assert ws.main("cache", "export", archive, "--cache", str(cache)).returncode == 0
    other = tmp_path / "other"
    (other / "v1").mkdir(parents=True)
    (other / "v1" / "objects").write_text("not a directory")
    proc = ws.main("cache", "import", archive, "--cache", str(other))
    assert proc.returncode != 0
    assert "truncated" not in proc.stderr and "damaged" not in proc.stderr, proc.stderr
    assert f"cannot write to the cache {other}" in proc.stderr, proc.stderr
    assert not (other / "v1" / "entries").exists()


@pytest.mark.parametrize("key", ["out_dir", "state_dir"])
def test_a_workspace_directory_that_is_a_file_is_one_user_error(
    simple_ws: Callable[..., Workspace], key: str
) -> None:
    """``[workspace] out_dir`` (or ``state_dir``) names a user's file: every command that
    opens the workspace says so once, exit 2, and the file is left as it was."""
    ws = simple_ws()
    (ws.root / "notes").write_text("mine")
    manifest = ws.root / "epbuild.toml"
    manifest.write_text(f'[workspace]\n{key} = "notes"\n\n' + manifest.read_text())
    for command in ("build", "status", "clean"):
        proc = ws.main(command)
        assert proc.returncode == 2, (command, proc.stderr)
        assert proc.stderr.count("error:") == 1, proc.stderr
        assert f"[workspace] {key} 'notes' is a file" in proc.stderr, proc.stderr
    assert (ws.root / "notes").read_text() == "mine"
