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
    ws.main("build", check=True)


@pytest.mark.slow
def test_unshared_package_matches_the_source(llm_built: Workspace) -> None:
    workspace = llm_built  # _built(share=False): built once per session, copied
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
def test_prompt_from_the_manifest_and_the_command_line(llm_built: Workspace) -> None:
    workspace = llm_built  # _built(share=False): built once per session, copied
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
def test_clear_divergence_fails_naming_step_tokens_and_margin(llm_built: Workspace) -> None:
    workspace = llm_built  # _built(share=False): built once per session, copied
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
def test_a_broken_package_fails_with_the_reason(llm_built: Workspace) -> None:
    workspace = llm_built  # _built(share=False): built once per session, copied
    config = workspace.root / "build" / "chat" / "htp-v73" / "genai_config.json"
    data = json.loads(config.read_text())
    data["model"]["decoder"]["pipeline"][0]["context"]["filename"] = "missing_ctx.onnx"
    config.write_text(json.dumps(data))
    proc = workspace.cli("verify", "--generate", "--tokens", "4")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "chat/htp-v73: generate: failed: generation failed (exit 1): " in proc.stdout


def test_without_genai_says_how_to_install(
    llm_built: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = llm_built  # _built(share=False): built once per session, copied
    monkeypatch.setattr("epbuild.inspection.generation.genai_installed", lambda: False)
    with pytest.raises(UserError) as info:
        verify_outputs(workspace.root, generate=4)
    assert "needs onnxruntime-genai" in str(info.value)
    assert 'pip install "epbuild[genai]"' in str(info.value)


def test_a_generation_past_its_timeout_fails_saying_how_far_it_got(llm_built: Workspace) -> None:
    """Real children, a limit no generation can meet: exit 1, what got done, the option."""
    workspace = llm_built  # _built(share=False): built once per session, copied
    proc = workspace.cli("verify", "--generate", "--timeout", "0.001")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "generate:" in ln)
    assert line == (
        "chat/htp-v73: generate: failed: the CPU source: generation did not finish within "
        "0.001 s: still loading the model, 0 of 10 tokens; give it more time with --timeout "
        "SECONDS (0: no limit)"
    )
    (check,) = workspace.cli_json("verify", "--generate", "--timeout", "0.001")["generate"]
    assert check["status"] == "failed" and check["timed_out"] is True


@pytest.mark.slow
def test_a_timeout_longer_than_a_child_can_be_waited_on_is_no_limit(
    llm_built: Workspace,
) -> None:
    """``poll`` takes an int of milliseconds: a year of seconds, or 1e20, waits forever."""
    for seconds in ("31536000", "99999999999999999999"):
        proc = llm_built.cli("verify", "--generate", "--tokens", "2", "--timeout", seconds)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "generate: all 2 greedy tokens match the source" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_a_prompt_that_fills_the_kv_cache_is_exit_2_naming_it(llm_built: Workspace) -> None:
    """Read in windows of 16, a prompt of 49 to 64 tokens fills the 64-token cache: genai
    stops the package at its first token while the source goes on; a longer one stops the
    source too. Neither is the package's fault: the option is named."""
    from epbuild.llm.calibrate import tokenize

    source = str(llm_built.root / "models" / "tiny")
    words = next(n for n in range(1, 64) if len(tokenize(source, ["word " * n])[0]) > 48)
    for prompt in ("word " * words, "word " * 200):
        proc = llm_built.cli("verify", "--generate", "--prompt", prompt)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "error: --prompt: " in proc.stderr and "no token is left" in proc.stderr
        assert "give a prompt of at most 48 tokens" in proc.stderr, proc.stderr


def test_a_bad_timeout_is_exit_2_naming_the_option(workspace: Workspace) -> None:
    workspace.llm("llama", share=False)
    for args in (("--generate", "--timeout", "soon"), ("--generate", "--timeout", "-5")):
        proc = workspace.cli("verify", *args)
        assert proc.returncode == 2, proc.stderr
        assert f"epbuild: error: --timeout '{args[-1]}' is not a number of seconds" in proc.stderr
    proc = workspace.cli("verify", "--timeout", "5")
    assert proc.returncode == 2 and "--timeout applies to verify --generate only" in proc.stderr


def test_the_token_limit_comes_from_the_llms_quantization_table() -> None:
    from types import SimpleNamespace

    from epbuild.inspection.generation import token_limit
    from epbuild.manifest.model import QuantCheck, Quantization

    recipe = Quantization("w8a16", ("p.txt",), check=QuantCheck(min_token_agreement=0.8))
    manifest = SimpleNamespace(quantization={"w8a16": recipe})
    quantized = SimpleNamespace(quantize="w8a16")
    limit = token_limit(manifest, quantized)  # type: ignore[arg-type]
    assert limit is not None and limit.share == 0.8
    assert limit.key == "[quantization.w8a16.check] min_token_agreement"
    assert token_limit(manifest, SimpleNamespace(quantize=None)) is None  # type: ignore[arg-type]


def test_min_token_agreement_is_a_check_key(workspace: Workspace) -> None:
    from epbuild.errors import ManifestError
    from epbuild.manifest.load import load_manifest
    from epbuild.manifest.model import QuantCheck

    (workspace.root / "calib").mkdir(parents=True)
    (workspace.root / "calib" / "a.npy").write_bytes(b"")
    base = '[quantization.q]\ncalibration = "calib/a.npy"\n'
    (workspace.root / "epbuild.toml").write_text(base)
    recipe = load_manifest(workspace.root / "epbuild.toml").quantization["q"]
    assert recipe.check == QuantCheck() and recipe.check.min_token_agreement == 0.9
    (workspace.root / "epbuild.toml").write_text(base + "check = { min_token_agreement = 0.95 }\n")
    recipe = load_manifest(workspace.root / "epbuild.toml").quantization["q"]
    assert recipe.check.min_token_agreement == 0.95
    (workspace.root / "epbuild.toml").write_text(base + "check = { min_token_agreement = 1.5 }\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(workspace.root / "epbuild.toml")
    assert "min_token_agreement" in str(info.value) and info.value.exit_code == 2


@pytest.mark.slow
def test_a_quantized_package_is_held_to_its_agreement_limit(
    llm_built: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a limit (what a quantized LLM gets), a package that matches passes with its
    agreement said, and one whose source now computes something else (junk, as the emulated
    HTP generates from int4 weights) fails naming how few agree and where it starts."""
    from epbuild.inspection.generation import TokenLimit

    workspace = llm_built  # _built(share=False): built once per session, copied
    limit = TokenLimit(0.9, "[quantization.w8a16.check] min_token_agreement")
    monkeypatch.setattr("epbuild.inspection.generation.token_limit", lambda *_: limit)
    (good,) = verify_outputs(workspace.root, generate=6).generations or []
    assert good.status.value == "ok", good.line()
    assert good.line().startswith(
        "chat/htp-v73: generate: 6 of 6 greedy tokens agree with the source (at least 90% needed) ("
    )
    assert good.line().endswith("[[quantization.w8a16.check] min_token_agreement]")
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(FIXTURES / "qwen2" / name, workspace.root / "models" / "tiny" / name)
    result = verify_outputs(workspace.root, generate=6)
    (bad,) = result.generations or []
    assert not result.ok and bad.status.value == "failed"
    assert bad.line().startswith("chat/htp-v73: generate: too few agree: ")
    assert "greedy tokens agree with the source (at least 90% needed)" in bad.line()
    assert "first difference at step 0: token " in bad.line()
    doc = bad.to_json()
    assert doc["min_token_agreement"] == 0.9 and doc["prompts"][0]["agreement"]["compared"] == 6
