"""Models from real exporters (``tests/corpus``, made by ``tests/corpus/make_corpus.py``)
build for QNN at every ``graph_optimization_level`` and pass ``verify``; where the EP itself
refuses a model, ONNX Runtime's message reaches the user, naming the model.

The expectations are what onnxruntime 1.32.0 + onnxruntime-qnn 2.7.0 do with these files
(docs/research/exporter-corpus.md has the table): a change of either shows up here first.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest
from conftest import HTP73, Workspace

from epbuild.inspection.verify import verify_outputs

CORPUS = Path(__file__).parent / "corpus"
LEVELS = ("disabled", "basic", "extended", "all")
TEXT_DIMS = {"batch": 1, "sequence_length": 8}


@dataclass(frozen=True)
class Expect:
    """What one level gives: ``full`` (one EPContext node, nothing on the CPU EP),
    ``partial`` (CPU fallback or several EPContext nodes) or ``refused`` (the EP fails the
    compile; ``message`` is the part of its error the user must see)."""

    outcome: str
    message: str = ""


FULL, PARTIAL = Expect("full"), Expect("partial")
MEM_ALLOC = Expect("refused", "Failed to finalize QNN graph. Error: QNN_COMMON_ERROR_MEM_ALLOC")
CRASH = Expect("refused", "the worker was killed by SIGSEGV while compiling")

MODELS: dict[str, tuple[dict[str, int], tuple[Expect, ...]]] = {
    # model: (free_dimensions, expectation at disabled, basic, extended, all)
    "bert_torchscript.onnx": (TEXT_DIMS, (PARTIAL, FULL, FULL, FULL)),
    "bert_unnamed.onnx": (TEXT_DIMS, (PARTIAL, FULL, FULL, FULL)),
    "llama_torchscript.onnx": (TEXT_DIMS, (PARTIAL, FULL, FULL, FULL)),
    "gpt2_dynamo.onnx": (TEXT_DIMS, (CRASH, PARTIAL, PARTIAL, PARTIAL)),
    "llama_dynamo_external.onnx": (TEXT_DIMS, (MEM_ALLOC,) * 4),
    "mlp_unnamed.onnx": ({}, (FULL,) * 4),
    "cnn_torchscript.onnx": ({}, (FULL,) * 4),
    "cnn_qdq.onnx": ({}, (PARTIAL,) * 4),
}


def _workspace(root: Path, model: str) -> Workspace:
    """A workspace with ``model`` (and its external data) and one group per level."""
    ws = Workspace(root)
    (root / "models").mkdir(parents=True)
    for f in CORPUS.glob(model + "*"):
        shutil.copy(f, root / "models" / f.name)
    dims, _ = MODELS[model]
    groups = {}
    for level in LEVELS:
        group = {"models": [f"models/{model}"], "providers": ["htp"],
                 "graph_optimization_level": level}  # fmt: skip
        if dims:
            group["free_dimensions"] = dims
        groups[level] = group
    ws.manifest({"providers": {"htp": HTP73}, "groups": groups})
    return ws


def _coverage(path: Path) -> str:
    """``full`` or ``partial``, from the ctx model's nodes."""
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    contexts = sum(1 for n in nodes if n.op_type == "EPContext")
    return "full" if contexts == 1 and len(nodes) == 1 else "partial"


def test_the_corpus_is_whole_and_small() -> None:
    files = sorted(f.name for f in CORPUS.iterdir() if f.suffix in (".onnx", ".data"))
    assert set(MODELS) <= set(files)
    assert "llama_dynamo_external.onnx.data" in files  # the external-data one
    assert sum(f.stat().st_size for f in CORPUS.iterdir()) < 20_000_000
    versions = json.loads((CORPUS / "versions.json").read_text())["versions"]
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(versions)
    # Real exporters' output: symbolic dims, unnamed nodes, QDQ, dynamo's stack traces.
    bert = onnx.load(str(CORPUS / "bert_torchscript.onnx"))
    assert [d.dim_param for d in bert.graph.input[0].type.tensor_type.shape.dim] == [
        "batch",
        "sequence_length",
    ]
    assert not any(n.name for n in onnx.load(str(CORPUS / "bert_unnamed.onnx")).graph.node)
    qdq = onnx.load(str(CORPUS / "cnn_qdq.onnx")).graph.node
    assert any(n.op_type == "QuantizeLinear" for n in qdq)
    gpt2 = onnx.load(str(CORPUS / "gpt2_dynamo.onnx")).graph.node
    assert any(p.key == "pkg.torch.onnx.stack_trace" for n in gpt2 for p in n.metadata_props)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_exported_model_builds_at_every_level_and_verifies(tmp_path: Path, model: str) -> None:
    ws = _workspace(tmp_path / "ws", model)
    result = ws.build(jobs=2, keep_going=True)
    _, expects = MODELS[model]
    built = []
    for level, expect in zip(LEVELS, expects, strict=True):
        (action,) = [a for a in result.actions if a.group == level]
        if expect.outcome == "refused":
            assert action.error is not None, f"{model} at {level}: compiled"
            assert expect.message in action.error and f"models/{model}" in action.error, (
                level,
                action.error,
            )
            continue
        assert action.error is None, f"{model} at {level}: {action.error}"
        # No path false alarm; the only warning is graph coverage's, on a split graph.
        others = [w for w in action.warnings if "the graph is split into" not in w]
        assert not others, others
        assert not action.warnings or expect.outcome == "partial", action.warnings
        ctx = ws.root / "build" / level / "htp" / model.replace(".onnx", "_ctx.onnx")
        assert _coverage(ctx) == expect.outcome, f"{model} at {level}"
        built.append(level)
    if built:
        checked = verify_outputs(ws.root, None, built)
        assert checked.ok, checked.lines()
        assert len(checked.checked) == len(built)


def test_an_ep_refusal_reaches_the_user_naming_the_model(tmp_path: Path) -> None:
    """Through the command line: ORT's own message, with the model's path, exit status 1."""
    ws = _workspace(tmp_path / "ws", "llama_dynamo_external.onnx")
    proc = ws.cli("build", "all")
    assert proc.returncode == 1, proc.stderr
    assert "FAILED all/htp" in proc.stderr
    assert "models/llama_dynamo_external.onnx: ONNX Runtime failed" in proc.stderr
    assert "QNN_COMMON_ERROR_MEM_ALLOC" in proc.stderr
    assert "Traceback" not in proc.stderr


LOAD_FAILS = "The count of graph inputs should be at least the count of tensor_wrapper"
"""The QNN EP's error loading a ctx model it split into several EPContext nodes around CPU
nodes (the TorchScript transformers at ``disabled``): it compiles, and does not load."""
LOAD_FAILS_AT = {
    ("bert_torchscript.onnx", "disabled"),
    ("bert_unnamed.onnx", "disabled"),
    ("llama_torchscript.onnx", "disabled"),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", [m for m, (_, e) in MODELS.items() if e[-1] != MEM_ALLOC])
def test_exported_model_loads_and_matches_the_cpu_ep(tmp_path: Path, model: str) -> None:
    """``verify --load`` on every level that compiled (a second or two per level)."""
    ws = _workspace(tmp_path / "ws", model)
    result = ws.build(jobs=2, keep_going=True)
    built = [a.group for a in result.actions if a.error is None]
    checked = verify_outputs(ws.root, None, built, load=True)
    assert len(checked.loads) == len(built)
    for check in checked.loads:
        level = check.file.split("/")[1]
        if (model, level) in LOAD_FAILS_AT:
            assert check.outcome.value == "failed" and LOAD_FAILS in check.message, check
        else:
            assert check.outcome.value == "passed", check
            assert check.max_error is not None and check.max_error < 2e-2, check
