"""The absolute-path rule: references are strict, names are never paths, free text is
checked only for the build machine's own directories (see ``epbuild.onnx.context``)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace
from onnx import TensorProto, helper, numpy_helper

from epbuild.cache.location import default_cache_dir
from epbuild.errors import VerificationError
from epbuild.onnx.context import (
    SHARED_ROOTS,
    MachinePaths,
    Problem,
    Severity,
    machine_paths,
    path_problems,
    source_text,
    toolchain_dirs,
)
from epbuild.onnx.proto import parse_model
from epbuild.onnx.staged import check_staged


def fused_gemm_on_cpu_model() -> onnx.ModelProto:
    """Unnamed nodes ``Relu → Reshape(shape input) → MatMul → Add(bias)``, input ``[1, 256]``.

    The Reshape's shape is an input, so the MatMul's operand has no static shape: the QNN EP
    leaves MatMul + Add on the CPU EP, where ONNX Runtime (basic level and above) fuses them
    into a ``Gemm`` it names ``/MatMulAddFusion`` — a name that looks like an absolute path.
    """
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 512), dtype=np.float32) * 0.1
    b = rng.standard_normal((512,), dtype=np.float32) * 0.1
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["a"]),
        helper.make_node("MatMul", ["a", "W"], ["m"]),
        helper.make_node("Add", ["m", "B"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_an_ort_derived_name_is_not_a_leak(workspace: Workspace) -> None:
    """The reported case: a fused node named ``/MatMulAddFusion`` left on the CPU EP."""
    workspace.model("m/decode.onnx", fused_gemm_on_cpu_model())
    workspace.manifest(
        {
            "providers": {"htp": HTP73},
            "groups": {
                "llm": {
                    "models": ["m/decode.onnx"],
                    "providers": ["htp"],
                    "graph_optimization_level": "all",
                }
            },
        }
    )
    result = workspace.build()
    assert result.ok, [a.error for a in result.actions]
    ctx = onnx.load(str(Path(workspace.root) / "build/llm/htp/decode_ctx.onnx"))
    names = [(n.op_type, n.name) for n in ctx.graph.node]
    assert ("Gemm", "/MatMulAddFusion") in names  # the case is really there
    assert not [w for a in result.actions for w in a.warnings]
    from epbuild.inspection.verify import verify_outputs

    checked = verify_outputs(workspace.root)
    assert checked.ok, checked.lines()


# ---------------------------------------------------------------------------------------
# The rule itself, on hand-made ctx models


def _ctx_model(**attrs: object) -> onnx.ModelProto:
    node = helper.make_node(
        "EPContext", ["x"], ["y"], "ctx_0", domain="com.microsoft",
        main_context=1, embed_mode=0, ep_cache_context="a_ctx_qnn.bin", source="qnn", **attrs,
    )  # fmt: skip
    graph = helper.make_graph(
        [node, helper.make_node("Relu", ["y"], ["z"], name="/model/layers.0/Relu")],
        "/main_graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _source(root: Path, model: onnx.ModelProto) -> str:
    """Save ``model`` as the workspace's source model; returns it workspace-relative."""
    (root / "m").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(root / "m/a.onnx"))
    return "m/a.onnx"


def _problems(
    root: Path, ctx: onnx.ModelProto, sources: tuple[str, ...] = (), *dirs: str
) -> list[Problem]:
    info = parse_model(ctx.SerializeToString(), strings=True)
    text = source_text(str(root), sources)
    return path_problems("a_ctx.onnx", info, text, machine_paths(str(root), dirs))


def test_names_with_slashes_are_never_paths(tmp_path: Path) -> None:
    model = _ctx_model()
    model.graph.node[1].name = f"{tmp_path}/export.py/Relu"  # even a machine path in a name
    model.graph.node.append(helper.make_node("Relu", ["z"], ["w"], name="/MatMulAddFusion"))
    assert _problems(tmp_path, model) == []


def test_a_workspace_path_the_compile_wrote_is_an_error(tmp_path: Path) -> None:
    model = _ctx_model()
    model.graph.node[0].doc_string = f"compiled from {tmp_path}/m/a.onnx"
    (problem,) = _problems(tmp_path, model)
    assert problem.severity is Severity.ERROR
    assert problem.file == "a_ctx.onnx" and problem.node == "ctx_0"
    assert problem.attribute == "doc_string"
    assert f"{tmp_path}/m/a.onnx" in problem.message


def test_a_workspace_path_kept_from_the_source_is_a_warning(tmp_path: Path) -> None:
    source = fused_gemm_on_cpu_model()
    helper.set_model_props(source, {"exported_from": f"{tmp_path}/export.py"})
    rel = _source(tmp_path, source)
    model = _ctx_model()
    helper.set_model_props(model, {"exported_from": f"{tmp_path}/export.py"})
    (problem,) = _problems(tmp_path, model, (rel,))
    assert problem.severity is Severity.WARNING
    assert problem.attribute == "metadata_props['exported_from']"
    assert "kept from m/a.onnx" in problem.message


@pytest.mark.parametrize(
    "text",
    [
        "/usr/lib/x86_64-linux-gnu/libQnnHtp.so",
        "File /opt/conda/lib/python3.11/site-packages/torch/nn/functional.py, line 12",
        "exported on /home/dev/project by /usr/bin/python3",
        "see file:///srv/models/readme.txt",
        "C:\\Users\\dev\\model.onnx",
    ],
)
def test_paths_of_other_machines_in_free_text_are_fine(tmp_path: Path, text: str) -> None:
    model = _ctx_model(notes=text)
    model.doc_string = text
    helper.set_model_props(model, {"origin": text})
    assert _problems(tmp_path, model) == []


def test_every_directory_of_the_machine_is_caught(tmp_path: Path) -> None:
    toolchain = tmp_path.parent / "some-toolchain-env"
    machine = machine_paths(str(tmp_path), [str(toolchain)])
    for own in (
        str(tmp_path),
        os.path.expanduser("~"),
        tempfile.gettempdir(),
        sys.prefix,
        default_cache_dir(),
        str(toolchain),
    ):
        if own.rstrip("/") in SHARED_ROOTS:
            continue  # a system Python's prefix, /usr: every machine has it
        model = _ctx_model()
        model.graph.doc_string = f"at {own}{os.sep}x.py:3"
        (problem,) = _problems(tmp_path, model, (), str(toolchain))
        assert problem.severity is Severity.ERROR and problem.attribute == "doc_string", own
        assert machine.find(f"{own}{os.sep}x.py") is not None


def test_machine_paths_match_only_whole_path_prefixes(tmp_path: Path) -> None:
    machine = MachinePaths(("/tmp", "/root"))
    assert machine.find("/tmp") == "/tmp"
    assert machine.find("/tmp/x.onnx") == "/tmp"
    assert machine.find("/tmp/.") == "/tmp"
    assert machine.find("file:///tmp/x") == "/tmp"
    assert machine.find("/tmpfs/x") is None
    assert machine.find("/rootfs") is None
    assert machine.find("/x/tmp/y") is None
    model = _ctx_model()
    model.graph.doc_string = "mounted /tmpfs and /x/tmp/y"
    info = parse_model(model.SerializeToString(), strings=True)
    assert path_problems("a_ctx.onnx", info, source_text(str(tmp_path), ()), machine) == []


def test_shared_roots_are_never_machine_paths() -> None:
    machine = machine_paths("/", ["/", "/usr", "/usr/local", "/opt", "/home"])
    assert not set(machine.paths) & {"", "/", "/usr", "/usr/local", "/opt", "/home"}
    assert machine.find("/usr/lib/libc.so") is None or sys.prefix.startswith("/usr/lib/")


@pytest.mark.parametrize("ref", ["../../a.onnx", "/abs/a.onnx", "C:\\a.onnx", "a\\..\\b"])
def test_the_reference_rule_still_refuses_climbing_and_absolute_refs(
    tmp_path: Path, ref: str
) -> None:
    (problem,) = _problems(tmp_path, _ctx_model(onnx_model_filename=ref))
    assert problem.severity is Severity.ERROR
    assert problem.attribute == "attribute onnx_model_filename"


def test_absolute_or_climbing_cache_references_fail_staging(tmp_path: Path) -> None:
    for ref in ("/abs/a_ctx_qnn.bin", "../a_ctx_qnn.bin"):
        model = _ctx_model()
        cache = next(a for a in model.graph.node[0].attribute if a.name == "ep_cache_context")
        cache.s = ref.encode()
        staging = tmp_path / ref.replace("/", "_") / "build/.staging/x-1"
        staging.mkdir(parents=True)
        onnx.save(model, str(staging / "a_ctx.onnx"))
        (staging / "a_ctx_qnn.bin").write_bytes(b"binary")
        root = staging.parent.parent.parent
        with pytest.raises(VerificationError, match=r"a_ctx\.onnx: references .*absolute"):
            check_staged(str(root), "build/.staging/x-1", ("a_ctx.onnx",))


def test_node_metadata_is_free_text(tmp_path: Path) -> None:
    """The dynamo exporter writes stack traces into node ``metadata_props``: checked as
    free text (a machine path the compile wrote there is an error)."""
    model = _ctx_model()
    trace = f'File "{tmp_path}/export.py", line 3, in forward'
    model.graph.node[1].metadata_props.add(key="pkg.torch.onnx.stack_trace", value=trace)
    (problem,) = _problems(tmp_path, model)
    assert problem.node == "/model/layers.0/Relu"
    assert problem.attribute == "metadata_props['pkg.torch.onnx.stack_trace']"
    source = _ctx_model()
    source.graph.node[1].metadata_props.add(key="pkg.torch.onnx.stack_trace", value=trace)
    (kept,) = _problems(tmp_path, model, (_source(tmp_path, source),))
    assert kept.severity is Severity.WARNING


def test_a_crashing_compile_names_the_model(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that dies inside the EP says which model of its group it was compiling."""
    workspace.model("m/a.onnx")
    workspace.model("m/b.onnx")
    group = {"models": ["m/a.onnx", "m/b.onnx"], "providers": ["htp"], "share_weights": True}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    monkeypatch.setenv("EPBUILD_TEST_HOOK", "segv:m/b.onnx")
    (action,) = workspace.build().actions
    assert action.error == "the worker was killed by SIGSEGV while compiling m/b.onnx"


def test_the_workspace_is_caught_real_and_as_given(tmp_path: Path) -> None:
    real = tmp_path / "real-ws"
    real.mkdir()
    link = tmp_path / "link-ws"
    link.symlink_to(real)
    machine = machine_paths(str(link))
    assert machine.find(f"{real}/m/a.onnx") is not None
    assert machine.find(f"{link}/m/a.onnx") is not None


def test_a_toolchains_directories_are_machine_paths(tmp_path: Path) -> None:
    from epbuild.toolchains.env import Toolchain
    from epbuild.toolchains.spec import ToolchainSpec

    env = tmp_path.parent / "elsewhere-env"
    toolchain = Toolchain(
        ToolchainSpec(python=str(env / "bin/python")),
        python=str(env / "bin/python"),
        prefix=str(env),
        sites=(str(env / "lib/python3.11/site-packages"),),
        version="3.11.7",
    )
    machine = machine_paths(str(tmp_path), toolchain_dirs(toolchain))
    found = machine.find(f"{env}/lib/python3.11/site-packages/onnxruntime/capi")
    assert found == f"{env}/lib/python3.11/site-packages"  # the longest of its directories
    assert machine.find(f"{env}/bin/python") == f"{env}/bin"
    assert machine_paths(str(tmp_path)).find(f"{env}/bin/python") != f"{env}/bin"


def test_a_shorter_path_in_the_source_does_not_excuse_a_longer_one(tmp_path: Path) -> None:
    source = _ctx_model()
    source.doc_string = f"exported under {tmp_path}"
    model = _ctx_model()
    model.doc_string = f"compiled from {tmp_path}/m/a.onnx"
    (problem,) = _problems(tmp_path, model, (_source(tmp_path, source),))
    assert problem.severity is Severity.ERROR
