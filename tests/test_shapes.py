"""Static shapes for NPUs: free_dimensions, named model entries, and the check before
compiling (issue #12, point 3). End-to-end tests compile with the real QNN EP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HTP73, Workspace
from modelgen import matmul_model
from onnx import TensorProto, helper

from epbuild.api import Outcome
from epbuild.errors import ManifestError
from epbuild.manifest.load import load_manifest
from epbuild.manifest.schema import SchemaViolation, validate
from epbuild.onnx.proto import GraphInput, parse_model, read_model

W = np.random.default_rng(11).standard_normal((32, 32), dtype=np.float32) * 0.1


def llm_workspace(ws: Workspace, **group: Any) -> Workspace:
    """One source with a symbolic ``sequence_length``, in group ``llm`` for HTP."""
    ws.model("models/llm.onnx", matmul_model(1, batch="sequence_length", shared=W))
    table = {"models": ["models/llm.onnx"], "providers": ["htp"], **group}
    ws.manifest({"providers": {"htp": HTP73}, "groups": {"llm": table}})
    return ws


PREFILL_DECODE = [
    {"path": "models/llm.onnx", "name": "prefill", "free_dimensions": {"sequence_length": 128}},
    {"path": "models/llm.onnx", "name": "decode", "free_dimensions": {"sequence_length": 1}},
]


# ---------------------------------------------------------------------------------------
# The proto reader: graph input shapes


def test_reader_lists_graph_inputs_with_their_dimensions() -> None:
    m = matmul_model(batch="batch")
    extra = [
        helper.make_tensor_value_info("W", TensorProto.FLOAT, [32, 32]),  # an initializer
        helper.make_tensor_value_info("unshaped", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("unnamed", TensorProto.FLOAT, [None, 3]),
        helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, [1]),
    ]
    m.graph.input.extend(extra)
    assert parse_model(m.SerializeToString()).inputs == (
        GraphInput("x", ("batch", 32)),
        GraphInput("unshaped", None),
        GraphInput("unnamed", (None, 3)),
    )


# ---------------------------------------------------------------------------------------
# The manifest


def test_table_entries_load_with_names_and_overrides(workspace: Workspace) -> None:
    llm_workspace(workspace, models=PREFILL_DECODE, free_dimensions={"batch": 1})
    g = load_manifest(workspace.root / "epbuild.toml").groups["llm"]
    assert g.models == ("models/llm.onnx", "models/llm.onnx")
    assert [(e.name, e.index) for e in g.entries] == [("prefill", 0), ("decode", 1)]
    assert [g.free_dimensions_of(e) for e in g.entries] == [
        {"batch": 1, "sequence_length": 128},
        {"batch": 1, "sequence_length": 1},
    ]


def test_entry_overrides_win_over_the_group(workspace: Workspace) -> None:
    entry = {"path": "models/llm.onnx", "free_dimensions": {"sequence_length": 7}}
    llm_workspace(workspace, models=[entry], free_dimensions={"sequence_length": 128})
    g = load_manifest(workspace.root / "epbuild.toml").groups["llm"]
    assert g.entries[0].name == "llm"
    assert g.free_dimensions_of(g.entries[0]) == {"sequence_length": 7}


def _err(workspace: Workspace, text: str) -> ManifestError:
    workspace.model("models/llm.onnx", matmul_model(1, batch="sequence_length"))
    workspace.manifest('[providers.htp]\nep = "qnn"\n\n[groups.llm]\nproviders = ["htp"]\n' + text)
    with pytest.raises(ManifestError) as info:
        load_manifest(workspace.root / "epbuild.toml")
    return info.value


def test_duplicate_names_name_the_line(workspace: Workspace) -> None:
    err = _err(
        workspace,
        "models = [\n"
        '  { path = "models/llm.onnx", name = "step" },\n'
        '  { path = "models/llm.onnx", name = "step" },\n'
        "]\n",
    )
    assert err.line == 8 and err.key == "groups.llm.models[1]"
    assert "listed twice under the name 'step'" in str(err)


def test_the_same_model_twice_without_names_says_how(workspace: Workspace) -> None:
    err = _err(workspace, 'models = ["models/llm.onnx", { path = "models/llm.onnx" }]\n')
    assert "'models/llm.onnx' is listed twice" in str(err)
    assert 'name = "..."' in (err.hint or "")


def test_a_name_collides_with_another_models_stem(workspace: Workspace) -> None:
    workspace.model("models/other.onnx")
    err = _err(workspace, 'models = ["models/other.onnx", { path = "models/llm.onnx", '
                          'name = "other" }]\n')  # fmt: skip
    assert "would both write other_ctx.onnx" in str(err)


def test_a_name_for_a_glob_is_refused(workspace: Workspace) -> None:
    err = _err(workspace, 'models = [{ path = "models/*.onnx", name = "x" }]\n')
    assert err.key == "groups.llm.models[0].name" and "is a pattern" in str(err)


def test_a_typo_in_an_entry_names_key_and_line(workspace: Workspace) -> None:
    err = _err(
        workspace,
        "models = [\n"
        '  "models/llm.onnx",\n'
        '  { path = "models/llm.onnx", name = "d", free_dimension = { sequence_length = 1 } },\n'
        "]\n",
    )
    assert err.line == 8 and err.key == "groups.llm.models[1].free_dimension"
    assert "unknown key" in str(err) and "free_dimensions" in (err.hint or "")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{ sequence_length = 0 }", "must be at least 1"),
        ('{ sequence_length = "128" }', "must be integer"),
        ("128", "must be object"),
    ],
)
def test_bad_free_dimension_values(workspace: Workspace, value: str, message: str) -> None:
    err = _err(workspace, f'models = ["models/llm.onnx"]\nfree_dimensions = {value}\n')
    assert err.key is not None and err.key.startswith("groups.llm.free_dimensions")
    assert message in str(err) and err.line == 7


def test_schema_accepts_and_rejects_entries() -> None:
    ok = {"groups": {"g": {"models": ["a.onnx", *PREFILL_DECODE], "providers": ["p"],
                           "free_dimensions": {"batch": 1}}}}  # fmt: skip
    validate(ok)
    for bad in (
        {"path": "a.onnx", "name": "../x"},
        {"name": "x"},
        {"path": "a.onnx", "free_dimensions": {"batch": -1}},
        {"path": "a.onnx", "bogus": 1},
    ):
        with pytest.raises(SchemaViolation):
            validate({"groups": {"g": {"models": [bad], "providers": ["p"]}}})


# ---------------------------------------------------------------------------------------
# Keys and actions


def _plan(ws: Workspace) -> Any:
    from epbuild.planning.staleness import make_plan
    from epbuild.planning.workspace import open_workspace

    w = open_workspace(ws.root, None, [])
    return {p.action.id: p for p in make_plan(w.actions, w.state, w.keys, w.stats, w.root)}


def test_plain_entries_add_no_key_components(workspace: Workspace) -> None:
    llm_workspace(workspace, models=["models/llm.onnx", {"path": "models/llm.onnx",
                                                          "name": "two"}])  # fmt: skip
    plans = _plan(workspace)
    assert set(plans) == {"llm/htp/llm", "llm/htp/two"}
    assert set(plans["llm/htp/llm"].key.components["models"][0]) == {"path", "digest", "external"}
    assert plans["llm/htp/two"].key.components["models"][0]["name"] == "two"
    assert plans["llm/htp/two"].action.ctx_names == ("two_ctx.onnx",)


def test_an_override_is_in_the_key(workspace: Workspace) -> None:
    llm_workspace(workspace, free_dimensions={"sequence_length": 128})
    first = _plan(workspace)["llm/htp/llm"].key
    assert first.components["models"][0]["free_dimensions"] == {"sequence_length": 128}
    llm_workspace(workspace, free_dimensions={"sequence_length": 64})
    assert _plan(workspace)["llm/htp/llm"].key.key != first.key


# ---------------------------------------------------------------------------------------
# End to end, with the real QNN EP


def test_a_symbolic_dimension_fails_before_compiling(workspace: Workspace) -> None:
    llm_workspace(workspace)
    result = workspace.build()
    (a,) = result.actions
    assert a.outcome is Outcome.FAILED and a.exit_code == 2
    assert a.error == (
        "models/llm.onnx: input 'x' [sequence_length, 32] has the symbolic dimension "
        "'sequence_length', and the qnn provider 'htp' compiles static shapes only"
    )
    assert a.hint is not None and "groups.llm.free_dimensions.sequence_length" in a.hint
    assert not (workspace.root / "build" / "llm").exists()  # no worker wrote anything


def _job(**kw: Any) -> Any:
    from epbuild.kinds.compilework import CompileWork
    from epbuild.manifest.model import ContextSettings
    from epbuild.providers import get_provider
    from epbuild.providers.base import ProviderConfig

    options, _ = get_provider("qnn").validate_options(HTP73["options"], {}, key="p")
    config = ProviderConfig("htp", "qnn", options)
    return CompileWork(
        "llm/htp/llm", config, ("models/llm.onnx",), "out", ContextSettings(), (), **kw
    )


def test_without_the_check_the_compile_writes_nothing(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the check prevents (the behaviour before it): the EP takes no node, ORT runs
    the model on the CPU EP silently, and the worker can only guess afterwards. The same
    job with the override compiles."""
    from epbuild.executors.worker import CompileFailure, compile_action

    llm_workspace(workspace)
    (workspace.root / "out").mkdir()
    monkeypatch.chdir(workspace.root)
    with pytest.raises(CompileFailure, match="no EPContext model was written"):
        compile_action(_job())
    assert compile_action(_job(free_dimensions=({"sequence_length": 2},)))["ok"]
    assert read_model("out/llm_ctx.onnx").inputs == (GraphInput("x", (2, 32)),)


def test_an_entry_table_hint_names_the_entry(workspace: Workspace) -> None:
    workspace.model("models/v.onnx", matmul_model(2, batch="batch"))
    entry = {"path": "models/v.onnx", "name": "vision"}
    workspace.manifest(
        {"providers": {"htp": HTP73}, "groups": {"g": {"models": [entry], "providers": ["htp"]}}}
    )
    (a,) = workspace.build().actions
    assert a.error is not None and a.error.startswith("models/v.onnx (as vision): input 'x'")
    assert a.hint is not None and "groups.g.models[0].free_dimensions.batch" in a.hint


def test_free_dimensions_compile_everything_on_htp(workspace: Workspace) -> None:
    llm_workspace(workspace, free_dimensions={"sequence_length": 16})
    result = workspace.build()
    assert result.ok, result.actions[0].error
    ctx = read_model(workspace.root / "build" / "llm" / "htp" / "llm_ctx.onnx")
    assert set(ctx.op_types) == {"com.microsoft::EPContext"}
    assert ctx.inputs == (GraphInput("x", (16, 32)),)


@pytest.mark.parametrize("load", ["path", "bytes"])
def test_prefill_and_decode_share_one_binary(workspace: Workspace, load: str) -> None:
    """One source twice in a sharing group. The QNN EP names graphs by a hash of the path
    string ORT got (bytes: of the external-data folder string), and one shared context
    cannot hold two graphs of one name: the worker varies that string (``./`` prefixes)."""
    llm_workspace(workspace, models=PREFILL_DECODE, share_weights=True, load=load)
    result = workspace.build()
    assert result.ok, result.actions[0].error
    out = workspace.root / "build" / "llm" / "htp"
    assert sorted(p.name for p in out.iterdir()) == [
        "decode_ctx.onnx", "prefill_ctx.onnx", "prefill_ctx_qnn.bin"]  # fmt: skip
    shapes = {n: read_model(out / f"{n}_ctx.onnx").inputs[0].shape for n in ("prefill", "decode")}
    assert shapes == {"prefill": (128, 32), "decode": (1, 32)}
    detail = workspace.main_json("status", "--detail")
    models = detail["actions"][0]["models"]
    assert [(m["name"], m["context_nodes"], m["cpu_nodes"]) for m in models] == [
        ("prefill", 1, 0), ("decode", 1, 0)]  # fmt: skip
    # Changing one override rebuilds the group, saying why.
    changed = [dict(PREFILL_DECODE[0]), PREFILL_DECODE[1]]
    changed[0]["free_dimensions"] = {"sequence_length": 64}
    llm_workspace(workspace, models=changed, share_weights=True, load=load)
    again = workspace.build()
    (a,) = again.actions
    assert a.outcome is Outcome.COMPILED
    assert a.reasons == ["free dimension sequence_length of models/llm.onnx (as prefill): 128 → 64"]


def test_a_named_model_runs_under_its_name(workspace: Workspace) -> None:
    from epbuild.runtime import open_action

    models = [{**PREFILL_DECODE[1], "name": "step"}]
    llm_workspace(workspace, models=models)
    assert workspace.build().ok
    with open_action("llm/htp/step", workspace.root) as built:
        assert built.names == ["step"]
        (y,) = built.run("step", {"x": np.ones((1, 32), np.float32)})
    assert y.shape == (1, 32)


def test_an_override_no_model_has_is_a_warning(workspace: Workspace) -> None:
    llm_workspace(workspace, free_dimensions={"sequence_length": 4, "batch_size": 1})
    (a,) = workspace.build().actions
    assert a.outcome is Outcome.COMPILED
    assert a.warnings == [
        "groups.llm.free_dimensions.batch_size: no model of the group has an input dimension "
        "'batch_size' (its symbolic ones: sequence_length)"
    ]


def test_a_misspelt_override_still_fails_for_the_npu(workspace: Workspace) -> None:
    llm_workspace(workspace, free_dimensions={"sequence_lenght": 4})
    (a,) = workspace.build().actions
    assert a.outcome is Outcome.FAILED and "'sequence_length'" in (a.error or "")


def test_symbolic_dimensions_are_fine_where_the_ep_is_not_an_npu(tmp_path: Path) -> None:
    from epbuild.kinds.shapes import check_shapes
    from epbuild.planning.actions import make_actions

    ws = Workspace(tmp_path)
    ws.model("models/llm.onnx", matmul_model(1, batch="sequence_length"))
    providers = {"ov": {"ep": "openvino", "options": {"device_type": "CPU"}},
                 "npu": {"ep": "openvino"}}  # fmt: skip
    group = {"models": ["models/llm.onnx"], "providers": ["ov", "npu"]}
    ws.manifest({"providers": providers, "groups": {"g": group}})
    cpu, npu = make_actions(load_manifest(tmp_path / "epbuild.toml"))
    assert check_shapes(str(tmp_path), cpu).warnings == []
    from epbuild.errors import ModelError

    with pytest.raises(ModelError, match="the openvino provider 'npu' compiles static"):
        check_shapes(str(tmp_path), npu)


def test_verify_load_runs_the_source_at_the_compiled_shapes(workspace: Workspace) -> None:
    from epbuild.inspection.verify import verify_outputs

    llm_workspace(workspace, models=[PREFILL_DECODE[0]])
    assert workspace.build().ok
    result = verify_outputs(workspace.root, load=True)
    assert [c.outcome.value for c in result.loads] == ["passed"], result.loads


def test_an_entry_override_the_model_lacks_is_a_warning(tmp_path: Path) -> None:
    from epbuild.kinds.shapes import check_shapes
    from epbuild.planning.actions import make_actions

    ws = Workspace(tmp_path)
    ws.model("models/llm.onnx", matmul_model(1, batch="sequence_length"))
    entry = {"path": "models/llm.onnx", "free_dimensions": {"sequence_length": 2, "batch": 1}}
    providers = {"ov": {"ep": "openvino", "options": {"device_type": "CPU"}}}
    ws.manifest({"providers": providers, "groups": {"g": {"models": [entry], "providers": ["ov"]}}})
    (action,) = make_actions(load_manifest(tmp_path / "epbuild.toml"))
    assert check_shapes(str(tmp_path), action).warnings == [
        "groups.g.models[0].free_dimensions.batch: models/llm.onnx has no input dimension "
        "'batch' (its symbolic ones: sequence_length)"
    ]
