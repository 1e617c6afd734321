"""A source that is a ``decoder-pipeline`` already (as Olive writes it): compiled stage by
stage as it is (stages with static shapes for QNN; the dynamic ``lm_head`` stage copied and
left on the CPU), packaged with a config that points at the compiled stages, and checked by
``verify --generate`` against the source run on the CPU."""

from __future__ import annotations

import json

import onnx
import pytest
from conftest import Workspace
from llmfixture import LLM_FIXTURES

from epbuild.errors import ManifestError
from epbuild.llm.generate import genai_installed
from epbuild.manifest.load import load_manifest
from epbuild.planning.noop import fast_noop

FIXTURES = LLM_FIXTURES
PIPELINE = FIXTURES / "llama-pipeline"
needs_genai = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")


def _ws(ws: Workspace, *, share: bool, extra: str = "") -> None:
    ws.llm(PIPELINE.name, share=share, context=None, window=None)
    ws.manifest((ws.root / "epbuild.toml").read_text() + extra)


def _compiled(stderr: str) -> list[str]:
    return sorted(ln.split()[2] for ln in stderr.splitlines() if " compiled " in ln)


def test_fixture_is_an_olive_style_pipeline(workspace: Workspace) -> None:
    config = json.loads((PIPELINE / "genai_config.json").read_text())
    assert config["model"]["type"] == "decoder-pipeline"
    stages = [next(iter(e)) for e in config["model"]["decoder"]["pipeline"]]
    assert stages == ["context", "iterator", "lm_head"]
    assert sum(p.stat().st_size for p in PIPELINE.iterdir()) < 2_000_000  # stays tiny
    assert (FIXTURES / "make_pipeline_fixture.py").is_file()  # the script that made it
    _ws(workspace, share=False)
    llm = load_manifest(workspace.root / "epbuild.toml").llms["chat"]
    assert (llm.form, llm.context_length, llm.window_size) == ("decoder-pipeline", 64, 16)


def test_static_keys_must_match_the_graphs(workspace: Workspace) -> None:
    _ws(workspace, share=False, extra="context_length = 32\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(workspace.root / "epbuild.toml")
    assert info.value.key == "llms.chat.context_length"
    assert "decoder-pipeline whose graphs are static already (context_length 64" in str(info.value)
    _ws(workspace, share=False, extra="context_length = 64\nwindow_size = 16\n")
    assert load_manifest(workspace.root / "epbuild.toml").llms["chat"].window_size == 16


def test_builds_stage_by_stage_and_a_cpu_stage_edit_compiles_nothing(
    workspace: Workspace,
) -> None:
    _ws(workspace, share=False)
    first = workspace.main("build", check=True)
    assert _compiled(first.stderr) == ["chat/htp-v73/context", "chat/htp-v73/iterator"]
    out = workspace.root / "build" / "chat" / "htp-v73"
    for stage in ("context", "iterator"):
        ops = [n.op_type for n in onnx.load(out / f"{stage}_ctx.onnx").graph.node]
        assert ops == ["EPContext"]  # GroupQueryAttention on the HTP too
    source = workspace.root / "models" / "tiny"
    assert (out / "lm_head.onnx").read_bytes() == (source / "lm_head.onnx").read_bytes()
    config = json.loads((out / "genai_config.json").read_text())
    stages = {k: v for e in config["model"]["decoder"]["pipeline"] for k, v in e.items()}
    assert stages["context"]["filename"] == "context_ctx.onnx"
    assert stages["iterator"]["run_on_prompt"] is False
    qnn = [{"qnn": {"backend_type": "htp", "htp_arch": "73", "soc_model": "60"}}]
    assert stages["context"]["session_options"]["provider_options"] == qnn
    assert (
        stages["lm_head"]
        == json.loads((source / "genai_config.json").read_text())["model"]["decoder"]["pipeline"][
            2
        ]["lm_head"]
    )  # the CPU stage as it was

    workspace.cli("build", check=True)  # all up to date: the no-op fingerprint
    assert fast_noop(str(workspace.root), None, []) is not None
    head = onnx.load(source / "lm_head.onnx")
    head.doc_string = "edited"
    onnx.save(head, source / "lm_head.onnx")
    assert fast_noop(str(workspace.root), None, []) is None
    again = workspace.main("build", check=True)
    assert _compiled(again.stderr) == [] and "2 up to date" in again.stdout
    assert (out / "lm_head.onnx").read_bytes() == (source / "lm_head.onnx").read_bytes()


@needs_genai
def test_verify_generate_matches_the_source(workspace: Workspace) -> None:
    _ws(workspace, share=False)
    workspace.main("build", check=True)
    doc = workspace.cli_json("verify", "--generate", "--tokens", "8")
    (check,) = doc["generate"]
    assert check["status"] == "ok", check
    assert check["comparison"]["verdict"] in ("match", "near_tie"), check
    assert check["comparison"]["compared"] == 8


@pytest.mark.slow
@needs_genai
def test_shared_build_is_one_action_and_not_checkable_here(workspace: Workspace) -> None:
    _ws(workspace, share=True)
    first = workspace.cli("build", check=True)
    assert _compiled(first.stderr) == ["chat/htp-v73"]
    (check,) = workspace.cli_json("verify", "--generate", "--tokens", "4")["generate"]
    assert check["status"] == "not_checkable" and "x86" in check["reason"], check
