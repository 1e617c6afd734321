"""Two of every writing command at once on the same target: the result is whole and every
success was true. (Two builds: tests/test_concurrency.py; two packages, also through a
symlinked spelling: tests/test_package.py; two `add`: tests/test_add.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import waits
from conftest import Workspace

from epbuild import status
from epbuild.state.journal import load_state

_STARTER = (
    "import os, sys, time\n"
    "ready, go = sys.argv.pop(1), sys.argv.pop(1)\n"
    "open(ready, 'w').close()\n"
    "while not os.path.exists(go): time.sleep(0.001)\n"  # both leave the line together
    "from epbuild.frontends.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def together(
    root: Path, *commands: tuple[str, ...], env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run the epbuild ``commands`` in ``root`` at once (each waits for one go file after
    its interpreter started); their finished processes, in order."""
    go = root.parent / f"go-{os.getpid()}"
    go.unlink(missing_ok=True)
    ready = [root.parent / f"ready-{i}" for i in range(len(commands))]
    for r in ready:
        r.unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STARTER, str(r), str(go), "-C", str(root), *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        for r, cmd in zip(ready, commands, strict=True)
    ]
    waits.wait_for(  # an event: every interpreter is up (or one has exited already)
        lambda: all(r.exists() for r in ready) or any(p.poll() is not None for p in procs),
        "both commands to be ready", interval=0.001)  # fmt: skip
    go.touch()
    done = []
    for p, cmd in zip(procs, commands, strict=True):
        out, err = waits.communicate(p, f"'epbuild {' '.join(cmd)}' to finish", timeout=600)
        done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    return done


def clean_exit(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, (proc.args, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_two_cleans(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    for _ in range(3):
        assert ws.build().ok
        for proc in together(ws.root, ("clean",), ("clean",)):
            clean_exit(proc)
        state = load_state(str(ws.root / ".epbuild/state.jsonl"))
        assert not state.records and not state.interrupted and not state.warnings
        assert not [p for p in (ws.root / "build").rglob("*") if p.is_file()]
        assert all(a.stale for a in status(ws.root).actions)


@pytest.mark.slow
def test_two_cache_prunes(simple_ws: Callable[..., Workspace], tmp_path: Path) -> None:
    ws = simple_ws()
    cache = tmp_path / "cache"
    assert ws.build(cache=str(cache)).ok
    for proc in together(
        ws.root,
        ("cache", "prune", "--max-size", "1", "--cache", str(cache)),
        ("cache", "prune", "--max-size", "1", "--cache", str(cache)),
    ):
        clean_exit(proc)
    checked = ws.cli("cache", "verify", "--cache", str(cache))
    clean_exit(checked)
    # the cache still works: a clean build restores or compiles, and is whole
    ws.cli("clean", check=True)
    assert ws.build(cache=str(cache)).ok
    assert not any(a.stale for a in status(ws.root).actions)


@pytest.fixture
def toolchain_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "toolchains"
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(root))
    return root


def _leftovers(root: Path) -> None:
    """Environments no manifest uses, half-made ones, failed attempts' logs, old workers."""
    for i in range(40):
        digest = f"{i:02d}" + "ab" * 15
        env = root / digest
        (env / "lib").mkdir(parents=True)
        (env / "lib" / "x.py").write_text("x = 1\n")
        if i % 2:
            (env / "epbuild-toolchain.json").write_text(json.dumps({"requirements": ["x"]}))
        (root / f"{digest}.log").write_text("pip said things\n")
        (root / f"{i:02d}{'cd' * 15}.log").write_text("a failed attempt\n")
        (root / f"{i:02d}{'cd' * 15}.lock").write_text("")
    (root / "worker-0.0.0-old").mkdir()


def test_two_toolchain_prunes(simple_ws: Callable[..., Workspace], toolchain_dir: Path) -> None:
    ws = simple_ws()
    for _ in range(3):
        _leftovers(toolchain_dir)
        runs = together(ws.root, ("toolchains", "--prune"), ("toolchains", "--prune"))
        for proc in runs:
            clean_exit(proc)
        left = sorted(p.name for p in toolchain_dir.iterdir() if not p.name.startswith("worker-"))
        assert left == [], left
        assert not (toolchain_dir / "worker-0.0.0-old").exists()


@pytest.mark.parametrize(
    "other",
    [
        ("init", "--from", "models"),
        # Plain init holds the same manifest lock as init --from, whose race stays fast above;
        # add's edits under that lock: test_add_layouts.py test_two_edits_at_once_both_land.
        pytest.param(("init",), marks=pytest.mark.slow),
    ],
    ids=["init-from", "init"],
)
def test_init_from_and_another_init_at_once(tmp_path: Path, other: tuple[str, ...]) -> None:
    """``init --from`` holds the lock ``add`` holds across check and write: of two inits at
    once on one manifest, one writes and the other is refused, never two successes with
    one file left."""
    from modelgen import matmul_model, save

    from epbuild.manifest.load import load_manifest

    root = tmp_path / "ws"
    for name, seed in (("a", 1), ("b", 2)):
        save(matmul_model(seed, n=8), root / "models" / f"{name}.onnx")
    manifest = root / "epbuild.toml"
    for _ in range(4):
        manifest.unlink(missing_ok=True)
        procs = together(root, ("init", "--from", "models"), other)
        codes = sorted(p.returncode for p in procs)
        assert codes == [0, 2], [(p.returncode, p.stdout, p.stderr) for p in procs]
        (winner,) = [p for p in procs if p.returncode == 0]
        (loser,) = [p for p in procs if p.returncode == 2]
        assert "Traceback" not in loser.stderr and "already exists" in loser.stderr
        text = manifest.read_text()
        from_models = "--from" in winner.args
        assert ("written by 'epbuild init --from models'" in text) is from_models, text
        load_manifest(manifest)
