"""The calibration of a decoder in parts keeps a memo (epbuild/llm/calibmemo.py): after an
edit of the last part, the next calibration runs that part alone on what the parts before
it read, and writes the very ranges a calibration of every part writes; an edit that
changes the tokens the chain chooses calibrates every part again. On the text-trained tiny
Llama, deepened to 3 layers and prepared in 3 parts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from llmfixture import LLM_FIXTURES, TEXT_PROMPTS, deepen

from epbuild.llm.calibmemo import MEMO, Keep, runs_name
from epbuild.llm.calibrate import calibrate, static_io, tokenize
from epbuild.llm.generate import genai_installed
from epbuild.llm.partgraphs import PartShape, write_parts
from epbuild.llm.sessions import structure

pytestmark = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")

WINDOW, CONTEXT, HEAD = 16, 64, 16
STAGES = [f"part{k}_{g}" for k in (1, 2, 3) for g in ("context", "iterator")]
SETTINGS = {"method": "minmax", "generated": 16}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The source (3 layers) and its parts."""
    source = tmp_path_factory.mktemp("deep") / "llama-text"
    shutil.copytree(LLM_FIXTURES / "llama-text", source)
    deepen(source, 3, spread=0.02)
    parts = tmp_path_factory.mktemp("prepared")
    write_parts(str(source / "model.onnx"), str(parts), PartShape(WINDOW, CONTEXT, HEAD, 3))
    return source, parts


def _edited(parts: Path, to: Path, tensor: str, change: float, *, scale: bool = False) -> Path:
    """A copy of the prepared parts with ``tensor`` of the last part changed (one value
    moved by ``change``, or all of it multiplied by it)."""
    shutil.copytree(parts, to)
    model = structure(str(to / "part3_context.onnx"))
    (found,) = [t for t in model.graph.initializer if t.name == tensor]
    ref = {e.key: e.value for e in found.external_data}
    offset, length = int(ref["offset"]), int(ref["length"])
    with open(to / ref["location"], "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(length), dtype=np.float32).copy()
        if scale:
            values *= change
        else:
            values[0] += change
        f.seek(offset)
        f.write(values.tobytes())
    return to


def _calibrate(source: Path, parts: Path, out: Path, keep: Keep | None = None) -> dict[str, bytes]:
    from onnxruntime.quantization import CalibrationMethod

    out.mkdir()
    (out / ".scratch").mkdir()  # what a job's staging folder holds beside the calibration's
    (out / ".epbuild-worker.log").write_text("a worker's log\n")
    io = static_io(json.loads((source / "genai_config.json").read_text()), WINDOW, CONTEXT)
    prompts = tokenize(str(source), TEXT_PROMPTS.read_text().splitlines()[:4])
    graphs = {s: str(parts / f"{s}.onnx") for s in STAGES}
    ranges = {s: str(out / f"{s}.ranges.json") for s in STAGES}
    embeddings = str(parts / "embeddings.onnx")
    calibrate(graphs, prompts, io, CalibrationMethod.MinMax, ranges, None, embeddings, keep)
    return {s: Path(ranges[s]).read_bytes() for s in STAGES}


def _keep(previous: Path, out: Path, last: str) -> Keep:
    return Keep(str(previous), str(out), {"part1": "a", "part2": "b", "part3": last}, SETTINGS)


def test_an_edit_of_the_last_part_calibrates_that_part_alone(
    prepared: tuple[Path, Path], tmp_path: Path
) -> None:
    source, parts = prepared
    first = tmp_path / "first"
    _calibrate(source, parts, first, _keep(tmp_path / "none", first, "c"))
    assert {p.name for p in first.iterdir()} >= {MEMO, *(runs_name(f"part{k}") for k in (1, 2, 3))}

    edited = _edited(parts, tmp_path / "edited", "model.layers.2.mlp.down_proj.MatMul.weight", 0.05)
    keep = _keep(first, tmp_path / "again", "c2")
    again = _calibrate(source, edited, tmp_path / "again", keep)
    assert keep.reused == ["part1", "part2"]
    assert again == _calibrate(source, edited, tmp_path / "whole")  # every part run: the same
    memo = json.loads((tmp_path / "again" / MEMO).read_text())
    assert memo["parts"][-1] == ["part3", "c2"]
    for k in (1, 2, 3):  # the runs the kept parts read, copied; the last one's, the same
        name = runs_name(f"part{k}")
        assert (tmp_path / "again" / name).read_bytes() == (first / name).read_bytes()

    # The memo of that calibration serves the next one in turn.
    keep = _keep(tmp_path / "again", tmp_path / "third", "c3")
    assert _calibrate(source, parts, tmp_path / "third", keep) == _calibrate(
        source, parts, tmp_path / "plain"
    )
    assert keep.reused == ["part1", "part2"]


def test_an_edit_that_changes_the_tokens_calibrates_every_part(
    prepared: tuple[Path, Path], tmp_path: Path
) -> None:
    source, parts = prepared
    first = tmp_path / "first"
    _calibrate(source, parts, first, _keep(tmp_path / "none", first, "c"))
    flipped = _edited(parts, tmp_path / "flipped", "lm_head.MatMul.weight", -1.0, scale=True)
    keep = _keep(first, tmp_path / "again", "c2")
    again = _calibrate(source, flipped, tmp_path / "again", keep)
    assert keep.reused == []
    assert again == _calibrate(source, flipped, tmp_path / "whole")
    memo = json.loads((tmp_path / "again" / MEMO).read_text())
    assert memo["tokens"] != json.loads((first / MEMO).read_text())["tokens"]
    # The replay's files went, the job's stayed (its scratch folder: a directory), and the
    # memo lists the calibration's files only.
    assert (tmp_path / "again" / ".scratch").is_dir()
    assert (tmp_path / "again" / ".epbuild-worker.log").is_file()
    assert sorted(memo["files"]) == sorted(
        [*(f"{s}.ranges.json" for s in STAGES), *(runs_name(f"part{k}") for k in (1, 2, 3))]
    )


def test_a_memo_of_other_settings_or_a_changed_file_is_not_used(
    prepared: tuple[Path, Path], tmp_path: Path
) -> None:
    source, parts = prepared
    first = tmp_path / "first"
    _calibrate(source, parts, first, _keep(tmp_path / "none", first, "c"))
    other = Keep(
        str(first), str(tmp_path / "other"), {"part1": "a", "part2": "b", "part3": "c2"}, {}
    )
    _calibrate(source, parts, tmp_path / "other", other)
    assert other.reused == []
    (first / "part1_context.ranges.json").write_text("{}")  # no longer the memo's
    keep = _keep(first, tmp_path / "again", "c2")
    _calibrate(source, parts, tmp_path / "again", keep)
    assert keep.reused == []


@pytest.mark.parametrize("damage", ["a key removed", "its inputs reordered"])
def test_a_memo_edited_by_hand_is_not_used(
    prepared: tuple[Path, Path], tmp_path: Path, damage: str
) -> None:
    source, parts = prepared
    first = tmp_path / "first"
    _calibrate(source, parts, first, _keep(tmp_path / "none", first, "c"))
    memo = json.loads((first / MEMO).read_text())
    if damage == "a key removed":  # a KeyError in the worker on every build after it
        del memo["inputs"]
    else:  # valid JSON whose runs would be read under other names: other ranges
        memo["inputs"]["part3"].reverse()
    (first / MEMO).write_text(json.dumps(memo))
    edited = _edited(parts, tmp_path / "edited", "model.layers.2.mlp.down_proj.MatMul.weight", 0.05)
    keep = _keep(first, tmp_path / "again", "c2")
    again = _calibrate(source, edited, tmp_path / "again", keep)
    assert keep.reused == []
    assert again == _calibrate(source, edited, tmp_path / "whole")
