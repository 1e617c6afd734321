"""Static preparation of builder-made decoders (epbuild/llm/static.py) and the
decoder-pipeline config (epbuild/llm/genai_config.py): the prepared graphs compute what the
source computes on the CPU, compile for QNN to one EPContext node each (GroupQueryAttention
on the HTP through op_affinity), and onnxruntime-genai generates the source's greedy tokens
from them through the emulated HTP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from epbuild.llm.genai_config import pipeline_config
from epbuild.llm.generate import DEFAULT_NEAR_TIE, Verdict, compare, generate
from epbuild.llm.static import StaticPrepError, StaticShape, make_static

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"
WINDOW, CONTEXT = 16, 64


def _source(family: str) -> tuple[onnx.ModelProto, dict[str, object]]:
    folder = FIXTURES / family
    config = json.loads((folder / "genai_config.json").read_text())
    return onnx.load(folder / "model.onnx"), config


def _static(family: str, sequence: int) -> onnx.ModelProto:
    model, config = _source(family)
    head = config["model"]["decoder"]["head_size"]  # type: ignore[index]
    return make_static(model, StaticShape(sequence, CONTEXT, head))


def _shape(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_structure(family: str) -> None:
    source, _ = _source(family)
    static = _static(family, WINDOW)
    inputs = {i.name: _shape(i) for i in static.graph.input}
    assert "attention_mask" not in inputs
    assert inputs["input_ids"] == [1, WINDOW]
    assert inputs["past_key_values.1.value"] == [1, 2, CONTEXT, 16]
    assert inputs["past_seq_len"] == [1, 1] and inputs["total_seq_len"] == [1]
    outputs = {o.name: _shape(o) for o in static.graph.output}
    assert outputs["logits"] == [1, WINDOW, 384]
    assert outputs["present.0.key"] == [1, 2, CONTEXT, 16]
    ops = [n.op_type for n in static.graph.node]
    assert "SkipSimplifiedLayerNormalization" not in ops
    assert "ReduceSum" not in ops and "Shape" not in ops  # the mask subgraph is gone
    skips = sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in source.graph.node)
    assert ops.count("SimplifiedLayerNormalization") == 1 + skips
    for node in static.graph.node:
        if node.op_type == "GroupQueryAttention":
            assert list(node.input[5:7]) == ["past_seq_len", "total_seq_len"]
    # The source is left as it was.
    assert "attention_mask" in {i.name for i in source.graph.input}


def test_refuses_other_decoders() -> None:
    source, _ = _source("llama")
    for node in source.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.op_type = "MultiHeadAttention"
    with pytest.raises(StaticPrepError, match="no GroupQueryAttention node"):
        make_static(source, StaticShape(WINDOW, CONTEXT, 16))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_context_graph_computes_what_the_source_does(family: str) -> None:
    """One prompt window on the CPU: the static graph (fixed, zeroed KV cache, seqlens_k
    from past_seq_len) gives the source's logits and KV values."""
    source, _ = _source(family)
    static = _static(family, WINDOW)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 384, size=(1, WINDOW), dtype=np.int64)
    dynamic = ort.InferenceSession(source.SerializeToString(), providers=["CPUExecutionProvider"])
    feed: dict[str, np.ndarray] = {
        "input_ids": ids,
        "attention_mask": np.ones((1, WINDOW), np.int64),
    }
    for i in source.graph.input:
        if i.name.startswith("past_key_values"):
            feed[i.name] = np.zeros((1, 2, 0, 16), np.float32)
    want = dynamic.run(None, feed)
    fixed = ort.InferenceSession(static.SerializeToString(), providers=["CPUExecutionProvider"])
    feed_static: dict[str, np.ndarray] = {
        "input_ids": ids,
        "past_seq_len": np.array([[WINDOW - 1]], np.int32),
        "total_seq_len": np.array([CONTEXT], np.int32),
    }
    for i in static.graph.input:
        if i.name.startswith("past_key_values"):
            feed_static[i.name] = np.zeros((1, 2, CONTEXT, 16), np.float32)
    got = fixed.run(None, feed_static)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)  # logits
    # present.0.key: the window's rows of the fixed cache
    np.testing.assert_allclose(got[1][:, :, :WINDOW], want[1], rtol=1e-4, atol=1e-4)


COMPILE = """
import json, sys
import onnxruntime as ort, onnxruntime_qnn as qnn
ort.register_execution_provider_library("QNNExecutionProvider", qnn.get_library_path())
devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
for stage in ("context", "iterator"):
    options = ort.SessionOptions()
    options.add_provider_for_devices(devices, json.loads(sys.argv[3]))
    options.add_session_config_entry("ep.context_enable", "1")
    options.add_session_config_entry("ep.context_embed_mode", "0")
    compiler = ort.ModelCompiler(options, f"{sys.argv[1]}/{stage}.onnx")
    compiler.compile_to_file(f"{sys.argv[2]}/{stage}_ctx.onnx")
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_qnn_pipeline_generates_the_source_tokens(family: str, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_genai", reason="pip install -e '.[genai]'")
    pytest.importorskip("onnxruntime_qnn")
    _, config = _source(family)
    affinity = tmp_path / "op_affinity.json"
    affinity.write_text(json.dumps({"op_type": {"GroupQueryAttention": "htp"}}))
    target = {"backend_type": "htp", "htp_arch": "73", "soc_model": "60"}
    package = tmp_path / "package"
    package.mkdir()
    for stage, sequence in (("context", WINDOW), ("iterator", 1)):
        onnx.save(
            _static(family, sequence),
            tmp_path / f"{stage}.onnx",
            save_as_external_data=True,
            location=f"{stage}.onnx.data",
        )
    # Compiled in a child process: a QNN session leaves the plugin registered in this one.
    options = {**target, "op_affinity": str(affinity)}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE, str(tmp_path), str(package), json.dumps(options)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in ("context", "iterator"):
        ctx = onnx.load(package / f"{stage}_ctx.onnx", load_external_data=False)
        assert [n.op_type for n in ctx.graph.node] == ["EPContext"]  # all on the HTP
    genai = pipeline_config(
        config,
        files={"context": "context_ctx.onnx", "iterator": "iterator_ctx.onnx"},
        provider_options={"qnn": target},
        context_length=CONTEXT,
        window_size=WINDOW,
    )
    assert genai["search"]["max_length"] == CONTEXT  # capped: genai refuses more
    (package / "genai_config.json").write_text(json.dumps(genai, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / family / name, package / name)
    htp = generate(package, qnn=True, tokens=10, max_length=48)
    cpu = generate(FIXTURES / family, qnn=False, tokens=10, max_length=48)
    assert len(htp.tokens) == len(cpu.tokens) == 10
    # HTP computes in fp16: a flip is allowed only where the CPU's top two are close.
    result = compare(htp, cpu, DEFAULT_NEAR_TIE)
    assert result.verdict in (Verdict.MATCH, Verdict.NEAR_TIE), result.describe()
