"""The checks of a quantized LLM (``verify --generate``, ``verify --numerics``): the package
(emulated HTP) against the float source and against its QDQ graphs on the CPU, so that a
package the quantization spoils and one the EP runs differently are told apart. The
text-trained tiny Llama as w8a16 passes both; as w4a16 (int4 weights per channel) it loses
its logits (about 6 dB) and fails both, exit 1, the message naming the gap."""

from __future__ import annotations

import shutil

import pytest
from conftest import Workspace
from llmfixture import TEXT_PROMPTS, chat_manifest, place_source

from epbuild.inspection import llmnumerics
from epbuild.inspection.generation import PromptCheck, TokenLimit, _prompt_check
from epbuild.llm.generate import Generation, genai_installed
from epbuild.results import CheckStatus

pytestmark = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")

W8A16 = 'activations = "uint16"\nweights = "uint8"\n'
W4A16 = 'activations = "uint16"\nweights = "int4"\nper_channel = true\n'
PROMPT = TEXT_PROMPTS.read_text().splitlines()[0]
"""A prompt whose tokens the int4 weights change (8 of 10 agree, on the CPU and the HTP)."""


def quantized(ws: Workspace, types: str) -> Workspace:
    """The text-trained Llama as ``llms.chat`` (unshared: loadable here), quantized with
    ``types`` calibrated on the fixture's prompts, built."""
    place_source(ws.root, "llama-text")
    shutil.copy(TEXT_PROMPTS, ws.root / "prompts.txt")
    recipe = '[quantization.q]\ncalibration = "prompts.txt"\n' + types
    ws.manifest(chat_manifest(share=False) + 'quantize = "q"\n\n' + recipe)
    ws.main("build", check=True)
    return ws


@pytest.mark.slow
def test_w8a16_passes_generate_and_numerics(workspace: Workspace) -> None:
    ws = quantized(workspace, W8A16)
    doc = ws.cli_json("verify", "--generate", "--prompt", PROMPT)
    assert doc["ok"], doc
    (check,) = doc["generate"]
    (prompt,) = check["prompts"]
    assert prompt["agreement"]["agreed"] >= 9, prompt
    assert prompt["qdq_agreement"]["agreed"] >= 9, prompt  # the QDQ graphs on the CPU
    assert prompt["agreement_with_qdq"]["compared"] == prompt["agreement"]["compared"]
    doc = ws.cli_json("verify", "--numerics")
    assert doc["ok"], doc
    checks = {c["model"]: c for c in doc["numerics"]}
    assert set(checks) == {f"build/chat/htp-v73/{g}_ctx.onnx" for g in ("context", "iterator")}
    for check in checks.values():
        outputs = {o["name"]: o for o in check["outputs"]}
        assert outputs["logits"]["sqnr_db"] >= 20, check
        assert outputs["logits"]["qdq_sqnr_db"] >= 20, check
        assert any(name.startswith("present.") for name in outputs), check
        assert check["layers"] and all(db is not None for _, db in check["layers"]), check


@pytest.mark.slow
def test_w4a16_fails_both_naming_the_gap(workspace: Workspace) -> None:
    ws = quantized(workspace, W4A16)
    proc = ws.cli("verify", "--numerics")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    said = proc.stdout + proc.stderr
    assert "context_ctx.onnx: numerics: output logits: SQNR" in said, said
    assert "against the float source (allowed ≥ 20 dB)" in said, said
    assert "so it is the quantization" in said, said
    assert "the layers with the worst SQNR: " in said, said
    proc = ws.cli("verify", "--generate", "--prompt", PROMPT)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    said = proc.stdout + proc.stderr
    assert "generate: too few agree: " in said, said
    assert "first difference at step" in said, said
    assert "the QDQ model on the CPU: " in said, said
    assert "the quantization itself loses them" in said, said


def _generation(tokens: list[int]) -> Generation:
    return Generation(tuple(tokens), tuple(1.0 for _ in tokens), 1.0)


def test_a_package_the_qdq_model_disagrees_with_is_the_eps() -> None:
    """Where the QDQ graphs on the CPU give the source's tokens and the package does not,
    the message says the EP runs them differently, and where the package starts to."""
    source = _generation([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    junk = _generation([5, 6, 7, 1, 1, 1, 1, 1, 1, 1])
    limit = TokenLimit(0.9, "[quantization.q.check] min_token_agreement")
    check: PromptCheck = _prompt_check("p", junk, source, limit, source)
    assert check.status is CheckStatus.FAILED
    text = check.describe()
    assert text.startswith("too few agree: 3 of 10 greedy tokens agree with the source"), text
    assert "first difference at step 3: token 1 vs the source's 8" in text, text
    assert "the QDQ model on the CPU: 10 of 10 agree with the source" in text, text
    assert "the package 3 of 10 with it (first difference at step 3)" in text, text
    assert "the EP runs the quantized graphs differently" in text, text
    lossy = _generation([5, 6, 7, 1, 1, 10, 11, 12, 13, 14])
    check = _prompt_check("p", lossy, source, limit, lossy)
    assert "the quantization itself loses them" in check.describe()
    assert check.to_json()["qdq_agreement"]["agreed"] == 8
    passing = _prompt_check("p", source, source, limit, source)
    assert passing.status is CheckStatus.OK
    assert "the QDQ model on the CPU: 10 of 10" in passing.describe()


def test_numerics_loaders_take_the_jobs_within_the_memory_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(llmnumerics, "default_budget", lambda: 10 << 30)
    eight = [3 << 30] * 8
    assert [llmnumerics.loaders(jobs, eight) for jobs in (1, 2, 4, 8)] == [1, 2, 3, 3]
    assert llmnumerics.loaders(8, [1 << 20]) == 1  # one graph
    assert llmnumerics.loaders(8, [20 << 30] * 8) == 1  # more than the budget: alone


def test_a_large_graph_is_compared_on_one_feed() -> None:
    assert llmnumerics.feeds_of(llmnumerics.LARGE) == 1
    assert llmnumerics.feeds_of(llmnumerics.LARGE - 1) == llmnumerics.FEEDS > 1
