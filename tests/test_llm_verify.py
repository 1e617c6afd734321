"""``epbuild verify --generate``: built LLM packages generate through onnxruntime-genai +
QNN (emulated HTP) in a child process and their greedy tokens are compared with the CPU
source's; shared packages are not checkable on x86_64, divergences and crashes fail."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import Workspace
from llmfixture import LLM_FIXTURES

from epbuild.errors import UserError
from epbuild.inspection.verify import verify_outputs
from epbuild.llm.generate import genai_installed

pytestmark = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
FIXTURES = LLM_FIXTURES


def _built(ws: Workspace, *, share: bool, family: str = "llama") -> None:
    ws.llm(family, share=share)
    ws.cli("build", check=True)


@pytest.mark.slow
def test_unshared_package_matches_the_source(workspace: Workspace) -> None:
    _built(workspace, share=False)
    proc = workspace.cli("verify", "--generate", "--tokens", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chat/htp-v73: generate: all 8 greedy tokens match the source (" in proc.stdout
    assert "tokens/s; CPU source" in proc.stdout
    doc = workspace.cli_json("verify", "--generate", "--tokens", "8")
    (check,) = doc["generate"]
    assert check["status"] == "ok" and check["folder"] == "build/chat/htp-v73"
    assert check["comparison"]["verdict"] == "match" and check["comparison"]["matched"] == 8
    assert check["tokens_per_second"] > 0 and check["source_tokens_per_second"] > 0
    assert "generate" not in workspace.cli_json("verify")  # only when asked
    assert check["prompt"] == "The quick brown fox"  # the default


@pytest.mark.slow
def test_prompt_from_the_manifest_and_the_command_line(workspace: Workspace) -> None:
    _built(workspace, share=False)
    manifest = workspace.root / "epbuild.toml"
    manifest.write_text(manifest.read_text() + 'prompt = "Hello world"\n')
    (check,) = workspace.cli_json("verify", "--generate", "--tokens", "3")["generate"]
    assert check["prompt"] == "Hello world" and check["status"] == "ok"
    doc = workspace.cli_json("verify", "--generate", "--tokens", "3", "--prompt", "A build")
    assert doc["generate"][0]["prompt"] == "A build"


def test_shared_package_is_not_checkable_here(workspace: Workspace) -> None:
    _built(workspace, share=True)
    proc = workspace.cli("verify", "--generate")
    assert proc.returncode == 0
    assert "chat/htp-v73: generate: not checkable: a weight-shared HTP package" in proc.stdout
    assert "crashes ONNX Runtime's x86_64 emulation" in proc.stdout


@pytest.mark.slow
def test_clear_divergence_fails_naming_step_tokens_and_margin(workspace: Workspace) -> None:
    _built(workspace, share=False)
    # The source now holds other weights (the Qwen2 fixture's): the package no longer
    # computes what it does, with clear margins.
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(FIXTURES / "qwen2" / name, workspace.root / "models" / "tiny" / name)
    proc = workspace.cli("verify", "--generate", "--tokens", "4")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "generate:" in ln)
    assert line.startswith("chat/htp-v73: generate: diverged at step 0: token ")
    assert "vs the source's" in line and "source top-2 margin" in line


@pytest.mark.slow
def test_a_broken_package_fails_with_the_reason(workspace: Workspace) -> None:
    _built(workspace, share=False)
    config = workspace.root / "build" / "chat" / "htp-v73" / "genai_config.json"
    data = json.loads(config.read_text())
    data["model"]["decoder"]["pipeline"][0]["context"]["filename"] = "missing_ctx.onnx"
    config.write_text(json.dumps(data))
    proc = workspace.cli("verify", "--generate", "--tokens", "4")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "chat/htp-v73: generate: failed: generation failed (exit 1): " in proc.stdout


def test_without_genai_says_how_to_install(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    _built(workspace, share=False)
    monkeypatch.setattr("epbuild.inspection.generation.genai_installed", lambda: False)
    with pytest.raises(UserError) as info:
        verify_outputs(workspace.root, generate=4)
    assert "needs onnxruntime-genai" in str(info.value)
    assert 'pip install "epbuild[genai]"' in str(info.value)
