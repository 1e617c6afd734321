"""The CPU reference ``verify --generate`` tells a quantized package apart by
(epbuild/llm/qdqgen.py): the static graphs run teacher-forced on the source's tokens. A
decoder in parts runs as genai runs it, the CPU embeddings stage then each part's graphs:
its float parts choose the source's own tokens (the text-trained tiny Llama, deepened to 3
layers, in 3 parts)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from llmfixture import LLM_FIXTURES, TEXT_PROMPTS, deepen

from epbuild.llm.generate import genai_installed, generate
from epbuild.llm.partgraphs import PartShape, write_parts
from epbuild.llm.qdqgen import qdq_tokens

pytestmark = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")

WINDOW, CONTEXT, HEAD = 16, 64, 16


def test_a_decoder_in_parts_runs_its_chain(tmp_path: Path) -> None:
    source = tmp_path / "llama-text"
    shutil.copytree(LLM_FIXTURES / "llama-text", source)
    deepen(source, 3, spread=0.02)
    parts = tmp_path / "prepared"
    parts.mkdir()
    write_parts(str(source / "model.onnx"), str(parts), PartShape(WINDOW, CONTEXT, HEAD, 3))
    graphs = {
        f"part{k}_{g}": str(parts / f"part{k}_{g}.onnx")
        for k in (1, 2, 3)
        for g in ("context", "iterator")
    }
    prompts = TEXT_PROMPTS.read_text().splitlines()[:2]
    want = [
        generate(source, qnn=False, tokens=8, prompt=p, max_length=CONTEXT).tokens for p in prompts
    ]
    found = qdq_tokens(
        str(source),
        graphs,
        window=WINDOW,
        context_length=CONTEXT,
        prompts=prompts,
        forced=want,
        timeout=300,
        embeddings=str(parts / "embeddings.onnx"),
    )
    assert found == [tuple(w) for w in want]
