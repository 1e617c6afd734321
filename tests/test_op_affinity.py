"""The QNN provider option ``op_affinity``: a JSON file named relative to the manifest,
keyed by its content. On a statically prepared builder-made decoder it is what puts
GroupQueryAttention on the HTP (one EPContext node for the whole graph)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import Workspace
from modelgen import matmul_model

from epbuild.errors import ManifestError
from epbuild.llm.static import StaticShape, make_static
from epbuild.manifest.load import load_manifest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"
HTP = {"op_type": {"GroupQueryAttention": "htp"}}


def _manifest(affinity: str | None) -> str:
    option = f', op_affinity = "{affinity}"' if affinity else ""
    return f"""\
[providers.htp]
ep = "qnn"
options = {{ htp_arch = "73", soc_model = "60"{option} }}

[groups.llm]
models = ["models/iterator.onnx"]
providers = ["htp"]
"""


def _workspace(ws: Workspace) -> None:
    source = onnx.load(FIXTURES / "llama" / "model.onnx")
    static = make_static(source, StaticShape(1, 64, 16))
    (ws.root / "models").mkdir(parents=True)
    onnx.save(static, ws.root / "models" / "iterator.onnx")
    (ws.root / "affinity.json").write_text(json.dumps(HTP))


def _ctx_ops(ws: Workspace) -> list[str]:
    ctx = onnx.load(ws.root / "build/llm/htp/iterator_ctx.onnx", load_external_data=False)
    return [n.op_type for n in ctx.graph.node]


# Three compiles of a decoder. Fast: an option file keyed by its content (below, on a tiny
# model); a prepared LLM's affinity puts attention on the HTP (test_llm_build.py
# test_unshared_build_noop_and_rebuilds: its ctx models are one EPContext node).
@pytest.mark.slow
def test_affinity_offloads_attention_and_is_keyed_by_content(workspace: Workspace) -> None:
    _workspace(workspace)
    workspace.manifest(_manifest(None))
    workspace.cli("build", check=True)
    without = _ctx_ops(workspace)
    assert "GroupQueryAttention" in without  # the EP's default: attention on the CPU

    workspace.manifest(_manifest("affinity.json"))
    workspace.cli("build", check=True)
    assert _ctx_ops(workspace) == ["EPContext"]
    assert "1 up to date" in workspace.cli("build", check=True).stdout

    # Same path, other content: the action is stale, and says why.
    (workspace.root / "affinity.json").write_text(json.dumps({"op_type": {}}))
    status = workspace.cli_json("status")
    reasons = json.dumps(status)
    assert "option file affinity.json changed" in reasons
    workspace.cli("build", check=True)
    assert "GroupQueryAttention" in _ctx_ops(workspace)


def test_an_option_file_is_keyed_by_its_content(workspace: Workspace) -> None:
    """The same bytes written again leave the action up to date; other bytes at the same
    path make it stale, and status says which file changed."""
    workspace.model("models/iterator.onnx", matmul_model(1))
    affinity = workspace.root / "affinity.json"
    affinity.write_text(json.dumps(HTP))
    workspace.manifest(_manifest("affinity.json"))
    assert workspace.main_json("build")["summary"]["compiled"] == 1
    affinity.write_text(json.dumps(HTP))  # a new mtime, the same content
    (action,) = workspace.main_json("status")["actions"]
    assert not action["stale"], action
    affinity.write_text(json.dumps({"op_type": {}}))
    (action,) = workspace.main_json("status")["actions"]
    assert action["stale"] and "option file affinity.json changed" in action["reasons"], action


def test_missing_affinity_file_names_the_line(workspace: Workspace) -> None:
    _workspace(workspace)
    path = workspace.manifest(_manifest("missing.json"))
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    err = info.value
    assert err.key == "providers.htp.options.op_affinity" and err.line == 3
    assert "missing.json: no such file" in str(err)


def test_affinity_path_must_stay_inside(workspace: Workspace) -> None:
    _workspace(workspace)
    path = workspace.manifest(_manifest("/etc/affinity.json"))
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert info.value.key == "providers.htp.options.op_affinity"
    assert "absolute" in str(info.value)
