"""The ``[llms.NAME]`` manifest form: keys, defaults, and each bad source refused with one
message naming the manifest's line and key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Workspace

from epbuild.errors import ManifestError
from epbuild.manifest.load import load_manifest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"

PROVIDER = """\
[providers.htp-v73]
ep = "qnn"
options = { htp_arch = "73", soc_model = "60" }

"""
LLM = """\
[llms.chat]
source = "models/tiny"
providers = ["htp-v73"]
context_length = 64
window_size = 16
"""


def _source(ws: Workspace, family: str = "llama", rel: str = "models/tiny") -> Path:
    """A copy of a committed builder-made fixture folder in the workspace."""
    folder = ws.root / rel
    shutil.copytree(FIXTURES / family, folder)
    return folder


def _edit_config(folder: Path, edit: dict[str, object]) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"].update(edit)
    path.write_text(json.dumps(config))


def _err(ws: Workspace, text: str) -> ManifestError:
    path = ws.manifest(PROVIDER + text)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    return info.value


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_builder_fixture_loads(workspace: Workspace, family: str) -> None:
    _source(workspace, family)
    m = load_manifest(workspace.manifest(PROVIDER + LLM))
    llm = m.llms["chat"]
    assert (llm.source, llm.providers) == ("models/tiny", ("htp-v73",))
    assert (llm.context_length, llm.window_size) == (64, 16)
    assert llm.share_weights is True  # the default: N+1, as devices want
    assert (llm.form, llm.model_type) == ("decoder", family)


def test_defaults_follow_the_model_limit(workspace: Workspace) -> None:
    _source(workspace)
    text = LLM.replace("context_length = 64\nwindow_size = 16\n", "share_weights = false\n")
    llm = load_manifest(workspace.manifest(PROVIDER + text)).llms["chat"]
    # The fixture's limit (128) is below the default context_length (1024).
    assert (llm.context_length, llm.window_size, llm.share_weights) == (128, 64, False)


def test_unknown_key_names_line(workspace: Workspace) -> None:
    _source(workspace)
    err = _err(workspace, LLM + "windowsize = 8\n")
    assert err.key == "llms.chat.windowsize" and err.line == 10
    assert "unknown key" in str(err) and "window_size" in str(err)


def test_undefined_provider(workspace: Workspace) -> None:
    _source(workspace)
    err = _err(workspace, LLM.replace('["htp-v73"]', '["htp-v75"]'))
    assert err.key == "llms.chat.providers" and err.line == 7
    assert "[providers.htp-v75]" in str(err)


def test_missing_genai_config(workspace: Workspace) -> None:
    (_source(workspace) / "genai_config.json").unlink()
    err = _err(workspace, LLM)
    assert err.key == "llms.chat.source" and err.line == 6
    assert "models/tiny: has no genai_config.json" in str(err)
    assert "onnxruntime_genai.models.builder" in str(err)  # the hint says how to make one


def test_missing_folder(workspace: Workspace) -> None:
    workspace.root.mkdir(parents=True, exist_ok=True)
    err = _err(workspace, LLM)
    assert err.key == "llms.chat.source" and "models/tiny: does not exist" in str(err)


def test_encoder_model_refused(workspace: Workspace) -> None:
    folder = _source(workspace)
    _edit_config(folder, {"type": "whisper", "encoder": {"filename": "encoder.onnx"}})
    err = _err(workspace, LLM)
    assert err.key == "llms.chat.source"
    assert "'whisper' model with an encoder" in str(err) and "not a decoder-only" in str(err)


def test_unknown_pipeline_shape_refused(workspace: Workspace) -> None:
    folder = _source(workspace)
    config = json.loads((folder / "genai_config.json").read_text())
    del config["model"]["decoder"]["filename"]
    (folder / "genai_config.json").write_text(json.dumps(config))
    err = _err(workspace, LLM)
    assert "neither a filename nor a pipeline" in str(err)


def test_context_length_above_model_limit(workspace: Workspace) -> None:
    _source(workspace)
    err = _err(workspace, LLM.replace("context_length = 64", "context_length = 4096"))
    assert err.key == "llms.chat.context_length" and err.line == 8
    assert "4096 is above the model's limit of 128" in str(err)


def test_window_above_context(workspace: Workspace) -> None:
    _source(workspace)
    err = _err(workspace, LLM.replace("window_size = 16", "window_size = 65"))
    assert err.key == "llms.chat.window_size" and err.line == 9
    assert "65 is above context_length (64)" in str(err)


def test_a_window_as_long_as_the_context_leaves_no_token_to_generate(
    workspace: Workspace,
) -> None:
    """genai stops such a package at its first token: refused, and never the default."""
    _source(workspace)
    err = _err(workspace, LLM.replace("window_size = 16", "window_size = 64"))
    assert err.key == "llms.chat.window_size" and err.line == 9, err
    assert "window_size 64 is context_length" in str(err) and "window_size = 32" in err.hint
    text = LLM.replace("context_length = 64\nwindow_size = 16\n", "context_length = 32\n")
    llm = load_manifest(workspace.manifest(PROVIDER + text)).llms["chat"]
    assert (llm.context_length, llm.window_size) == (32, 16)
    err = _err(
        workspace, LLM.replace("context_length = 64\nwindow_size = 16\n", "context_length = 1\n")
    )
    assert err.key == "llms.chat.context_length" and "raise context_length" in err.hint


def test_name_shared_with_a_group(workspace: Workspace) -> None:
    _source(workspace)
    workspace.model("models/a.onnx")
    group = '[groups.chat]\nmodels = ["models/a.onnx"]\nproviders = ["htp-v73"]\n\n'
    err = _err(workspace, group + LLM)
    assert err.key == "llms.chat" and "names a group too" in str(err)


def test_cli_message_not_traceback(workspace: Workspace) -> None:
    (_source(workspace) / "genai_config.json").unlink()
    workspace.manifest(PROVIDER + LLM)
    proc = workspace.cli("build")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "epbuild.toml:6" in proc.stderr and "has no genai_config.json" in proc.stderr


def test_manifest_load_imports_no_onnx(workspace: Workspace) -> None:
    _source(workspace)
    path = workspace.manifest(PROVIDER + LLM)
    code = (
        "import sys; from epbuild.manifest.load import load_manifest; "
        f"load_manifest({str(path)!r}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_build_says_a_pipeline_without_a_static_stage_builds_nothing(
    workspace: Workspace,
) -> None:
    """A decoder-pipeline whose stages all have dynamic shapes (here: the builder's decoder)
    has nothing an NPU takes: no build may read as having made it."""
    folder = _source(workspace)
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    del decoder["filename"]
    decoder["pipeline"] = [{"context": {"filename": "model.onnx"}}]
    (folder / "genai_config.json").write_text(json.dumps(config))
    workspace.manifest(PROVIDER + LLM.replace("context_length = 64\nwindow_size = 16\n", ""))
    assert load_manifest(workspace.root / "epbuild.toml").llms["chat"].form == "decoder-pipeline"
    for _ in range(2):  # and never recorded for the no-op path
        proc = workspace.main("build")
        assert proc.returncode == 0
        assert "warning: llms.chat: no stage of its decoder-pipeline has static" in proc.stderr
