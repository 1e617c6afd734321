"""The tiny genai model folders under ``tests/fixtures/llm`` and the manifest that builds one
(tests and ``benchmarks/bench_genai.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

LLM_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"
"""One folder per family: ``llama``, ``qwen2``, ``llama-pipeline``, ``llama-text``
(``make_*_fixture.py`` made them)."""
TEXT_PROMPTS = LLM_FIXTURES / "text-prompts.txt"
"""Ten prompts, one a line, that ``llama-text`` continues with clear margins."""


def chat_manifest(*, share: bool = False, context: int | None = 64, window: int | None = 16) -> str:
    """``epbuild.toml`` with one LLM, ``chat`` (source ``models/tiny``), for HTP v73;
    ``context``/``window`` None leave ``context_length``/``window_size`` out."""
    lines = [
        "[providers.htp-v73]",
        'ep = "qnn"',
        'options = { htp_arch = "73", soc_model = "60" }',
        "",
        "[llms.chat]",
        'source = "models/tiny"',
        'providers = ["htp-v73"]',
    ]
    if context is not None:
        lines.append(f"context_length = {context}")
    if window is not None:
        lines.append(f"window_size = {window}")
    lines.append(f"share_weights = {str(share).lower()}")
    return "\n".join(lines) + "\n"


def place_source(root: Path, family: str = "llama") -> Path:
    """Copy the fixture ``family`` to ``root/models/tiny`` (left as it is when already there:
    a test may have edited it); returns that folder."""
    folder = root / "models" / "tiny"
    if not folder.exists():
        shutil.copytree(LLM_FIXTURES / family, folder)
    return folder


def deepen(folder: Path, layers: int, *, seed: int = 7, spread: float = 0.2) -> Path:
    """Give the builder-made decoder in ``folder`` ``layers`` layers (in place): layer 1's
    nodes are repeated, renumbered, with fresh seeded random weights (of ``spread``: by
    default the one the random fixtures were made with; a small one keeps a trained
    model's tokens), and ``genai_config.json`` says so. Returns ``folder``."""
    import json
    import re

    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(folder / "model.onnx")
    graph = model.graph
    have = sum(1 for i in graph.input if i.name.endswith(".key"))
    layer = re.compile(r"(layers|past_key_values|present)\.(\d+)")
    rng = np.random.default_rng(seed)

    def shift(text: str, by: int) -> str:
        return layer.sub(lambda m: f"{m.group(1)}.{int(m.group(2)) + by}", text)

    def renamed(node: onnx.NodeProto, by: int) -> onnx.NodeProto:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = shift(node.name, by)
        copy.input[:] = [shift(x, by) if layer.search(x) else x for x in node.input]
        copy.output[:] = [shift(x, by) for x in node.output]
        return copy

    template = [n for n in graph.node if f"/layers.{have - 1}/" in n.name]
    tail = [n for n in graph.node if f"/layers.{have}/" in n.name or n.name.startswith("/lm_head")]
    head = [n for n in graph.node if n not in template and n not in tail]
    nodes = head + template
    for tensor in graph.initializer:  # the final norm's weight is named after no layer
        if f"layers.{have}." in tensor.name:
            tensor.name = shift(tensor.name, layers - have)
    weights = {t.name: t for t in graph.initializer}
    for k in range(have, layers):
        by = k - have + 1
        nodes += [renamed(n, by) for n in template]
        for name, tensor in list(weights.items()):
            if f"layers.{have - 1}." not in name:
                continue
            values = numpy_helper.to_array(tensor)
            if values.ndim == 2:
                values = rng.normal(0.0, spread, values.shape).astype(values.dtype)
            graph.initializer.append(numpy_helper.from_array(values, shift(name, by)))
        for values in (graph.input, graph.output):
            for v in [v for v in values if f".{have - 1}." in v.name]:
                values.append(onnx.ValueInfoProto())
                values[-1].CopyFrom(v)
                values[-1].name = shift(v.name, by)
    nodes += [renamed(n, layers - have) for n in tail]
    del graph.node[:]
    graph.node.extend(nodes)
    save_decoder(model, folder)
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["num_hidden_layers"] = layers
    config_path.write_text(json.dumps(config, indent=4))
    return folder


def save_decoder(model: Any, folder: Path) -> None:
    """Write ``model`` as the folder's decoder, its weights in ``model.onnx.data`` (as genai's
    model builder writes them), in place of the one there."""
    import onnx

    (folder / "model.onnx.data").unlink()
    onnx.save(
        model,
        folder / "model.onnx",
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=0,
    )


def assert_generates_the_source(source: Path, package: Path, tokens: int, at_least: int) -> None:
    """genai + QNN (the emulated HTP) on ``package`` generates at least ``at_least`` of the
    float ``source``'s first ``tokens`` greedy tokens (genai on the CPU) for every prompt of
    ``TEXT_PROMPTS``."""
    from epbuild.llm.generate import generate

    for prompt in TEXT_PROMPTS.read_text().splitlines():
        want = generate(source, qnn=False, tokens=tokens, prompt=prompt, max_length=64)
        got = generate(package, qnn=True, tokens=tokens, prompt=prompt, max_length=64)
        same = sum(a == b for a, b in zip(want.tokens, got.tokens, strict=True))
        assert same >= at_least, (prompt, want.tokens, got.tokens)
