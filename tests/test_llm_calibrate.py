"""The LLM quantization's own machinery, on the text-trained tiny Llama's static graphs:
prompts files read and refused (epbuild/llm/prompts.py), the calibration feeds that
reproduce genai's tokens, the ranges of every tensor the QNN config quantizes (the KV
cache included), and the QDQ graph whose renamed GroupQueryAttention tensors keep their
shapes (epbuild/llm/calibrate.py, epbuild/llm/quantize.py)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from llmfixture import LLM_FIXTURES, TEXT_PROMPTS

from epbuild.llm.calibrate import StaticIo, static_io
from epbuild.llm.generate import genai_installed, generate
from epbuild.llm.prompts import MAX_PROMPT_BYTES, PromptError, read_prompts
from epbuild.llm.static import GQA, StaticShape, make_static

SOURCE = LLM_FIXTURES / "llama-text"
WINDOW, CONTEXT = 16, 64
needs_genai = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")


def test_prompts_one_a_line_blank_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffHello there\n\n  \r\nSecond prompt  \n".encode())
    assert read_prompts(str(path), "p.txt") == ["Hello there", "Second prompt"]


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "p.txt does not exist"),
        (b"", "p.txt holds no prompt (one a line)"),
        (b"\n  \n\t\n", "p.txt holds no prompt (one a line)"),
        (b"fine\n\xff\xfe broken\n", "p.txt is not UTF-8 text (byte 5: b'\\xff')"),
        (b"x" * (MAX_PROMPT_BYTES + 1), "p.txt is larger than 1 MiB"),
    ],
)
def test_prompts_files_that_cannot_calibrate(
    tmp_path: Path, content: bytes | None, said: str
) -> None:
    path = tmp_path / "p.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(PromptError) as info:
        read_prompts(str(path), "p.txt")
    assert info.value.message == said


def _static(folder: Path) -> dict[str, str]:
    """The fixture's two static graphs, prepared as ``[llms]`` prepares them."""
    model = onnx.load(SOURCE / "model.onnx")
    graphs = {}
    for graph, sequence in (("context", WINDOW), ("iterator", 1)):
        path = folder / f"{graph}.onnx"
        onnx.save(make_static(model, StaticShape(sequence, CONTEXT, 16)), path)
        graphs[graph] = str(path)
    return graphs


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _static(tmp_path_factory.mktemp("static"))


def _io() -> StaticIo:
    config = json.loads((SOURCE / "genai_config.json").read_text())
    return static_io(config, WINDOW, CONTEXT)


@needs_genai
def test_feeds_reproduce_genai_tokens(static: dict[str, str]) -> None:
    """The float static graphs, fed as genai's pipeline feeds them (windows padded with
    the pad token, one fixed KV cache), generate genai's CPU tokens of the source."""
    from epbuild.llm.calibrate import cpu_session, greedy, tokenize

    io = _io()
    sessions = [cpu_session(static["context"]), cpu_session(static["iterator"])]
    prompts = [*TEXT_PROMPTS.read_text().splitlines()[:2], "A " * 12 + "prompt of two windows"]
    for prompt, tokens in zip(prompts, tokenize(str(SOURCE), prompts), strict=True):
        mine = greedy(sessions[0], sessions[1], tokens, io, 8)
        theirs = generate(SOURCE, qnn=False, tokens=8, prompt=prompt, max_length=CONTEXT)
        assert mine == list(theirs.tokens), prompt


@needs_genai
def test_ranges_cover_the_kv_cache_and_quantized_attention_keeps_shapes(
    static: dict[str, str], tmp_path: Path
) -> None:
    from onnxruntime.quantization import CalibrationMethod

    from epbuild.llm.calibrate import calibrate, tokenize
    from epbuild.llm.quantize import RENAMED, quantize_graph

    prompts = tokenize(str(SOURCE), TEXT_PROMPTS.read_text().splitlines()[:3])
    ranges = {g: str(tmp_path / f"{g}.ranges.json") for g in static}
    counts = calibrate(static, prompts, _io(), CalibrationMethod.MinMax, ranges)
    assert counts["context"] == counts["iterator"] > 0
    names = json.loads(Path(ranges["iterator"]).read_text())["data"]
    assert list(names) == sorted(names)  # canonical: the same ranges, the same bytes
    for tensor in ("past_key_values.1.value", "present.0.key", "logits"):
        assert tensor in names, tensor
    settings = {
        "activations": "uint16",
        "weights": "uint8",
        "per_channel": False,
        "method": "minmax",
        "exclude": [],
        "overrides": {},
    }
    out = tmp_path / "iterator.qdq.onnx"
    assert quantize_graph(static["iterator"], ranges["iterator"], str(out), settings, "it") > 0
    qdq = onnx.load(out)
    typed = {v.name for v in (*qdq.graph.value_info, *qdq.graph.input, *qdq.graph.output)}
    attention = [n for n in qdq.graph.node if n.op_type == GQA]
    renamed = [t for n in attention for t in (*n.input, *n.output) if t.endswith(RENAMED)]
    assert renamed and all(t in typed for t in renamed)
    assert [i.name for i in qdq.graph.input] == [
        i.name for i in onnx.load(static["iterator"]).graph.input
    ]
    per_channel = {**settings, "weights": "int8", "per_channel": True}
    quantize_graph(static["iterator"], ranges["iterator"], str(out), per_channel, "it")
    qdq = onnx.load(out)
    scales = {t.name: list(t.dims) for t in qdq.graph.initializer}
    matmuls = {n.input[1] for n in qdq.graph.node if n.op_type == "MatMul"}
    weights = [
        n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in matmuls
    ]
    assert weights and all(
        [a.i for a in n.attribute if a.name == "axis"] == [1] and len(scales[n.input[1]]) == 1
        for n in weights
    )
    fresh = tmp_path / "again" / out.name  # the same name: the same references
    fresh.parent.mkdir()
    quantize_graph(static["iterator"], ranges["iterator"], str(fresh), per_channel, "it")
    for name in (out.name, out.name + ".data"):  # over an earlier output as into a new folder
        assert (fresh.parent / name).read_bytes() == (out.parent / name).read_bytes(), name
