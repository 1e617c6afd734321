"""Links planted in a shared cache, the state directory and an output directory.

Another user of a shared cache (or a careless script) replaces a file or directory epbuild
owns by a symbolic link to a user's file or directory. epbuild makes no links there, so each
is damage: whatever the command (``build``, a restore into a fresh checkout, ``cache prune``,
``cache verify``, ``clean``, ``clean --orphaned``), the user's files keep their bytes and
stay, the command ends without a traceback (a warning naming the link, or exit 2 naming it)
and a build's result stays correct. Every level of the cache layout is tried: the ``v1``
root, the locks, lock files and owner notes, entries, objects, the verified-stat records and
the id markers. A link at a file epbuild replaces by a rename (an output, the stat cache) or
removes (``clean``) is never followed either, and needs no word.

One tiny model, compiled with the real QNN EP once for the module (and once more for the
key of its changed version); each case copies that workspace and cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild.cache.actioncache import ActionCache
from epbuild.cache.store import id_dir
from epbuild.errors import UserError
from epbuild.fs import LinkedPathError, open_nofollow, refuse_links, walk_files
from epbuild.results import Outcome
from epbuild.state import locks

USER_BYTES = 10_000
DEAD_PID = 999_999_999
"""Above any pid_max: a staging directory named for it belongs to no running process."""


def _manifest(group: str = "g") -> dict[str, Any]:
    return {"providers": {"htp": HTP73},
            "groups": {group: {"models": ["m/a.onnx"], "providers": ["htp"]}}}  # fmt: skip


@dataclass(frozen=True)
class Keyed:
    """Where one action's files are in a cache: its key, its id's marker directory, and
    the digest of its largest output."""

    key: str
    ids: str
    digest: str

    def fill(self, template: str) -> str:
        return template.format(
            kk=self.key[:2], key=self.key, dd=self.digest[:2], digest=self.digest, ids=self.ids
        )


@dataclass(frozen=True)
class Built:
    """The module's template: a workspace built from model 1 into ``cache``; the keys of
    model 1 (``first``) and model 2 (``second``: what a build after the change stores)."""

    ws: Path
    cache: Path
    first: Keyed
    second: Keyed
    lock_slug: str


def _keyed(cache: Path) -> Keyed:
    local = ActionCache(str(cache)).local
    (key,) = local.entry_keys()
    entry = local.get_entry(key)
    assert entry is not None
    largest = max(entry.outputs.values(), key=lambda o: o.size)
    return Keyed(key, id_dir(entry.id).rsplit("/", 1)[-1], largest.digest)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    root = tmp_path_factory.mktemp("planted")
    with pytest.MonkeyPatch.context() as mp:  # module scope: the test's env is not set up
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg-cache"))
        mp.setenv("EPBUILD_CACHE", "off")
        ws = Workspace(root / "ws")
        ws.model("m/a.onnx", matmul_model(1, n=16))
        ws.manifest(_manifest())
        assert ws.build(cache=str(root / "cache")).count(Outcome.COMPILED) == 1
        changed = Workspace(root / "changed")
        shutil.copytree(ws.root, changed.root, symlinks=True)
        changed.model("m/a.onnx", matmul_model(2, n=16))
        assert changed.build(cache=str(root / "cache2")).count(Outcome.COMPILED) == 1
    for cache in ("cache", "cache2"):  # no restore memo: each restore takes the full path
        shutil.rmtree(root / cache / "v1" / "restores", ignore_errors=True)
    (lock,) = (ws.root / ".epbuild" / "locks").glob("*.lock")
    return Built(
        ws.root, root / "cache", _keyed(root / "cache"), _keyed(root / "cache2"), lock.stem
    )


# -- planting --------------------------------------------------------------------------------


def _plant(root: Path, rel: str, is_dir: bool, user: Path) -> Path:
    """Replace ``root/rel`` by a link to a user's directory (holding what was there, if
    anything, and a file of the user's) or to a user's file; returns the link."""
    path = root / rel
    target = user / rel.replace("/", "_")
    if is_dir:
        if path.is_dir() and not path.is_symlink():
            shutil.move(path, target)  # what epbuild would find, were it to follow
        target.mkdir(parents=True, exist_ok=True)
        (target / "notes.txt").write_bytes(os.urandom(USER_BYTES))
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(os.urandom(USER_BYTES))
        if path.is_symlink() or path.exists():
            path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target, target_is_directory=is_dir)
    return path


def _snapshot(user: Path) -> dict[str, bytes]:
    """Every file of the user's, with its bytes."""
    found = {}
    for top, _dirs, files in os.walk(user):
        for name in files:
            full = Path(top) / name
            found[str(full.relative_to(user))] = full.read_bytes()
    return found


def _cli(ws: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return Workspace(ws).cli(*args)


def _assert_answered(
    proc: subprocess.CompletedProcess[str],
    link: Path,
    ws: Path,
    *,
    named: bool,
    codes: tuple[int, ...] = (0, 2),
) -> None:
    """No traceback; exit 0 (or another of ``codes``), or 2 naming the link; ``named``: the
    output names the link whatever the exit status."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "internal error" not in out, out
    assert proc.returncode in codes, (proc.returncode, out)
    spellings = {str(link), os.path.relpath(link, ws).replace(os.sep, "/")}
    if named or proc.returncode == 2:
        assert any(s in out for s in spellings), (spellings, proc.returncode, out)


def _assert_built(ws: Path) -> None:
    """The build's result is correct: every action up to date, its outputs regular files
    that ``verify`` accepts."""
    doc = Workspace(ws).cli_json("status")
    assert doc["actions"] and not any(a["stale"] for a in doc["actions"]), doc
    outputs = list((ws / "build" / "g" / "htp").iterdir())
    assert outputs and all(p.is_file() and not p.is_symlink() for p in outputs), outputs
    proc = _cli(ws, "verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fresh_checkout(built: Built, dest: Path) -> Path:
    """The sources only, as a clone would have them."""
    dest.mkdir()
    shutil.copytree(built.ws / "m", dest / "m")
    shutil.copy(built.ws / "epbuild.toml", dest / "epbuild.toml")
    return dest


# -- the cache -------------------------------------------------------------------------------

CACHE_PLANTS = [
    ("v1", True),
    ("v1/locks", True),
    ("v1/locks/{kk}", True),
    ("v1/locks/{kk}/{key}.lock", False),
    ("v1/locks/{kk}/{key}.lock.owner", False),
    ("v1/entries", True),
    ("v1/entries/{kk}", True),
    ("v1/entries/{kk}/{key}.json", False),
    ("v1/objects", True),
    ("v1/objects/{dd}", True),
    ("v1/objects/{dd}/{digest}", False),
    ("v1/verified", True),
    ("v1/verified/{dd}/{digest}", False),
    ("v1/ids/{ids}", True),
    ("prune.lock", False),
    ("prune.lock.owner", False),
]

SILENT = {
    # A verified-stat record is a hint: one behind a link is no record (the object is
    # re-hashed), and writing one replaces the link by a rename or is skipped.
    ("build", "v1/verified"),
    ("build", "v1/verified/{dd}/{digest}"),
    ("restore", "v1/verified"),
    ("restore", "v1/verified/{dd}/{digest}"),
    ("restore", "v1/ids/{ids}"),  # a restore reads no id marker
}
"""(command, plant) pairs where the command meets no link (it does not go there, or only
replaces what is there by a rename): no word is needed. Every other pair names the link."""


def _matrix(
    plants: list[tuple[str, bool]], commands: list[str], inner: set[tuple[str, str]]
) -> list[Any]:
    """Every (command, plant, is_dir); those not in ``inner`` are slow (a build or more
    each: the inner loop keeps a few of each kind)."""
    return [
        pytest.param(
            command,
            rel,
            is_dir,
            id=f"{rel}-{command}",
            marks=() if (rel, command) in inner else pytest.mark.slow,
        )
        for rel, is_dir in plants
        for command in commands
    ]


def _copies(built: Built, tmp_path: Path, command: str) -> tuple[Path, Path]:
    """A copy of the built workspace (a fresh checkout of it for ``restore``) and of its
    cache, links kept as they are."""
    cache = tmp_path / "cache"
    shutil.copytree(built.cache, cache, symlinks=True)
    if command == "restore":
        return _fresh_checkout(built, tmp_path / "ws"), cache
    shutil.copytree(built.ws, tmp_path / "ws", symlinks=True)
    return tmp_path / "ws", cache


@pytest.mark.parametrize(
    ("command", "rel", "is_dir"),
    _matrix(
        CACHE_PLANTS,
        ["build", "restore", "prune", "verify"],
        {
            ("v1/entries/{kk}/{key}.json", "build"),
            ("v1/locks/{kk}", "restore"),
            ("v1/objects", "prune"),
            ("v1", "verify"),
        },
    ),
)
def test_a_link_planted_in_the_cache_is_never_followed(
    built: Built, tmp_path: Path, command: str, rel: str, is_dir: bool
) -> None:
    ws, cache = _copies(built, tmp_path, command)
    if command == "build":  # model 2: compiled, then stored under the second key
        Workspace(ws).model("m/a.onnx", matmul_model(2, n=16))
    keyed = built.second if command == "build" else built.first
    user = tmp_path / "user"
    link = _plant(cache, keyed.fill(rel), is_dir, user)
    before = _snapshot(user)
    if command in ("build", "restore"):
        args: tuple[str, ...] = ("build", "--cache", str(cache))
    elif command == "prune":
        args = ("cache", "prune", "--max-size", "0", "--cache", str(cache))
    else:
        args = ("cache", "verify", "--cache", str(cache))
    proc = _cli(ws, *args)
    assert _snapshot(user) == before, "a user's file was written or deleted through the link"
    silent = (command, rel) in SILENT or (command in ("build", "restore") and "prune" in rel)
    codes = (0, 1, 2) if command == "verify" else (0, 2)  # verify: 1 when it found damage
    _assert_answered(proc, link, ws, named=not silent, codes=codes)
    if command in ("build", "restore"):
        assert proc.returncode == 0
        _assert_built(ws)
    elif proc.returncode != 2:  # prune and verify remove the link (only the link)
        assert not link.is_symlink(), proc.stderr


def test_the_reported_case_an_owner_note_linked_to_a_users_file(
    built: Built, tmp_path: Path
) -> None:
    """A ``v1/locks/…/*.lock.owner`` linked to a user's 10,000-byte file: it kept 131 bytes
    of JSON. Now the build restores, warns naming the note, and the file keeps its bytes."""
    cache = tmp_path / "cache"
    shutil.copytree(built.cache, cache, symlinks=True)
    ws = _fresh_checkout(built, tmp_path / "ws")
    mine = tmp_path / "thesis.tex"
    mine.write_bytes(b"x" * USER_BYTES)
    note = cache / built.first.fill("v1/locks/{kk}/{key}.lock.owner")
    note.unlink()
    note.symlink_to(mine)
    proc = Workspace(ws).cli("build", "--cache", str(cache))
    assert mine.read_bytes() == b"x" * USER_BYTES
    assert proc.returncode == 0 and "1 restored" in proc.stdout, proc.stdout + proc.stderr
    assert f"warning: the cache {cache} cannot be locked ({note}: a symbolic link" in proc.stderr


# -- the state and output directories -------------------------------------------------------

WORKSPACE_PLANTS = [
    (".epbuild/state.jsonl", False),
    (".epbuild/state.lock", False),
    (".epbuild/state.lock.owner", False),
    (".epbuild/statcache.json", False),
    (".epbuild/locks", True),
    (".epbuild/locks/{slug}.lock", False),
    (".epbuild/locks/{slug}.lock.owner", False),
    ("build/.staging", True),
    (f"build/.staging/g-htp-a-{DEAD_PID}", True),
    ("build/g", True),
    ("build/g/htp", True),
    ("build/g/htp/a_ctx.onnx", False),
    ("build/g/htp/a_ctx_qnn.bin", False),
]


QUIETLY_REPLACED = {
    # epbuild's own files there: a link is replaced by a rename or removed, never followed
    ".epbuild/statcache.json",  # a hint: one that cannot be read costs a re-hash
    f"build/.staging/g-htp-a-{DEAD_PID}",
    "build/g/htp/a_ctx.onnx",
    "build/g/htp/a_ctx_qnn.bin",
}
"""Plants no command needs to name (nor does ``clean`` name the action locks it never
takes); every other pair is named."""


@pytest.mark.parametrize(
    ("command", "rel", "is_dir"),
    _matrix(
        WORKSPACE_PLANTS,
        ["build", "restore", "clean", "clean-orphaned"],
        {
            (".epbuild/state.lock.owner", "build"),
            (".epbuild/state.jsonl", "restore"),
            ("build/.staging", "clean"),
            ("build/g/htp", "clean-orphaned"),
        },
    ),
)
def test_a_link_planted_in_the_state_or_output_directory_is_never_followed(
    built: Built, tmp_path: Path, command: str, rel: str, is_dir: bool
) -> None:
    ws, cache = _copies(built, tmp_path, command)
    if command == "build":  # model 2: compiled over the outputs of model 1
        Workspace(ws).model("m/a.onnx", matmul_model(2, n=16))
    if command == "clean-orphaned":  # g/htp/a is no longer in the manifest
        Workspace(ws).manifest(_manifest("h"))
    user = tmp_path / "user"
    link = _plant(ws, rel.format(slug=built.lock_slug), is_dir, user)
    before = _snapshot(user)
    args = {
        "build": ("build",),
        "restore": ("build", "--cache", str(cache)),
        "clean": ("clean",),
        "clean-orphaned": ("clean", "--orphaned"),
    }[command]
    proc = _cli(ws, *args)
    assert _snapshot(user) == before, "a user's file was written or deleted through the link"
    silent = rel in QUIETLY_REPLACED or (
        command.startswith("clean") and rel.startswith(".epbuild/locks")
    )
    _assert_answered(proc, link, ws, named=not silent)
    if command in ("build", "restore") and proc.returncode == 0:
        _assert_built(ws)


def test_a_link_between_output_directories_is_refused_by_clean(
    built: Built, tmp_path: Path
) -> None:
    """A link inside the output directory that leads elsewhere inside it: clean names it
    (exit 2) and deletes nothing through it."""
    ws = tmp_path / "ws"
    shutil.copytree(built.ws, ws, symlinks=True)
    (ws / "build" / "g").rename(ws / "build" / "elsewhere")
    (ws / "build" / "g").symlink_to("elsewhere", target_is_directory=True)
    before = _snapshot(ws / "build" / "elsewhere")
    proc = _cli(ws, "clean")
    assert proc.returncode == 2 and "build/g" in proc.stderr, proc.stderr
    assert _snapshot(ws / "build" / "elsewhere") == before


# -- the primitives --------------------------------------------------------------------------


def test_the_no_follow_primitives_refuse_and_report_links(tmp_path: Path) -> None:
    owned, user = tmp_path / "owned", tmp_path / "user"
    (owned / "real").mkdir(parents=True)
    user.mkdir()
    (user / "f").write_bytes(b"mine")
    (owned / "dir").symlink_to(user, target_is_directory=True)
    (owned / "real" / "file").symlink_to(user / "f")
    with pytest.raises(LinkedPathError) as caught:
        refuse_links(str(owned), str(owned / "dir" / "f"))
    assert caught.value.filename == str(owned / "dir")
    assert isinstance(caught.value, OSError) and isinstance(caught.value, UserError)
    assert str(owned / "dir") in caught.value.message
    refuse_links(str(owned), str(owned / "real" / "missing" / "x"))  # no link on the way
    with pytest.raises(LinkedPathError):
        open_nofollow(str(owned / "real" / "file"), os.O_WRONLY | os.O_TRUNC)
    links: list[str] = []
    assert list(walk_files(str(owned), links)) == []
    assert sorted(links) == [str(owned / "dir"), str(owned / "real" / "file")]
    assert (user / "f").read_bytes() == b"mine"


def test_refuse_links_reads_the_path_below_the_root_as_relpath_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The components below the root: however the two are spelled (a trailing separator,
    relative, ``..`` on the way), never a sibling that only shares the root's spelling, and
    the root itself none (it is the user's choice, a link or not)."""
    owned, user = tmp_path / "owned", tmp_path / "user"
    (owned / "a").mkdir(parents=True)
    user.mkdir()
    (owned / "a" / "link").symlink_to(user, target_is_directory=True)
    (tmp_path / "ownedx").mkdir()
    monkeypatch.chdir(tmp_path)
    for root, path in [
        (f"{owned}/", f"{owned}/a/link/f"),
        ("owned", "owned/a/link"),
        (str(owned), f"{owned}/a/../a/link/f"),
        (f"{owned}/a/..", f"{owned}/a/link"),
    ]:
        with pytest.raises(LinkedPathError) as caught:
            refuse_links(root, path)
        assert os.path.abspath(caught.value.filename) == str(owned / "a" / "link"), (root, path)
    for root, path in [(str(owned), f"{owned}x/f"), (str(owned), str(tmp_path)), ("owned", ".")]:
        with pytest.raises(ValueError, match="is not under"):
            refuse_links(root, path)
    refuse_links(str(owned / "a" / "link"), f"{owned}/a/link/")  # the root itself
    refuse_links(str(owned), f"{owned}/a//missing/link")  # stops at what is missing


def test_a_lock_owner_note_hard_linked_to_a_users_file_is_made_anew(tmp_path: Path) -> None:
    mine = tmp_path / "mine.txt"
    mine.write_bytes(b"x" * USER_BYTES)
    os.link(mine, tmp_path / "k.lock.owner")
    with locks.hold(str(tmp_path / "k.lock"), "a test"):
        pass
    assert mine.read_bytes() == b"x" * USER_BYTES
    assert json.loads((tmp_path / "k.lock.owner").read_text())["what"] == "a test"


def test_a_lock_or_owner_note_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    mine = tmp_path / "mine.txt"
    mine.write_bytes(b"x" * USER_BYTES)
    for name in ("a.lock", "b.lock.owner"):
        (tmp_path / name).symlink_to(mine)
    for lock in ("a.lock", "b.lock"):
        with pytest.raises(LinkedPathError), locks.hold(str(tmp_path / lock), "a test"):
            pass
    assert mine.read_bytes() == b"x" * USER_BYTES
