"""Every EPContext option as a manifest setting, end to end with the real QNN EP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace
from modelgen import _model, matmul_model
from onnx import helper, numpy_helper

from epbuild.api import Outcome
from epbuild.inspection.verify import verify_outputs
from epbuild.onnx.proto import read_model

MULTI = {"ep": "qnn", "options": {"htp_arch": "73,75", "soc_model": "60,57"}}


def mod_model(seed: int = 0, n: int = 32) -> onnx.ModelProto:
    """MatMul → Tanh → Mod(·, M) → MatMul: Mod (and its initializer M) stays on the CPU EP."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, n), dtype=np.float32) * 0.1
    m = (rng.random((n,), dtype=np.float32) + 0.5).astype(np.float32)
    v = rng.standard_normal((n, n), dtype=np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Mod", ["t", "M"], ["a"], fmod=1),
        helper.make_node("MatMul", ["a", "V"], ["y"]),
    ]
    inits = [numpy_helper.from_array(a, k) for a, k in ((w, "W"), (m, "M"), (v, "V"))]
    return _model(nodes, inits, [1, n], [1, n])


def run_cpu(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]  # type: ignore[no-any-return]


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def built(ws: Workspace, action: str) -> Path:
    return ws.root / "build" / Path(*action.split("/")[:2])


def main_nodes(ctx: Path) -> list[Any]:
    return [n for n in read_model(ctx).context_nodes if n.attributes.get("main_context") == 1]


def test_embed_modes_plain(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {
        "e0": {"models": ["m/a.onnx"], "providers": ["htp"], "embed_mode": 0},
        "e1": {"models": ["m/a.onnx"], "providers": ["htp"], "embed_mode": 1}}})  # fmt: skip
    result = workspace.build()
    assert result.ok and result.count(Outcome.COMPILED) == 2
    assert sorted(p.name for p in built(workspace, "e0/htp").iterdir()) == [
        "a_ctx.onnx", "a_ctx_qnn.bin"]  # fmt: skip
    assert [p.name for p in built(workspace, "e1/htp").iterdir()] == ["a_ctx.onnx"]
    (n0,) = main_nodes(built(workspace, "e0/htp") / "a_ctx.onnx")
    (n1,) = main_nodes(built(workspace, "e1/htp") / "a_ctx.onnx")
    assert n0.attributes["embed_mode"] == 0 and n0.attributes["ep_cache_context"] == "a_ctx_qnn.bin"
    assert n1.attributes["embed_mode"] == 1 and len(n1.attributes["ep_cache_context"]) > 10_000
    assert verify_outputs(workspace.root).ok


def test_embed1_with_sharing_is_refused(simple_ws: Any) -> None:
    ws = simple_ws(embed_mode=1)
    proc = ws.cli("build")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "groups.pair.embed_mode" in proc.stderr and "share_weights" in proc.stderr


def test_sharing_group_embed0_verifies(simple_ws: Any) -> None:
    ws = simple_ws(embed_mode=0)
    assert ws.build().ok
    result = verify_outputs(ws.root)
    assert result.ok, result.lines()
    assert len(result.checked) == 3


@pytest.mark.slow
@pytest.mark.parametrize("ext", [None, "weights.bin"])
def test_partial_model(workspace: Workspace, ext: str | None) -> None:
    from epbuild.inspection.detail import status_detail
    from epbuild.runtime import open_action

    src = workspace.model("m/p.onnx", mod_model(1))
    group: dict[str, Any] = {"models": ["m/p.onnx"], "providers": ["htp"]}
    if ext:
        group["external_initializers"] = ext
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    result = workspace.build()
    assert result.ok, result.actions[0].error
    out = built(workspace, "g/htp")
    ctx = out / "p_ctx.onnx"
    info = read_model(ctx)
    nodes = info.context_nodes
    assert len(nodes) == 2 and info.op_types.get("Mod") == 1
    assert [n.attributes["main_context"] for n in nodes] == [1, 0]
    assert nodes[0].attributes["ep_cache_context"] == "p_ctx_qnn.bin"
    assert "ep_cache_context" not in nodes[1].attributes
    if ext:
        assert {r.location for r in info.external_refs} == {ext} and (out / ext).is_file()
        assert f"build/g/htp/{ext}" in result.actions[0].outputs
    else:
        assert info.external_refs == [] and sorted(p.name for p in out.iterdir()) == [
            "p_ctx.onnx", "p_ctx_qnn.bin"]  # fmt: skip
    (detail,) = status_detail(workspace.root)
    assert detail.models[0].cpu_op_types == {"Mod": 1} and detail.models[0].context_nodes == 2
    assert verify_outputs(workspace.root).ok
    x = np.random.default_rng(0).standard_normal((1, 32), dtype=np.float32)
    for load in ("path", "bytes"):
        with open_action("g/htp", workspace.root, load=load) as b:
            assert rel_error(b.run("p", {"x": x})[0], run_cpu(src, x)) < 2e-2


def test_group_growing_renames_external_initializers(workspace: Workspace) -> None:
    """The initializer file's name depends on the group's size, so the size is in the key."""
    workspace.model("m/p.onnx", mod_model(1))
    group: dict[str, Any] = {"models": ["m/p.onnx"], "providers": ["htp"],
                             "external_initializers": "w.bin"}  # fmt: skip
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    assert workspace.build().ok
    out = built(workspace, "g/htp")
    assert (out / "w.bin").is_file()  # one model: the configured name as is
    workspace.model("m/q.onnx", mod_model(2))
    group["models"] = ["m/p.onnx", "m/q.onnx"]
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    status = {a.id: a for a in workspace.build(dry_run=True).actions}
    assert status["g/htp/p"].outcome is Outcome.WOULD_BUILD
    assert status["g/htp/p"].reasons == [
        "external-initializer file names w.bin → p_w.bin (they depend on how many models the "
        "group has)"]  # fmt: skip
    result = workspace.build()
    assert result.ok and {a.id: a.outcome for a in result.actions} == {
        "g/htp/p": Outcome.COMPILED, "g/htp/q": Outcome.COMPILED}  # fmt: skip
    assert not (out / "w.bin").exists()
    assert {r.location for r in read_model(out / "p_ctx.onnx").external_refs} == {"p_w.bin"}
    assert (out / "p_w.bin").is_file() and (out / "q_w.bin").is_file()
    assert verify_outputs(workspace.root).ok
    assert {a.outcome for a in workspace.build().actions} == {Outcome.UP_TO_DATE}


def test_record_without_initializer_names_reads_as_stale() -> None:
    """A record from before the names were in the key: stale with a reason, no crash."""
    from epbuild.planning.keys import explain_difference

    new = {"format": "1", "group": {"external_initializers": "w.bin"}, "models": [],
           "initializer_names": ["w.bin"]}  # fmt: skip
    old = {k: v for k, v in new.items() if k != "initializer_names"}
    assert explain_difference(old, new) == [
        "external-initializer file names w.bin were not in the recorded key"]  # fmt: skip
    old["group"] = {"external_initializers": None}  # the setting changed: said once, above
    assert explain_difference(old, new) == ['group setting external_initializers: unset → "w.bin"']


@pytest.mark.parametrize("load", ["path", "bytes"])
def test_source_with_external_data(workspace: Workspace, load: str) -> None:
    from epbuild.runtime import open_action

    src = workspace.model("m/e.onnx", matmul_model(4), external="e.data")
    assert read_model(src).external_refs  # the weights really are external
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/e.onnx"], "providers": ["htp"], "load": load}}})  # fmt: skip
    result = workspace.build()
    assert result.ok, result.actions[0].error
    info = read_model(built(workspace, "g/htp") / "e_ctx.onnx")
    assert info.external_refs == []  # the ctx does not depend on the source's data file
    x = np.random.default_rng(1).standard_normal((1, 32), dtype=np.float32)
    with open_action("g/htp", workspace.root) as b:
        assert rel_error(b.run("e", {"x": x})[0], run_cpu(src, x)) < 2e-2
    # the external-data file is an input of the action
    data = bytearray((workspace.root / "m" / "e.data").read_bytes())
    data[8] ^= 0x01
    (workspace.root / "m" / "e.data").write_bytes(bytes(data))
    again = workspace.build(dry_run=True).actions[0]
    assert again.outcome is Outcome.WOULD_BUILD
    assert again.reasons == ["external data m/e.data of m/e.onnx changed"]


def test_multi_soc_target(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    workspace.manifest({"providers": {"multi": MULTI}, "groups": {"g": {
        "models": ["m/a.onnx"], "providers": ["multi"]}}})  # fmt: skip
    result = workspace.build()
    assert result.ok, result.actions[0].error
    info = read_model(built(workspace, "g/multi") / "a_ctx.onnx")
    assert info.metadata["ep_compatibility_info.QNNExecutionProvider"].split(":")[4:6] == [
        "73,75",
        "60,57",
    ]
    assert info.context_nodes[0].attributes["is_multi_soc_ep_context"] == 1
    checked = verify_outputs(workspace.root, load=True)
    assert checked.ok, checked.lines()
    assert [c.outcome.value for c in checked.loads] == ["not_loadable_here"]


def test_multi_soc_with_sharing_is_refused(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    workspace.model("m/b.onnx")
    group = {"models": ["m/a.onnx", "m/b.onnx"], "providers": ["multi"], "share_weights": True}
    workspace.manifest({"providers": {"multi": MULTI}, "groups": {"g": group}})
    proc = workspace.main("build")
    assert proc.returncode == 2 and "several SoCs" in proc.stderr
    assert "groups.g.share_weights" in proc.stderr


def test_a_known_chip_with_another_architecture_exits_2(workspace: Workspace) -> None:
    """The pair the examples once had: the 8 Elite's soc_model with the 8 Gen 3's arch."""
    workspace.model("m/a.onnx")
    v75 = {"ep": "qnn", "options": {"htp_arch": "75", "soc_model": "69"}}
    workspace.manifest({"providers": {"v75": v75}, "groups": {"g": {
        "models": ["m/a.onnx"], "providers": ["v75"]}}})  # fmt: skip
    proc = workspace.cli("build")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "providers.v75.options.soc_model" in proc.stderr
    assert "Snapdragon 8 Elite (SM8750), an HTP v79 chip" in proc.stderr
    assert not (workspace.root / "build").exists()


def test_node_name_prefix_ignored_warns_once(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    workspace.model("m/b.onnx", matmul_model(2))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/a.onnx", "m/b.onnx"], "providers": ["htp"],
        "node_name_prefix": "mine_"}}})  # fmt: skip
    result = workspace.build(jobs=1)
    assert result.ok
    warnings = [w for a in result.actions for w in a.warnings]
    assert len(warnings) == 1
    assert "qnn EP" in warnings[0] and "onnxruntime-qnn 2." in warnings[0]
    assert "node_name_prefix" in warnings[0]


def test_embed1_over_2gb_is_refused(workspace: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    from epbuild.planning import staleness as plan

    # A real 2 GB model would take minutes to write and hash: lower the limit instead.
    src = workspace.model("m/a.onnx", matmul_model(1), external="a.data")
    size = src.stat().st_size + (src.parent / "a.data").stat().st_size
    monkeypatch.setattr(plan, "EMBED_LIMIT", size)
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {
        "big1": {"models": ["m/a.onnx"], "providers": ["htp"], "embed_mode": 1},
        "big0": {"models": ["m/a.onnx"], "providers": ["htp"], "embed_mode": 0}}})  # fmt: skip
    result = workspace.build(keep_going=True)
    by_id = {a.id: a for a in result.actions}
    assert by_id["big1/htp/a"].outcome is Outcome.FAILED
    assert "2 GB limit" in (by_id["big1/htp/a"].error or "")
    assert "embed_mode = 0" in (by_id["big1/htp/a"].hint or "")
    assert by_id["big0/htp/a"].outcome is Outcome.COMPILED
