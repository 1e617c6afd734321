"""``epbuild watch`` follows LLM sources: an edit of genai_config.json rewrites the package
(and compiles nothing), a new file in the source folder is copied into it, a changed source
decoder recompiles the LLM's graphs, and a broken genai_config.json is a manifest error. A
quantized LLM's prompts files are followed too: an edit, or a new file its glob matches,
calibrates it again."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import onnx
import pytest
from conftest import Workspace
from llmfixture import TEXT_PROMPTS
from test_llm_quantize import quantized
from test_watch import Watcher, built

from epbuild.manifest.load import load_manifest
from epbuild.watching import make_targets


@pytest.fixture
def llm_watch(workspace: Workspace) -> Iterator[tuple[Workspace, Watcher]]:
    workspace.llm()
    w = Watcher(workspace.root)
    try:
        first = w.next()
        assert sorted(built(first)) == [
            "chat/htp-v73/context",
            "chat/htp-v73/iterator",
            "chat/htp-v73/package",
            "chat/prepare",
        ], first
        yield workspace, w
    finally:
        w.close()


def test_watch_targets_an_llms_source_folder(workspace: Workspace) -> None:
    """What the watcher wakes for in an LLM's source folder: its files, a new file beside
    them (copied into the package), the source decoder; never the prepared graphs or the
    package (the build writes those)."""
    ws = workspace.llm()
    t = make_targets(load_manifest(ws.root / "epbuild.toml"), [])
    root = str(ws.root)
    source = os.path.join(root, "models", "tiny")
    assert os.path.join(source, "genai_config.json") in t.files
    for graph in ("context", "iterator"):
        assert "models/tiny/genai_config.json" in t.inputs[f"chat/htp-v73/{graph}"]
    assert (source, False) in t.dirs
    for name in ("chat_template.jinja", "model.onnx", "model.onnx.data"):
        assert t.wants(os.path.join(source, name), False), name
    assert not t.wants(os.path.join(source, ".genai_config.json.swp"), False)
    for written in (".epbuild/llm/chat/prepared/context.onnx", "build/chat/htp-v73/x.json"):
        assert not t.wants(os.path.join(root, written), False), written


# A watcher over a whole LLM pipeline (five builds). Fast: what it wakes for in the source
# folder (test_watch_targets_an_llms_source_folder); what an edit of each source file rebuilds
# (test_llm_noop.py, test_graph's test_a_preparation_with_the_same_graphs_compiles_nothing);
# a broken genai_config.json named (test_llm_hostile.py); a watcher's cycles (test_watch.py).
@pytest.mark.slow
def test_watch_follows_llm_sources(llm_watch: tuple[Workspace, Watcher]) -> None:
    ws, w = llm_watch
    source = ws.root / "models" / "tiny"
    package = ws.root / "build" / "chat" / "htp-v73"

    config = json.loads((source / "genai_config.json").read_text())
    config["search"]["top_k"] = 3
    (source / "genai_config.json").write_text(json.dumps(config))
    cycle = w.next()
    assert cycle["changed"] == ["models/tiny/genai_config.json"], cycle
    assert built(cycle) == {"chat/htp-v73/package": "compiled"}  # nothing compiled
    assert cycle["summary"]["up_to_date"] == 3 and cycle["summary"]["packaged"] == 1
    assert json.loads((package / "genai_config.json").read_text())["search"]["top_k"] == 3

    (source / "chat_template.jinja").write_text("{{ messages }}")
    cycle = w.next()
    assert cycle["changed"] == ["models/tiny/chat_template.jinja"], cycle
    assert (package / "chat_template.jinja").read_text() == "{{ messages }}"

    (source / "genai_config.json").write_text("{ not json")
    cycle = w.next()
    assert "genai_config.json is not valid JSON" in (cycle["manifest_error"] or ""), cycle
    (source / "genai_config.json").write_text(json.dumps(config))
    cycle = w.next()
    assert cycle["manifest_error"] is None and cycle["summary"] is not None, cycle

    model = onnx.load(source / "model.onnx", load_external_data=False)
    model.doc_string = "edited"
    onnx.save(model, source / "model.onnx")
    cycle = w.next()
    assert cycle["changed"] == ["models/tiny/model.onnx"], cycle
    assert sorted(built(cycle)) == [
        "chat/htp-v73/context",
        "chat/htp-v73/iterator",
        "chat/prepare",
    ], cycle
    w.quiet(1.0)


def _prompted(ws: Workspace) -> Workspace:
    """The quantized text Llama, calibrated on ``prompts/*.txt`` (``a.txt``: the first five
    prompts)."""
    (ws.root / "prompts").mkdir(parents=True)
    lines = TEXT_PROMPTS.read_text().splitlines()
    (ws.root / "prompts" / "a.txt").write_text("\n".join(lines[:5]) + "\n")
    return quantized(ws, calibration="prompts/*.txt")


def test_watch_targets_a_quantized_llms_prompts(workspace: Workspace) -> None:
    ws = _prompted(workspace)
    t = make_targets(load_manifest(ws.root / "epbuild.toml"), [])
    root = str(ws.root)
    folder = os.path.join(root, "prompts")
    assert os.path.join(folder, "a.txt") in t.files
    for graph in ("context", "iterator"):
        assert "prompts/a.txt" in t.inputs[f"chat/htp-v73/{graph}"]
    assert t.listed == {folder} and (folder, False) in t.dirs
    assert t.wants(os.path.join(folder, "b.txt"), False)  # a new file the glob may match
    assert not t.wants(os.path.join(folder, ".b.txt.swp"), False)
    assert not t.wants(os.path.join(root, "elsewhere", "b.txt"), False)


@pytest.mark.slow  # its rule (the prompts are inputs): test_watch_targets_a_quantized_llms_prompts
def test_watch_calibrates_again_when_the_prompts_change(workspace: Workspace) -> None:
    ws = _prompted(workspace)
    prompts = ws.root / "prompts"
    lines = TEXT_PROMPTS.read_text().splitlines()
    w = Watcher(ws.root)
    try:
        first = w.next()
        assert first["summary"]["failed"] == 0, first
        assert "chat/calibrate" in built(first) and "chat/htp-v73/package" in built(first)

        # A prompt said twice gives the same ranges: calibrated again, cut off there.
        (prompts / "a.txt").write_text("\n".join([*lines[:5], lines[0]]) + "\n")
        cycle = w.next()
        assert cycle["changed"] == ["prompts/a.txt"], cycle
        assert built(cycle) == {"chat/calibrate": "compiled"}, cycle

        # A new file the glob matches joins the calibration.
        (prompts / "b.txt").write_text(lines[5] + "\n")
        cycle = w.next()
        assert cycle["changed"] == ["prompts/b.txt"] and cycle["manifest_reloaded"], cycle
        assert "chat/calibrate" in built(cycle), cycle
        assert cycle["summary"]["failed"] == 0, cycle
        assert ws.cli_json("build")["summary"]["up_to_date"] == 7  # nothing left stale
    finally:
        w.close()
