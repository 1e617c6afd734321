"""Action keys: the digest of the canonical JSON of their components, however it is made."""

from __future__ import annotations

import hashlib
import json
import sys

from conftest import HTP73, HTP75, Workspace
from modelgen import matmul_model

from epbuild.kinds.compilekey import compile_key
from epbuild.planning.workspace import open_workspace


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
