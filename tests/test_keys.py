"""Action keys: the digest of the canonical JSON of their components, however it is made."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import onnx
import pytest
from conftest import HTP73, HTP75, Workspace
from modelgen import matmul_model

from epbuild.errors import ModelError, UserError
from epbuild.kinds.compilekey import compile_key
from epbuild.onnx import proto
from epbuild.planning.workspace import open_workspace

CORPUS = Path(__file__).parent / "corpus"


def _canonical_digest(components: dict[str, object]) -> str:
    blob = json.dumps(components, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def test_every_key_is_the_digest_of_its_components(workspace: Workspace) -> None:
    """Keys are written from text shared by the actions of a provider and group: the bytes
    hashed are still exactly the sorted, compact JSON of each action's own components
    (with and without a toolchain, initializer names, a sharing rewrite), also when the
    versions are read again."""
    for i in range(3):
        workspace.model(f"models/m{i}.onnx", matmul_model(i))
    spill = {**HTP73["options"], "enable_htp_spill_fill_buffer": True}
    providers = {
        "htp": {**HTP73, "options": spill, "toolchain": {"python": sys.executable}},
        "v75": {**HTP75, "compiler": "session"},
    }
    groups = {
        "pair": {
            "models": ["models/m0.onnx", "models/m1.onnx"],
            "providers": ["htp", "v75"],
            "share_weights": True,
            "external_initializers": "w.bin",
        },
        "one": {"models": ["models/m2.onnx"], "providers": ["htp", "v75"]},
        "each": {"models": ["models/*.onnx"], "providers": ["v75"], "node_name_prefix": "p_"},
    }
    workspace.manifest({"providers": providers, "groups": groups})
    ws = open_workspace(workspace.root)
    assert len(ws.actions) == 7
    first = {}
    for action in ws.actions:
        key = compile_key(action, ws.keys)
        assert key.key == _canonical_digest(key.components), action.id
        first[action.id] = key.key
    kinds = {
        a.id: bool(compile_key(a, ws.keys).components.get("initializer_names")) for a in ws.actions
    }
    assert any(kinds.values()) and not all(kinds.values())
    for action in ws.actions:
        ws.keys.versions(action, fresh=True)  # new version dicts: the shared text is made again
        key = compile_key(action, ws.keys)
        assert key.key == first[action.id] == _canonical_digest(key.components)


def test_keys_read_the_external_data_references_alone(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's key reads only its external-data references (``read_external_refs``):
    the keys are those of the whole model's reader, for real exporters' models too (a
    torch.onnx CNN with its weights in external data, a dynamo export, a BERT export)."""
    models = workspace.root / "models"
    models.mkdir(parents=True)
    cnn = onnx.load(CORPUS / "cnn_torchscript.onnx")
    onnx.save(
        cnn,
        models / "cnn.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="cnn.data",
        size_threshold=0,
    )
    for name in (
        "llama_dynamo_external.onnx",
        "llama_dynamo_external.onnx.data",
        "bert_torchscript.onnx",
    ):
        shutil.copy(CORPUS / name, models / name)
    workspace.model("models/mm.onnx", matmul_model(1), external="mm.data")
    workspace.manifest(
        {
            "providers": {"htp": HTP73, "v75": HTP75},
            "groups": {"g": {"models": ["models/*.onnx"], "providers": ["htp", "v75"]}},
        }
    )
    ws = open_workspace(workspace.root)
    keys = {a.id: compile_key(a, ws.keys) for a in ws.actions}
    assert len(keys) == 8
    external = {
        m["path"]: sorted(m["external"]) for k in keys.values() for m in k.components["models"]
    }
    assert external == {
        "models/bert_torchscript.onnx": [],
        "models/cnn.onnx": ["models/cnn.data"],
        "models/llama_dynamo_external.onnx": ["models/llama_dynamo_external.onnx.data"],
        "models/mm.onnx": ["models/mm.data"],
    }

    read: list[str] = []

    def whole_model(path: str) -> list[proto.ExternalRef]:
        read.append(path)
        return proto.read_model(path).external_refs

    monkeypatch.setattr(proto, "read_external_refs", whole_model)
    again = open_workspace(workspace.root)
    assert {a.id: compile_key(a, again.keys) for a in again.actions} == keys
    assert len(read) == 4  # once per model, not once per provider


def test_a_model_cut_short_is_named(workspace: Workspace) -> None:
    raw = matmul_model(1).SerializeToString()
    workspace.model("models/ok.onnx", matmul_model(2))
    (workspace.root / "models" / "cut.onnx").write_bytes(raw[: len(raw) // 2])
    workspace.manifest(
        {
            "providers": {"htp": HTP73},
            "groups": {"g": {"models": ["models/*.onnx"], "providers": ["htp"]}},
        }
    )
    ws = open_workspace(workspace.root)
    (cut,) = [a for a in ws.actions if "models/cut.onnx" in a.models]
    with pytest.raises(ModelError, match=r"^models/cut\.onnx: not a valid ONNX model") as caught:
        compile_key(cut, ws.keys)
    assert isinstance(caught.value, UserError)
