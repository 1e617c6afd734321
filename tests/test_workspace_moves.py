"""A changed ``[workspace]``: the settings that say where outputs go (``out_dir``, and
``state_dir`` for the outputs kept there) are part of what makes an action up to date, the
others are not. After a move ``status`` says stale and why, ``build`` writes in the new
place (restoring from the cache where it can), ``verify`` passes, and the old outputs are
orphans that ``clean --orphaned`` removes — outside epbuild's directories only while they
are still what a build wrote. Real QNN compiles of tiny models."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import HTP73, Workspace, toml_value
from test_two_at_once import together

from epbuild.manifest.schema import SCHEMA
from epbuild.planning.noop import fast_noop

CORPUS = Path(__file__).parent / "corpus"
SIMPLE = {"pair/htp": ("pair", "htp"), "single/htp/c": ("single", "htp")}
"""The actions of ``simple_built``: id → (group, provider), its outputs' folder below out_dir."""


def place(ws: Workspace, **settings: Any) -> None:
    """Replace the manifest's ``[workspace]`` table (none before: the fixtures write none)."""
    path = ws.root / "epbuild.toml"
    text = path.read_text()
    if text.startswith("[workspace]\n"):
        text = text.split("\n\n", 1)[1]
    table = "".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items())
    path.write_text(f"[workspace]\n{table}\n{text}")


def stale(ws: Workspace) -> dict[str, list[str]]:
    """``status``: each stale action's reasons."""
    doc = ws.main_json("status")
    return {a["id"]: a["reasons"] for a in doc["actions"] if a["stale"]}


def built(ws: Workspace, *args: str) -> dict[str, str]:
    """``build``: each action's outcome (the build must succeed)."""
    doc = ws.main_json("build", *args)
    assert doc["ok"], doc
    return {a["id"]: a["outcome"] for a in doc["actions"]}


def verified(ws: Workspace) -> None:
    proc = ws.cli("verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def files(ws: Workspace, top: str) -> list[str]:
    """The files under ``top`` (workspace-relative), less staging."""
    base = ws.root / top
    return sorted(
        str(p.relative_to(ws.root))
        for p in base.rglob("*")
        if p.is_file() and ".staging" not in p.parts
    )


# Two moves, one of them nested, each verified and cleaned. Fast: one move of out_dir with
# its reasons, verify's word, the build there, the orphans' bytes and clean --orphaned
# (test_a_changed_workspace_key[out_dir]); a nested out_dir
# (test_a_quantized_group_survives_an_out_dir_move); a move back
# (test_moving_back_takes_the_old_place_again).
@pytest.mark.slow
def test_a_moved_out_dir_is_stale_then_built_there_twice_and_nested(
    simple_built: Workspace,
) -> None:
    ws = simple_built
    ws.cli("build", check=True)
    ws.cli("build", check=True)  # all up to date: the no-op fingerprint is recorded
    assert (ws.root / ".epbuild" / "noop.json").exists()
    before = files(ws, "build")
    for old, new in (("build", "out"), ("out", "a/b/out")):
        place(ws, out_dir=new)
        assert stale(ws) == {
            i: [f"outputs moved from {old}/{g}/{p} to {new}/{g}/{p}"]
            for i, (g, p) in SIMPLE.items()
        }
        proc = ws.cli("verify")
        assert proc.returncode == 1 and "where the manifest puts them" in proc.stdout, proc.stdout
        assert built(ws) == dict.fromkeys(SIMPLE, "compiled")  # never "up to date"
        assert files(ws, new) == [f.replace("build/", f"{new}/", 1) for f in before]
        verified(ws)
        doc = ws.main_json("status")
        assert not any(a["stale"] for a in doc["actions"])
        assert doc["orphaned"] == sorted(
            f"{i} (left in {old}/{g}/{p})" for i, (g, p) in SIMPLE.items()
        )
        assert doc["orphaned_bytes"] == sum((ws.root / f).stat().st_size for f in files(ws, old))
        assert "[workspace] changed" in ws.main("status").stdout
        left = files(ws, old)
        removed = ws.main_json("clean", "--orphaned")["removed"]
        assert sorted(removed) == left and left
        assert not (ws.root / old).exists()  # the old place goes, its staging folder too
        doc = ws.main_json("status")
        assert doc["orphaned"] == [] and doc["orphaned_bytes"] == 0
        assert built(ws) == dict.fromkeys(SIMPLE, "up_to_date")
    assert (ws.root / "a/b").is_dir()  # never above the old out_dir


def test_a_moved_out_dir_restores_from_the_cache(simple_built: Workspace, tmp_path: Path) -> None:
    """The key is the same (where outputs go is no part of it): the cache's entry restores
    into the new place, nothing compiles."""
    ws, cache = simple_built, str(tmp_path / "cache")
    ws.main("build", "--cache", cache, check=True)  # stores the up-to-date actions
    place(ws, out_dir="out")
    assert built(ws, "--cache", cache) == dict.fromkeys(SIMPLE, "restored")
    verified(ws)
    assert ws.main_json("clean", "--orphaned")["removed"]
    assert not (ws.root / "build").exists()


def test_plain_clean_after_a_move_removes_the_old_outputs(simple_built: Workspace) -> None:
    ws = simple_built
    before = files(ws, "build")
    place(ws, out_dir="out")
    proc = ws.main("clean", "--json")
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(proc.stdout)["removed"]) == before
    assert not (ws.root / "build").exists()
    assert stale(ws) == {i: ["never built"] for i in SIMPLE}


def test_clean_orphaned_keeps_what_the_user_put_in_the_old_place(simple_built: Workspace) -> None:
    """The old out_dir is no longer epbuild's: a changed output and a new file stay."""
    ws = simple_built
    place(ws, out_dir="out")
    built(ws)
    mine = ws.root / "build/single/htp/c_ctx.onnx"
    mine.write_bytes(b"the user's own file now")
    (ws.root / "build/notes.txt").write_text("mine")
    removed = ws.main_json("clean", "--orphaned")["removed"]
    assert sorted(removed) == [
        "build/pair/htp/a_ctx.onnx", "build/pair/htp/a_ctx_qnn.bin", "build/pair/htp/b_ctx.onnx",
        "build/single/htp/c_ctx_qnn.bin"]  # fmt: skip
    assert mine.read_bytes() == b"the user's own file now"
    assert (ws.root / "build/notes.txt").read_text() == "mine"
    assert not (ws.root / "build/pair").exists()
    assert ws.main_json("status")["orphaned"] == []
    verified(ws)


def test_moving_back_takes_the_old_place_again(simple_built: Workspace) -> None:
    ws = simple_built
    place(ws, out_dir="out")
    built(ws)
    place(ws, out_dir="build")
    assert all(r[0].startswith("outputs moved from out/") for r in stale(ws).values())
    assert built(ws) == dict.fromkeys(SIMPLE, "compiled")
    doc = ws.main_json("status")
    assert doc["orphaned"] == sorted(f"{i} (left in out/{g}/{p})" for i, (g, p) in SIMPLE.items())
    ws.main("clean", "--orphaned", check=True)
    assert not (ws.root / "out").exists() and files(ws, "build")
    verified(ws)


WORKSPACE_KEYS: dict[str, tuple[dict[str, Any], str]] = {
    "out_dir": ({"out_dir": "elsewhere"}, "moves"),
    "state_dir": ({"state_dir": ".elsewhere"}, "starts over"),
    "jobs": ({"jobs": 3}, "same"),
    "memory_budget": ({"memory_budget": "4G"}, "same"),
    "cache": ({"cache": "shared-cache"}, "same"),
    "executor": ({"executor": "dask", "scheduler": "tcp://127.0.0.1:9"}, "same"),
    "scheduler": ({"scheduler": "tcp://127.0.0.1:9"}, "same"),
}
"""Every ``[workspace]`` key: a change of it, and what that does to up-to-dateness."""


def test_every_workspace_key_is_tested() -> None:
    assert set(WORKSPACE_KEYS) == set(SCHEMA["properties"]["workspace"]["properties"])


@pytest.mark.parametrize("key", sorted(WORKSPACE_KEYS))
def test_a_changed_workspace_key(simple_built: Workspace, key: str) -> None:
    """Where outputs go moves them (stale, built there, the old place orphaned); a new state
    directory starts with no record (built again, the old one left alone: epbuild no longer
    knows it); every other key leaves every action up to date."""
    ws = simple_built
    settings, effect = WORKSPACE_KEYS[key]
    place(ws, **settings)
    if effect == "same":
        assert stale(ws) == {}
        assert ws.main_json("status")["orphaned"] == []
        assert built(ws) == dict.fromkeys(SIMPLE, "up_to_date")
        return
    if effect == "moves":
        assert stale(ws) == {
            i: [f"outputs moved from build/{g}/{p} to elsewhere/{g}/{p}"]
            for i, (g, p) in SIMPLE.items()
        }
        proc = ws.cli("verify")
        assert proc.returncode == 1 and "where the manifest puts them" in proc.stdout, proc.stdout
    else:
        assert stale(ws) == {i: ["never built"] for i in SIMPLE}
    assert built(ws) == dict.fromkeys(SIMPLE, "compiled")
    verified(ws)
    if effect == "moves":
        left = sum((ws.root / f).stat().st_size for f in files(ws, "build"))
        assert ws.main_json("status")["orphaned_bytes"] == left
        assert "[workspace] changed" in ws.main("status").stdout
    ws.main("clean", "--orphaned", check=True)
    if effect == "moves":
        assert files(ws, "elsewhere") and not (ws.root / "build").exists()
    else:
        assert files(ws, "build") and (ws.root / ".epbuild/state.jsonl").is_file()
        assert (ws.root / ".elsewhere/state.jsonl").is_file()
    assert built(ws) == dict.fromkeys(SIMPLE, "up_to_date")


def test_a_state_dir_moved_along_keeps_every_compile_up_to_date(simple_built: Workspace) -> None:
    ws = simple_built
    (ws.root / ".epbuild").rename(ws.root / "state")
    place(ws, state_dir="state")
    assert stale(ws) == {}
    assert built(ws) == dict.fromkeys(SIMPLE, "up_to_date")
    verified(ws)


def test_two_builds_at_once_after_a_move(simple_built: Workspace) -> None:
    ws = simple_built
    place(ws, out_dir="out")
    first, second = together(ws.root, ("build", "--json"), ("build", "--json"))
    assert first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    ran: dict[str, list[str]] = {}
    for proc in (first, second):
        for a in json.loads(proc.stdout)["actions"]:
            ran.setdefault(a["id"], []).append(a["outcome"])
    assert {i: sorted(o) for i, o in ran.items()} == {i: ["compiled", "up_to_date"] for i in SIMPLE}
    verified(ws)
    doc = ws.main_json("status")
    assert doc["orphaned"] == sorted(f"{i} (left in build/{g}/{p})" for i, (g, p) in SIMPLE.items())
    ws.main("clean", "--orphaned", check=True)
    assert not (ws.root / "build").exists() and files(ws, "out")


def test_the_noop_fast_path_never_vouches_for_a_manifest_edited_in_its_tick(
    simple_built: Workspace,
) -> None:
    """A same-size edit that keeps the manifest's stamp (a coarse-timestamp filesystem,
    within one tick of the fingerprint): the fast path must not answer from it."""
    ws = simple_built
    manifest = ws.root / "epbuild.toml"
    place(ws, out_dir="build")
    tick = time.time_ns() + 3600 * 10**9  # not older than the fingerprint: racy
    os.utime(manifest, ns=(tick, tick))
    ws.main("build", check=True)
    ws.main("build", check=True)
    assert (ws.root / ".epbuild" / "noop.json").exists()
    manifest.write_text(manifest.read_text().replace('"build"', '"built"'))  # same size, inode
    os.utime(manifest, ns=(tick, tick))
    assert fast_noop(str(ws.root), None, []) is None
    assert built(ws) == dict.fromkeys(SIMPLE, "compiled")
    assert files(ws, "built")


# ---------------------------------------------------------------------------------------
# A quantized group: its QDQ models live in out_dir, its calibrations in state_dir


def _build_quantized(ws: Workspace) -> None:
    import numpy as np

    (ws.root / "models").mkdir(parents=True)
    shutil.copy(CORPUS / "cnn_torchscript.onnx", ws.root / "models" / "cnn.onnx")
    (ws.root / "calib").mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        np.savez(ws.root / f"calib/s{i}.npz", image=rng.standard_normal((1, 3, 32, 32), "f4"))
    htp = "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in HTP73["options"].items()) + " }"
    (ws.root / "epbuild.toml").write_text(
        f'[providers.htp]\nep = "qnn"\noptions = {htp}\n\n'
        '[groups.vision]\nmodels = ["models/*.onnx"]\nproviders = ["htp"]\nquantize = "q"\n\n'
        '[quantization.q]\ncalibration = "calib/*.npz"\nactivations = "uint16"\n'
        'weights = "uint8"\n'
    )
    ws.main("build", check=True)


@pytest.fixture
def quantized(
    built_once: Callable[[str, Callable[[Workspace], None], Workspace], Workspace],
    workspace: Workspace,
) -> Workspace:
    """The corpus CNN quantized with three samples and compiled for HTP v73, built."""
    return built_once("moves-quantized", _build_quantized, workspace)


QUANTIZED = ("vision/cnn/calibrate", "vision/cnn/quantize", "vision/htp/cnn")


def test_a_quantized_group_survives_an_out_dir_move(quantized: Workspace) -> None:
    ws = quantized
    place(ws, out_dir="a/b/out")
    reasons = stale(ws)
    assert "vision/cnn/calibrate" not in reasons  # its outputs are in the state directory
    assert reasons["vision/cnn/quantize"] == [
        "outputs moved from build/vision/quantized to a/b/out/vision/quantized"
    ]
    outcomes = built(ws)
    assert outcomes["vision/cnn/calibrate"] == "up_to_date"
    assert outcomes["vision/cnn/quantize"] == outcomes["vision/htp/cnn"] == "compiled"
    assert files(ws, "a/b/out") == [
        "a/b/out/vision/htp/cnn_ctx.onnx", "a/b/out/vision/htp/cnn_ctx_qnn.bin",
        "a/b/out/vision/quantized/cnn.onnx"]  # fmt: skip
    verified(ws)
    ws.main("clean", "--orphaned", check=True)
    assert not (ws.root / "build").exists()
    assert built(ws) == dict.fromkeys(QUANTIZED, "up_to_date")


def test_a_quantized_groups_compile_restores_after_an_out_dir_move(
    quantized: Workspace, tmp_path: Path
) -> None:
    """The compile is keyed by its QDQ model's place below out_dir, not the workspace's: the
    moved out_dir restores the quantization and then the compile from the cache."""
    ws, cache = quantized, str(tmp_path / "cache")
    ws.main("build", "--cache", cache, check=True)  # stores the up-to-date actions
    place(ws, out_dir="a/b/out")
    moved = {
        "vision/cnn/calibrate": "up_to_date",  # (in the state directory)
        "vision/cnn/quantize": "restored",
        "vision/htp/cnn": "restored",
    }
    assert built(ws, "--cache", cache) == moved
    verified(ws)
    place(ws)  # and back: a move again, nothing compiles
    assert built(ws, "--cache", cache) == moved
    assert built(ws, "--cache", cache) == dict.fromkeys(QUANTIZED, "up_to_date")


def test_a_quantized_group_survives_a_state_dir_move(quantized: Workspace) -> None:
    """The state folder moved along: the calibration is stale where it was recorded and is
    made again in the new place; the build succeeds and verifies."""
    ws = quantized
    (ws.root / ".epbuild").rename(ws.root / "state")
    place(ws, state_dir="state")
    assert stale(ws)["vision/cnn/calibrate"] == [
        "outputs moved from .epbuild/quant/vision/cnn to state/quant/vision/cnn"
    ]
    assert built(ws)["vision/cnn/calibrate"] == "compiled"
    assert files(ws, "state/quant") == [
        "state/quant/vision/cnn/model.onnx", "state/quant/vision/cnn/ranges.json"]  # fmt: skip
    verified(ws)
    assert built(ws) == dict.fromkeys(QUANTIZED, "up_to_date")
