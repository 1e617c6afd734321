"""The committed builder-made LLM fixtures: what genai's model builder wrote (the structure
the static preparation rewrites), and that onnxruntime-genai generates from them on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"
FAMILIES = ("llama", "qwen2")


def test_versions_recorded() -> None:
    versions = json.loads((FIXTURES / "versions.json").read_text())
    for name in ("torch", "transformers", "onnxruntime-genai", "onnx"):
        assert versions[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_builder_structure(family: str) -> None:
    folder = FIXTURES / family
    names = {p.name for p in folder.iterdir()}
    assert {"genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) < 2_000_000  # stays tiny
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    inputs = {i.name for i in model.graph.input}
    assert {"input_ids", "attention_mask", "past_key_values.0.key"} <= inputs
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["model"]["type"] == family and config["model"]["context_length"] == 128


@pytest.mark.parametrize("family", FAMILIES)
def test_genai_generates_on_cpu(family: str) -> None:
    og = pytest.importorskip("onnxruntime_genai", reason="pip install -e '.[genai]'")
    model = og.Model(str(FIXTURES / family))
    tokenizer = og.Tokenizer(model)
    prompt = tokenizer.encode("The quick brown fox")
    assert len(prompt) > 1

    def greedy() -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 8, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        out: list[int] = []
        while not generator.is_done():
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        return out

    first = greedy()
    assert len(first) == 8 and max(first) < 384
    assert greedy() == first  # deterministic: the reference the QNN package is compared with
    assert len(set(first)) > 1  # random weights, but not a degenerate constant model
