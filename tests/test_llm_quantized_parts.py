"""``quantize`` with ``parts``: the text-trained tiny Llama, deepened to 3 layers, built as
w8a16 in 3 parts through the real QNN EP. One calibration runs the float parts in a chain
on the CPU (the embeddings stage first) and writes each part graph's ranges; each part
graph is quantized and compiled to one EPContext node with float I/O; genai + QNN (emulated
HTP) generates the float source's greedy tokens; an edit of one weight in the last layer
re-quantizes and recompiles the last part's graphs only. With ``share_weights`` (the
default) each part's two quantized graphs are linked into one weight-shared binary."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest
from conftest import Workspace
from llmfixture import (
    LLM_FIXTURES,
    TEXT_PROMPTS,
    assert_generates_the_source,
    chat_manifest,
    deepen,
    save_decoder,
)
from onnx import numpy_helper

from epbuild.llm.generate import genai_installed
from epbuild.manifest.load import load_manifest

pytestmark = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")

TOKENS = 10
STAGES = [f"part{k}_{g}" for k in (1, 2, 3) for g in ("context", "iterator")]
RECIPE = (
    '[quantization.w8a16]\ncalibration = "prompts.txt"\nactivations = "uint16"\nweights = "uint8"\n'
)


@pytest.fixture(scope="module")
def deep_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The text-trained tiny Llama with 3 layers (the new one small: its tokens stay the
    trained model's, with clear margins)."""
    folder = tmp_path_factory.mktemp("deep") / "llama-text"
    shutil.copytree(LLM_FIXTURES / "llama-text", folder)
    return deepen(folder, 3, spread=0.02)


def _workspace(ws: Workspace, deep: Path, *, share: bool = False) -> Workspace:
    target = ws.root / "models" / "tiny"
    if not target.exists():
        shutil.copytree(deep, target)
    shutil.copy(TEXT_PROMPTS, ws.root / "prompts.txt")
    ws.manifest(chat_manifest(share=share) + 'parts = 3\nquantize = "w8a16"\n\n' + RECIPE)
    return ws


def _outcomes(ws: Workspace) -> dict[str, str]:
    doc = ws.cli_json("build")
    assert doc["ok"], doc
    return {a["id"]: a["outcome"] for a in doc["actions"]}


def test_a_decoder_in_parts_gets_a_quantization_per_part_graph(
    workspace: Workspace, deep_text: Path
) -> None:
    ws = _workspace(workspace, deep_text)
    assert load_manifest(ws.root / "epbuild.toml").llms["chat"].parts == 3
    actions = {a["id"]: (a["kind"], a["deps"]) for a in ws.main_json("status")["actions"]}
    assert actions["chat/calibrate"] == ("llm-calibrate", ["chat/prepare"])
    for stage in STAGES:
        assert actions[f"chat/{stage}/quantize"] == (
            "llm-quantize",
            ["chat/calibrate", "chat/prepare"],
        )
    for k in (1, 2, 3):  # unshared: one compile per part graph, each after its quantization
        for graph in ("context", "iterator"):
            assert actions[f"chat/htp-v73/part{k}_{graph}"] == (
                "compile",
                [f"chat/part{k}_{graph}/quantize"],
            )


def test_shared_parts_compile_each_parts_two_quantized_graphs_together(
    workspace: Workspace, deep_text: Path
) -> None:
    ws = _workspace(workspace, deep_text, share=True)
    actions = {a["id"]: (a["kind"], a["deps"]) for a in ws.main_json("status")["actions"]}
    compiles = {i: deps for i, (kind, deps) in actions.items() if kind == "compile"}
    assert compiles == {  # one compile per part, after both its graphs' quantizations
        f"chat/htp-v73/part{k}": [f"chat/part{k}_{g}/quantize" for g in ("context", "iterator")]
        for k in (1, 2, 3)
    }


def _io(values: Any) -> set[tuple[str, int]]:
    return {(v.name, v.type.tensor_type.elem_type) for v in values}


def _edit_last_layer(folder: Path) -> None:
    model = onnx.load(folder / "model.onnx")
    for tensor in model.graph.initializer:
        if tensor.name == "model.layers.2.mlp.down_proj.MatMul.weight":
            values = numpy_helper.to_array(tensor).copy()
            values[0, 0] += 0.05
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
            break
    else:
        raise AssertionError("no down_proj weight in layer 2")
    save_decoder(model, folder)


def _flip_lm_head(folder: Path) -> None:
    """Negate the lm_head: the chain chooses other tokens from the first prompt on."""
    model = onnx.load(folder / "model.onnx")
    (tensor,) = [t for t in model.graph.initializer if t.name == "lm_head.MatMul.weight"]
    tensor.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(tensor), tensor.name))
    save_decoder(model, folder)


@pytest.mark.slow
def test_w8a16_in_3_parts_generates_the_float_sources_tokens(
    workspace: Workspace, deep_text: Path
) -> None:
    ws = _workspace(workspace, deep_text)
    first = _outcomes(ws)
    assert set(first.values()) == {"compiled"}, first
    assert len(first) == 1 + 1 + 6 + 6 + 1  # prepare, calibrate, quantizations, compiles, package
    state = ws.root / ".epbuild" / "llm" / "chat"
    package = ws.root / "build" / "chat" / "htp-v73"
    for stage in STAGES:
        assert (state / "calibrated" / f"{stage}.ranges.json").is_file()
        qdq = onnx.load(state / "quantized" / f"{stage}.onnx", load_external_data=False)
        assert {n.op_type for n in qdq.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
        ctx = onnx.load(package / f"{stage}_ctx.onnx", load_external_data=False)
        assert [n.op_type for n in ctx.graph.node] == ["EPContext"], stage
        prepared = onnx.load(state / "prepared" / f"{stage}.onnx", load_external_data=False)
        assert _io(ctx.graph.input) == _io(prepared.graph.input), stage
        assert _io(ctx.graph.output) == _io(prepared.graph.output), stage
    assert (package / "embeddings.onnx").is_file()
    source = ws.root / "models" / "tiny"
    assert_generates_the_source(source, package, TOKENS, at_least=9)

    # One weight of the last layer: the earlier parts' graphs and ranges come out the same.
    before = {p.name: p.read_bytes() for p in (state / "calibrated").iterdir()}
    _edit_last_layer(source)
    again = _outcomes(ws)
    ran = {"chat/prepare", "chat/calibrate"}  # the package is up to date, as without quantize
    ran |= {f"chat/part3_{g}/quantize" for g in ("context", "iterator")}
    ran |= {f"chat/htp-v73/part3_{g}" for g in ("context", "iterator")}
    assert again == {i: "compiled" if i in ran else "up_to_date" for i in first}, again
    for k in (1, 2):  # their ranges were rewritten the same: cut off early
        for graph in ("context", "iterator"):
            name = f"part{k}_{graph}.ranges.json"
            assert (state / "calibrated" / name).read_bytes() == before[name]
    assert (state / "calibrated" / "part3_context.ranges.json").read_bytes() != before[
        "part3_context.ranges.json"
    ]


def _binaries(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.glob("*.bin"))}


@pytest.mark.slow  # its rule (a compile per part): test_shared_parts_compile_each_parts_two_...
def test_w8a16_in_3_shared_parts_links_each_parts_graphs_into_one_binary(
    workspace: Workspace, deep_text: Path
) -> None:
    ws = _workspace(workspace, deep_text, share=True)
    first = _outcomes(ws)
    assert set(first.values()) == {"compiled"}, first
    package = ws.root / "build" / "chat" / "htp-v73"
    shared = _binaries(package)
    assert list(shared) == [f"part{k}_context_ctx_qnn.bin" for k in (1, 2, 3)]
    for stage in STAGES:
        ctx = onnx.load(package / f"{stage}_ctx.onnx", load_external_data=False)
        (node,) = ctx.graph.node
        assert node.op_type == "EPContext", stage
        cache = next(a.s.decode() for a in node.attribute if a.name == "ep_cache_context")
        assert cache == f"{stage.split('_')[0]}_context_ctx_qnn.bin", stage  # the part's binary
    if platform.machine().lower() in ("x86_64", "amd64"):  # (it crashes the emulated HTP)
        proc = ws.cli("verify", "--generate")
        assert proc.returncode == 0 and "generate: not checkable" in proc.stdout, proc.stdout
        assert "share_weights = false" in proc.stdout

    # Unshared: the same quantized graphs (nothing calibrates again), a binary per graph.
    _workspace(workspace, deep_text, share=False)
    again = _outcomes(ws)
    compiled = {i for i, o in again.items() if o == "compiled"}
    assert compiled == {f"chat/htp-v73/{stage}" for stage in STAGES}, again
    unshared = _binaries(package)
    assert len(unshared) == 6
    assert sum(shared.values()) < sum(unshared.values()), (shared, unshared)


def _calibration_detail(ws: Workspace) -> dict[str, Any]:
    """The detail the last run of ``chat/calibrate`` recorded (the state journal's)."""
    import json

    lines = (ws.root / ".epbuild" / "state.jsonl").read_text().splitlines()
    done = [json.loads(line) for line in lines if '"chat/calibrate"' in line]
    return [d for d in done if d.get("op") == "done"][-1]["detail"]


@pytest.mark.slow
def test_an_edit_of_the_last_layer_calibrates_the_last_part_alone(
    workspace: Workspace, deep_text: Path
) -> None:
    ws = _workspace(workspace, deep_text)
    _outcomes(ws)
    assert _calibration_detail(ws)["kept"] == []
    state = ws.root / ".epbuild" / "llm" / "chat" / "calibrated"
    assert (state / "memo.json").is_file()
    _edit_last_layer(ws.root / "models" / "tiny")
    again = _outcomes(ws)
    assert again["chat/calibrate"] == "compiled"
    assert _calibration_detail(ws)["kept"] == ["part1", "part2"]
    assert again["chat/htp-v73/part1_context"] == "up_to_date"

    # An edit that changes the tokens the chain chooses: the memo's replay diverges, what it
    # wrote goes (not the job's own files beside it) and every part is calibrated again.
    _flip_lm_head(ws.root / "models" / "tiny")
    flipped = _outcomes(ws)
    assert flipped["chat/calibrate"] == "compiled"
    assert _calibration_detail(ws)["kept"] == []
    assert sorted(json.loads((state / "memo.json").read_text())["files"]) == sorted(
        [*(f"{s}.ranges.json" for s in STAGES), *(f"part{k}.runs" for k in (1, 2, 3))]
    )


@pytest.mark.slow
def test_numerics_of_each_part_graph(workspace: Workspace, deep_text: Path) -> None:
    ws = _workspace(workspace, deep_text)
    _outcomes(ws)
    doc = ws.cli_json("verify", "--numerics")
    assert doc["ok"], doc
    checks = {c["model"]: c for c in doc["numerics"]}
    assert set(checks) == {f"build/chat/htp-v73/{stage}_ctx.onnx" for stage in STAGES}
    for stage in STAGES:
        outputs = {o["name"]: o for o in checks[f"build/chat/htp-v73/{stage}_ctx.onnx"]["outputs"]}
        assert all(o["sqnr_db"] is not None for o in outputs.values()), stage
        if stage.startswith("part3"):  # the last part's logits
            assert outputs["logits"]["sqnr_db"] >= 20, outputs
            assert outputs["logits"]["qdq_sqnr_db"] >= 20, outputs


@pytest.mark.slow
def test_generate_tells_the_parts_package_apart_by_its_qdq_graphs(
    workspace: Workspace, deep_text: Path
) -> None:
    ws = _workspace(workspace, deep_text)
    _outcomes(ws)
    doc = ws.cli_json("verify", "--generate", "--timeout", "300")
    assert doc["ok"], doc
    (check,) = doc["generate"]
    assert check["qdq_reason"] is None, check  # the chain of its QDQ part graphs ran
    for prompt in check["prompts"]:
        assert prompt["qdq_agreement"]["agreed"] >= 9, prompt
        assert prompt["agreement_with_qdq"]["compared"] == prompt["agreement"]["compared"]


def test_a_new_pad_token_and_an_edit_of_the_last_layer_calibrate_every_part(
    workspace: Workspace, deep_text: Path, tmp_path: Path
) -> None:
    """The pad token fills each prompt's last window, which every part reads: the memo of
    another pad token keeps nothing (its ranges are not a calibration's of every part)."""
    ws = _workspace(workspace, deep_text)
    ws.main("build", "chat/calibrate", check=True)
    config = ws.root / "models" / "tiny" / "genai_config.json"
    doc = json.loads(config.read_text())
    doc["model"]["pad_token_id"] = 7
    config.write_text(json.dumps(doc, indent=4))
    _edit_last_layer(ws.root / "models" / "tiny")
    ws.main("build", "chat/calibrate", check=True)
    assert _calibration_detail(ws)["kept"] == []
    fresh = Workspace(tmp_path / "fresh")
    shutil.copytree(ws.root / "models", fresh.root / "models")
    _workspace(fresh, deep_text)
    fresh.main("build", "chat/calibrate", check=True)
    for stage in STAGES:
        name = f"{stage}.ranges.json"
        mine = ws.root / ".epbuild" / "llm" / "chat" / "calibrated" / name
        assert mine.read_bytes() == (fresh.root / mine.relative_to(ws.root)).read_bytes(), name
