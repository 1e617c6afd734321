"""Recorded keys: the action keys of a fixed workspace, computed with fixed toolchain
versions, are the hex digests written below. A change of how keys are computed (a new
component, another spelling, another order) fails here: every cache filled before it would
miss, so such a change must be deliberate (bump ``keys.FORMAT_VERSION`` and say so in the
changelog), never a side effect of a restructuring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace
from onnx import TensorProto, helper, numpy_helper

VERSIONS = {"onnxruntime": "1.0.0", "onnxruntime-qnn": "1.0.0", "qnn-sdk": "2.0.0"}

RECORDED = {
    "pair/htp": "067afb47f6f821200e89fc6f6591cc305418333dbce84850a6fb00447b4d4616",
    "pair/v79": "23b66aee50a82c4a9070fdb59f3251346a1179e40485f4eea01725180a33c342",
    "single/htp/c": "bdead4da2b8e7e7a243a87aaa52819a3629de912f90808942507769af3501eed",
    "named/htp/prefill": "be8f0d0e81821e563affa27acc724b9cd062d87d9ef548ec8f676fd9d425164a",
    "named/htp/decode": "81995cb57d36a80275676d6fccfd5cfcaadb01b2219c7131668ce1769caf9bb9",
    "inits/htp/c": "e06c7be59d30a1bc51686656a6f2384afdb6195942563e663722a6d7a44939bd",
}


def _model(seed: int, external: bool = False) -> Any:
    """A tiny MatMul model whose bytes never depend on the onnx version installed."""
    import numpy as np

    w = (np.arange(16, dtype=np.float32).reshape(4, 4) + seed) / 16
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="recorded"
    )
    model.ir_version = 9
    model.producer_version = ""
    return model


def _write(root: Path) -> None:
    import onnx

    (root / "models").mkdir(parents=True)
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        (root / "models" / f"{name}.onnx").write_bytes(_model(seed).SerializeToString())
    (root / "epbuild.toml").write_text(
        """
[providers.htp]
ep = "qnn"
options = { htp_arch = "73", soc_model = "60" }

[providers.v79]
ep = "qnn"
options = { htp_arch = "79", soc_model = "69" }
session_options = { "session.disable_cpu_ep_fallback" = "1" }

[groups.pair]
models = ["models/a.onnx", "models/b.onnx"]
providers = ["htp", "v79"]
share_weights = true

[groups.single]
models = ["models/c.onnx"]
providers = ["htp"]

[groups.named]
providers = ["htp"]
free_dimensions = { batch = 1 }
models = [
  { path = "models/a.onnx", name = "prefill", free_dimensions = { sequence_length = 8 } },
  { path = "models/a.onnx", name = "decode" },
]

[groups.inits]
models = ["models/c.onnx"]
providers = ["htp"]
external_initializers = "weights.bin"
embed_mode = 0
"""
    )
    assert onnx.load(str(root / "models" / "a.onnx"))  # a valid model


def test_keys_of_compile_actions_are_the_recorded_ones(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from epbuild.planning import keys
    from epbuild.planning.staleness import make_plan
    from epbuild.planning.workspace import open_workspace

    monkeypatch.setattr(keys, "read_versions", lambda cfg, toolchains: dict(VERSIONS))
    _write(workspace.root)
    ws = open_workspace(workspace.root)
    plans = make_plan(ws.actions, ws.state, ws.keys, ws.stats, ws.root)
    got = {p.action.id: p.key.key if p.key else None for p in plans}
    assert got == RECORDED
