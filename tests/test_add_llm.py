"""``epbuild add llm`` and ``epbuild init --from`` a genai model folder: [llms.NAME] tables
written the way every edit is (the user's text kept, the loader's refusals with the file
left byte-identical), and what they write loads as the LLM form."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import Workspace
from modelgen import matmul_model
from test_add import HAND_WRITTEN, changes, run

from epbuild.manifest.load import load_manifest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"


@pytest.fixture
def ws(workspace: Workspace) -> Workspace:
    """The hand-written manifest of test_add, and a builder-made genai folder."""
    for i, name in enumerate("abc"):
        workspace.model(f"models/{name}.onnx", matmul_model(i))
    workspace.manifest(HAND_WRITTEN)
    shutil.copytree(FIXTURES / "llama", workspace.root / "models" / "tiny")
    return workspace


def test_add_llm_writes_a_table_and_keeps_the_rest(ws: Workspace) -> None:
    before = (ws.root / "epbuild.toml").read_text()
    rc, out, err = run(
        ws, "add", "llm", "chat", "models/tiny", "--context-length", "64",
        "--window-size", "16", "--no-share-weights",
    )  # fmt: skip
    assert rc == 0, err
    assert "added llm chat (models/tiny, for htp)" in out
    removed, added = changes(before, (ws.root / "epbuild.toml").read_text())
    assert removed == []
    assert added == [
        "",
        "[llms.chat]",
        'source = "models/tiny"',
        'providers = ["htp"]',
        "context_length = 64",
        "window_size = 16",
        "share_weights = false",
    ]
    llm = load_manifest(ws.root / "epbuild.toml").llms["chat"]
    assert (llm.context_length, llm.window_size, llm.share_weights) == (64, 16, False)
    assert llm.form == "decoder" and llm.providers == ("htp",)

    # Again with another setting: the entry is updated, not duplicated.
    rc, out, _ = run(ws, "add", "llm", "chat", "models/tiny", "--window-size", "8")
    assert rc == 0 and "llm chat: window_size = 8" in out
    assert load_manifest(ws.root / "epbuild.toml").llms["chat"].window_size == 8
    rc, out, _ = run(ws, "add", "llm", "chat", "models/tiny")
    assert rc == 0 and "nothing to change" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--context-length", "4096"], "4096 is above the model's limit of 128"),
        (["--context-length", "32", "--window-size", "64"], "64 is above context_length (32)"),
        (["--provider", "nowhere"], "[providers.nowhere]"),
        (["--context-length", "0"], "llms.chat.context_length"),
    ],
)
def test_what_the_loader_refuses_is_refused_and_nothing_written(
    ws: Workspace, args: list[str], message: str
) -> None:
    before = (ws.root / "epbuild.toml").read_bytes()
    rc, _, err = run(ws, "add", "llm", "chat", "models/tiny", *args)
    assert rc != 0 and message in err and "Traceback" not in err, err
    assert (ws.root / "epbuild.toml").read_bytes() == before


def test_bad_sources_and_names_are_refused(ws: Workspace) -> None:
    before = (ws.root / "epbuild.toml").read_bytes()
    (ws.root / "models" / "empty").mkdir()
    cases = [
        (["chat", "models/missing"], "models/missing: does not exist"),
        (["chat", "models/empty"], "models/empty: has no genai_config.json"),
        (["vision", "models/tiny"], "names a group too"),  # a group's name
        (["chat", "../outside"], "outside the workspace"),
    ]
    for args, message in cases:
        rc, _, err = run(ws, "add", "llm", *args)
        assert rc != 0 and message in err, (args, err)
        assert (ws.root / "epbuild.toml").read_bytes() == before
    assert run(ws, "add", "llm", "chat", "models/tiny")[0] == 0
    rc, _, err = run(ws, "add", "llm", "chat", "models")
    assert rc != 0 and "llm 'chat' already exists for 'models/tiny' (" in err


def test_a_provider_must_be_named_where_there_are_several(ws: Workspace) -> None:
    assert run(ws, "add", "target", "snapdragon-8-gen-3")[0] == 0
    rc, _, err = run(ws, "add", "llm", "chat", "models/tiny")
    assert rc != 0 and "pass --provider" in err
    rc, _, err = run(ws, "add", "llm", "chat", "models/tiny", "-p", "snapdragon-8-gen-3")
    assert rc == 0, err


def test_init_from_a_genai_folder_writes_an_llm(workspace: Workspace) -> None:
    shutil.copytree(FIXTURES / "llama", workspace.root / "models" / "tiny")
    rc, out, err = run(workspace, "init", "--from", "models/tiny")
    assert rc == 0, err
    assert "llm tiny: models/tiny (llama, genai model)" in out
    m = load_manifest(workspace.root / "epbuild.toml")
    assert not m.groups  # model.onnx is the LLM's, not a group's
    llm = m.llms["tiny"]
    assert (llm.source, llm.providers) == ("models/tiny", ("htp-v73",))
    assert (llm.context_length, llm.window_size, llm.share_weights) == (128, 64, True)


def test_init_from_a_decoder_pipeline_keeps_its_static_shapes(workspace: Workspace) -> None:
    shutil.copytree(FIXTURES / "llama-pipeline", workspace.root / "models" / "pipe")
    rc, _, err = run(workspace, "init", "--from", "models/pipe")
    assert rc == 0, err
    text = (workspace.root / "epbuild.toml").read_text()
    assert "context_length" not in text and "window_size" not in text  # fixed by its graphs
    llm = load_manifest(workspace.root / "epbuild.toml").llms["pipe"]
    assert (llm.form, llm.context_length, llm.window_size) == ("decoder-pipeline", 64, 16)


def test_init_from_a_tree_with_models_and_genai_folders(workspace: Workspace) -> None:
    workspace.model("models/vision/cnn.onnx", matmul_model(1))
    shutil.copytree(FIXTURES / "qwen2", workspace.root / "models" / "qwen")
    encoder = workspace.root / "models" / "whisper"
    shutil.copytree(FIXTURES / "llama", encoder)
    config = json.loads((encoder / "genai_config.json").read_text())
    config["model"]["encoder"] = {"filename": "encoder.onnx"}
    (encoder / "genai_config.json").write_text(json.dumps(config))
    rc, out, err = run(workspace, "init", "--from", "models", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["llms"] == [{"name": "qwen", "source": "models/qwen"}]
    assert [g["models"] for g in doc["groups"]] == [["models/vision/cnn.onnx"]]
    assert any("models/whisper: is a 'llama' model with an encoder" in s for s in doc["skipped"])
    m = load_manifest(workspace.root / "epbuild.toml")
    assert m.llms["qwen"].model_type == "qwen2"
