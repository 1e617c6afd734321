"""A quantized LLM in parts used as a careless or hostile user would: recipes that name one
part's nodes, lifecycle edits, damaged outputs. The text-trained tiny Llama, deepened to 3
layers, built as w8a16 in 3 unshared parts through the real QNN EP (once per session;
each test edits its own copy)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
from conftest import Workspace
from llmfixture import LLM_FIXTURES, TEXT_PROMPTS, chat_manifest, deepen

from epbuild.llm.generate import genai_installed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'"),
]

RECIPE = (
    '[quantization.w8a16]\ncalibration = "prompts.txt"\nactivations = "uint16"\nweights = "uint8"\n'
)
MANIFEST = chat_manifest(share=False) + 'parts = 3\nquantize = "w8a16"\n\n' + RECIPE


def _make(ws: Workspace) -> None:
    source = ws.root / "models" / "tiny"
    shutil.copytree(LLM_FIXTURES / "llama-text", source)
    deepen(source, 3, spread=0.02)
    shutil.copy(TEXT_PROMPTS, ws.root / "prompts.txt")
    ws.manifest(MANIFEST)
    ws.cli("build", check=True)


@pytest.fixture
def built(
    built_once: Callable[[str, Callable[[Workspace], None], Workspace], Workspace],
    workspace: Workspace,
) -> Workspace:
    """The 3-part w8a16 build, the test's own copy."""
    return built_once("qparts", _make, workspace)


def _outcomes(ws: Workspace, *args: str) -> dict[str, str]:
    doc = ws.cli_json("build", *args)
    assert doc["ok"], doc
    return {a["id"]: a["outcome"] for a in doc["actions"]}


def _recipe(ws: Workspace, more: str) -> None:
    path = ws.root / "epbuild.toml"
    path.write_text(path.read_text() + more)


def test_exclude_and_overrides_may_name_the_last_parts_lm_head(built: Workspace) -> None:
    """The lm_head is in the last part only: the other parts' graphs are quantized as
    before (their QDQ graphs unchanged, nothing of them compiled again)."""
    _recipe(built, 'exclude = ["/lm_head/MatMul"]\n')
    outcomes = _outcomes(built)
    assert outcomes["chat/htp-v73/part3_context"] == "compiled", outcomes
    for k in (1, 2):
        assert outcomes[f"chat/htp-v73/part{k}_context"] == "up_to_date", outcomes
    path = built.root / "epbuild.toml"
    path.write_text(MANIFEST + 'overrides = { "lm_head.MatMul.weight" = "uint16" }\n')
    outcomes = _outcomes(built)
    assert outcomes["chat/htp-v73/part3_iterator"] == "compiled", outcomes
    assert outcomes["chat/htp-v73/part1_iterator"] == "up_to_date", outcomes


def test_a_name_no_part_has_is_refused(built: Workspace) -> None:
    _recipe(built, 'exclude = ["/lm_head/MatMull"]\n')
    proc = built.cli("build")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "exclude names node '/lm_head/MatMull'" in proc.stderr, proc.stderr
    assert "'/lm_head/MatMul'" in proc.stderr, proc.stderr  # the near name, in the hint
