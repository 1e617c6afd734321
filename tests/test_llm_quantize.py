"""``quantize = "NAME"`` on ``[llms.X]``: the text-trained tiny Llama built as w8a16 (uint8
weights, uint16 activations) through the real QNN EP, calibrated on text prompts run
through its float static graphs on the CPU; each graph one EPContext node with float I/O,
genai + QNN (emulated HTP) generating the float source's greedy tokens; calibration and
quantization actions of the graph with early cutoff; bad prompts and recipes named, exit 2."""

from __future__ import annotations

import shutil
from typing import Any

import onnx
import pytest
from conftest import Workspace
from llmfixture import TEXT_PROMPTS, assert_generates_the_source, chat_manifest, place_source

from epbuild.errors import ManifestError
from epbuild.llm.generate import genai_installed
from epbuild.manifest.load import load_manifest

pytestmark = pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")

W8A16 = {"activations": "uint16", "weights": "uint8"}
TOKENS = 10


def _recipe(table: dict[str, Any]) -> str:
    lines = ["[quantization.w8a16]"]
    for key, value in table.items():
        shown = f'"{value}"' if isinstance(value, str) else str(value).lower()
        if isinstance(value, list):
            shown = "[" + ", ".join(f'"{v}"' for v in value) + "]"
        lines.append(f"{key} = {shown}")
    return "\n".join(lines) + "\n"


def quantized(ws: Workspace, quantize: str = "w8a16", **recipe: Any) -> Workspace:
    """The text-trained Llama in ``llms.chat`` (unshared: loadable here) with ``quantize``,
    its prompts in ``prompts.txt`` and a ``[quantization.w8a16]`` table."""
    place_source(ws.root, "llama-text")
    if not (ws.root / "prompts.txt").exists():
        shutil.copy(TEXT_PROMPTS, ws.root / "prompts.txt")
    table = {"calibration": "prompts.txt", **W8A16, **recipe}
    text = chat_manifest(share=False) + f'quantize = "{quantize}"\n\n' + _recipe(table)
    ws.manifest(text)
    return ws


def counts(ws: Workspace) -> dict[str, int]:
    doc = ws.main_json("build")
    assert doc["ok"], doc
    found: dict[str, int] = {}
    for action in doc["actions"]:
        outcome = action["outcome"]
        if outcome == "compiled":  # what ran, named by its kind
            outcome = PAST.get(action["kind"], outcome)
        found[outcome] = found.get(outcome, 0) + 1
    return found


PAST = {
    "prepare": "prepared",
    "llm-calibrate": "calibrated",
    "llm-quantize": "quantized",
    "package": "packaged",
}


@pytest.mark.slow
def test_w8a16_generates_the_float_sources_tokens(workspace: Workspace) -> None:
    ws = quantized(workspace)
    first = {"prepared": 1, "calibrated": 1, "quantized": 2, "compiled": 2, "packaged": 1}
    assert counts(ws) == first
    kinds = {a["id"]: (a["kind"], a["deps"]) for a in ws.cli_json("status")["actions"]}
    assert kinds["chat/calibrate"] == ("llm-calibrate", ["chat/prepare"])
    assert kinds["chat/context/quantize"] == ("llm-quantize", ["chat/calibrate", "chat/prepare"])
    assert kinds["chat/htp-v73/iterator"] == ("compile", ["chat/iterator/quantize"])
    package = ws.root / "build" / "chat" / "htp-v73"
    for graph in ("context", "iterator"):
        qdq = onnx.load(ws.root / f".epbuild/llm/chat/quantized/{graph}.onnx")
        assert {n.op_type for n in qdq.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
        ctx = onnx.load(package / f"{graph}_ctx.onnx", load_external_data=False)
        assert [n.op_type for n in ctx.graph.node] == ["EPContext"]
        prepared = onnx.load(ws.root / f".epbuild/llm/chat/prepared/{graph}.onnx")
        names = {(i.name, i.type.tensor_type.elem_type) for i in prepared.graph.input}
        assert {(i.name, i.type.tensor_type.elem_type) for i in ctx.graph.input} == names
        outputs = {(o.name, o.type.tensor_type.elem_type) for o in prepared.graph.output}
        assert {(o.name, o.type.tensor_type.elem_type) for o in ctx.graph.output} == outputs
    source = ws.root / "models" / "tiny"
    assert_generates_the_source(source, package, TOKENS, at_least=9)
    assert counts(ws) == {"up_to_date": 7}


@pytest.mark.slow
def test_prompts_that_give_the_same_ranges_quantize_nothing(workspace: Workspace) -> None:
    ws = quantized(workspace)
    counts(ws)
    prompts = ws.root / "prompts.txt"
    lines = prompts.read_text().splitlines()
    prompts.write_text("\n\n".join(reversed(lines)) + "\n")  # the same prompts: same ranges
    assert counts(ws) == {"calibrated": 1, "up_to_date": 6}
    quantized(ws, per_channel=True)  # weights per channel, the same ranges: no calibration
    assert counts(ws) == {"quantized": 2, "compiled": 2, "up_to_date": 3}
    prompts.write_text("\n".join(lines[:3]) + "\n")  # fewer prompts: other ranges
    assert counts(ws)["calibrated"] == 1


@pytest.mark.parametrize(
    ("prompts", "calibration", "key", "said"),
    [
        (None, "missing.txt", "quantization.w8a16.calibration", "missing.txt does not exist"),
        (b"", "prompts.txt", "quantization.w8a16.calibration", "holds no prompt"),
        (b"\n \n", "prompts.txt", "quantization.w8a16.calibration", "holds no prompt"),
        (b"ok\n\xc3(\n", "prompts.txt", "quantization.w8a16.calibration", "is not UTF-8"),
        (b"ok\n", "none/*.txt", "quantization.w8a16.calibration", "names no .txt files"),
    ],
)
def test_prompts_that_cannot_calibrate_are_named(
    workspace: Workspace, prompts: bytes | None, calibration: str, key: str, said: str
) -> None:
    if prompts is not None:
        workspace.root.mkdir(parents=True, exist_ok=True)
        (workspace.root / "prompts.txt").write_bytes(prompts)
    ws = quantized(workspace, calibration=calibration)
    with pytest.raises(ManifestError) as info:
        load_manifest(ws.root / "epbuild.toml")
    assert info.value.key == key and said in info.value.message, info.value


def test_a_bad_prompts_file_exits_2_with_one_message(workspace: Workspace) -> None:
    ws = quantized(workspace)
    (ws.root / "prompts.txt").write_bytes(b"\xff\xfe")
    proc = ws.cli("build")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (message,) = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert "quantization.w8a16.calibration: prompts.txt is not UTF-8 text" in message
    assert not (ws.root / ".epbuild" / "llm").exists()


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("\x00\x00", "gives no tokens"),  # the tokenizer reads nothing in it
        (" ".join(["word"] * 80), "leaves no room in the KV cache of 64"),
    ],
)
def test_a_prompt_the_graphs_cannot_run_exits_2_naming_it(
    workspace: Workspace, line: str, said: str
) -> None:
    ws = quantized(workspace)
    (ws.root / "prompts.txt").write_text(f"The quick brown fox\n{line}\n")
    proc = ws.cli("build", "chat/calibrate")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "prompt 2 of prompts.txt" in proc.stderr and said in proc.stderr, proc.stderr


def test_a_text_recipe_no_llm_quantizes_with_is_named(workspace: Workspace) -> None:
    """``quantize`` taken off the [llms] entry: its recipe's prompts are no samples."""
    ws = quantized(workspace)
    text = (ws.root / "epbuild.toml").read_text().replace('quantize = "w8a16"\n', "")
    (ws.root / "epbuild.toml").write_text(text)
    proc = ws.cli("build")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (message,) = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert "quantization.w8a16.calibration: 'prompts.txt' names no samples: text prompts" in message
    assert 'no [llms] entry has quantize = "w8a16"' in message, message
    assert ".npz" not in message, message


def test_quantize_naming_no_table_is_named(workspace: Workspace) -> None:
    ws = quantized(workspace, quantize="w4a16")
    proc = ws.cli("build")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "llms.chat.quantize: no [quantization.w4a16] table" in proc.stderr
    assert "defined: w8a16" in proc.stderr


@pytest.mark.parametrize(
    ("recipe", "key", "said"),
    [
        ({"weights": "int4"}, "quantization.w8a16.weights", "need per_channel = true"),
        ({"activations": "int16"}, "quantization.w8a16.activations", "int16 is not a type"),
    ],
)
def test_a_recipe_the_provider_cannot_run(
    workspace: Workspace, recipe: dict[str, Any], key: str, said: str
) -> None:
    ws = quantized(workspace, **recipe)
    with pytest.raises(ManifestError) as info:
        load_manifest(ws.root / "epbuild.toml")
    assert info.value.key == key and said in info.value.message, info.value
    assert "llms.chat compiles for it" in info.value.message


def test_a_group_cannot_share_an_llms_text_recipe(workspace: Workspace) -> None:
    ws = quantized(workspace)
    workspace.model("models/a.onnx")
    text = (ws.root / "epbuild.toml").read_text()
    text += '\n[groups.g]\nmodels = ["models/a.onnx"]\nproviders = ["htp-v73"]\n'
    (ws.root / "epbuild.toml").write_text(text + 'quantize = "w8a16"\n')
    with pytest.raises(ManifestError) as info:
        load_manifest(ws.root / "epbuild.toml")
    assert info.value.key == "groups.g.quantize" and "text prompts" in info.value.message


def test_a_pipeline_source_is_not_quantized(workspace: Workspace) -> None:
    ws = quantized(workspace)
    shutil.rmtree(ws.root / "models" / "tiny")
    place_source(ws.root, "llama-pipeline")
    text = (ws.root / "epbuild.toml").read_text()
    text = text.replace("context_length = 64\nwindow_size = 16\n", "")
    (ws.root / "epbuild.toml").write_text(text)
    with pytest.raises(ManifestError) as info:
        load_manifest(ws.root / "epbuild.toml")
    assert info.value.key == "llms.chat.quantize" and "decoder-pipeline" in info.value.message


def test_an_unquantized_llm_keeps_its_actions(workspace: Workspace) -> None:
    """Without ``quantize`` the graph is what it was: prepare, compiles, package."""
    workspace.llm("llama-text", share=False)
    ids = {a["id"]: a["kind"] for a in workspace.main_json("status")["actions"]}
    assert ids == {
        "chat/prepare": "prepare",
        "chat/htp-v73/context": "compile",
        "chat/htp-v73/iterator": "compile",
        "chat/htp-v73/package": "package",
    }
