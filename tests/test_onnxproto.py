"""The wire-format reader against models that onnx itself writes."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import waits
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import (
    ExternalDataInfo,
    _get_all_tensors,
    convert_model_to_external_data,
    set_external_data,
    uses_external_data,
)

from epbuild.onnx import proto
from epbuild.onnx.proto import (
    ContextNode,
    ExternalRef,
    GraphInput,
    ModelInfo,
    ProtoError,
    parse_external_refs,
    parse_model,
    read_external_refs,
    read_model,
)

LIGHT = sorted((Path(onnx.__file__).parent / "backend/test/data/light").glob("*.onnx"))
CORPUS_DIR = Path(__file__).parent / "corpus"
CORPUS = sorted(CORPUS_DIR.glob("*.onnx"))
FLOAT = TensorProto.FLOAT


def _weights(name: str, *shape: int) -> TensorProto:
    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return numpy_helper.from_array(data, name)


def _model(
    nodes: list[onnx.NodeProto],
    initializers: list[TensorProto] | None = None,
    *,
    opsets: dict[str, int] | None = None,
    **kwargs: object,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
        initializer=initializers or [],
    )
    imports = [helper.make_opsetid(d, v) for d, v in (opsets or {"": 17}).items()]
    return helper.make_model(graph, opset_imports=imports, **kwargs)


def _small() -> onnx.ModelProto:
    model = _model(
        [helper.make_node("Add", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
        [_weights("w", 2, 3)],
    )
    helper.set_model_props(model, {"author": "me"})
    return model


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=0,
    )


def _onnx_refs(path: Path) -> set[ExternalRef]:
    """What onnx's own helper reports, as ExternalRefs."""
    refs = set()
    for tensor in _get_all_tensors(onnx.load(path, load_external_data=False)):
        if uses_external_data(tensor):
            info = ExternalDataInfo(tensor)
            refs.add(ExternalRef(tensor.name, info.location, info.offset, info.length, None))
    return refs


def test_inline_weights(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_small(), path)
    info = read_model(path)
    assert info == ModelInfo(
        ir_version=onnx.load(path).ir_version,
        opsets={"": 17},
        external_refs=[],
        context_nodes=[],
        op_types={"Add": 1, "Relu": 1},
        metadata={"author": "me"},
        node_count=2,
        inputs=(GraphInput("x", (2, 3)),),
    )
    assert parse_model(path.read_bytes()) == info
    assert parse_model(memoryview(path.read_bytes())) == info
    assert parse_model(memoryview(path.read_bytes()).cast("b")) == info  # signed bytes
    assert parse_model(memoryview(b"xx" + path.read_bytes())[2:]) == info
    assert read_model(str(path)) == info


def test_external_data_matches_onnx(tmp_path: Path) -> None:
    model = _model(
        [helper.make_node("Add", ["x", "w1"], ["t"]), helper.make_node("Mul", ["t", "w2"], ["y"])],
        [_weights("w1", 2, 3), _weights("w2", 2, 3)],
    )
    path = tmp_path / "m.onnx"
    _save_external(model, path)
    refs = read_model(path).external_refs
    assert len(refs) == 2
    assert set(refs) == _onnx_refs(path)
    assert {r.location for r in refs} == {"m.onnx.data"}
    assert all(r.offset is not None and r.length == 24 for r in refs)


def test_subgraph_initializer(tmp_path: Path) -> None:
    def branch(name: str, op: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, ["x", f"{name}_w"], [f"{name}_y"])],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_y", FLOAT, [2, 3])],
            initializer=[_weights(f"{name}_w", 2, 3)],
        )

    cond = numpy_helper.from_array(np.array(True), "cond")
    node = helper.make_node(
        "If", ["cond"], ["y"], then_branch=branch("then", "Add"), else_branch=branch("else", "Sub")
    )
    path = tmp_path / "m.onnx"
    _save_external(_model([node], [cond]), path)
    info = read_model(path)
    assert {r.tensor for r in info.external_refs} == {"cond", "then_w", "else_w"}
    assert set(info.external_refs) == _onnx_refs(path)
    assert info.op_types == {"If": 1}  # subgraph nodes are not counted
    assert info.node_count == 1


def test_attribute_tensor_and_function(tmp_path: Path) -> None:
    const = helper.make_node("Constant", [], ["c"], value=_weights("cval", 2, 3))
    func = helper.make_function(
        "local",
        "AddConst",
        ["a"],
        ["b"],
        [
            helper.make_node("Constant", [], ["k"], value=_weights("fval", 2, 3)),
            helper.make_node("Add", ["a", "k"], ["b"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    nodes = [
        const,
        helper.make_node("AddConst", ["x"], ["t"], domain="local"),
        helper.make_node("Add", ["t", "c"], ["y"]),
    ]
    model = _model(nodes, opsets={"": 17, "local": 1}, functions=[func])
    path = tmp_path / "m.onnx"
    convert_model_to_external_data(
        model, location="w.bin", size_threshold=0, convert_attribute=True
    )
    onnx.save(model, path)
    info = read_model(path)
    assert {r.tensor for r in info.external_refs} == {"cval", "fval"}
    assert set(info.external_refs) == _onnx_refs(path)
    assert info.op_types == {"Constant": 1, "local::AddConst": 1, "Add": 1}
    assert info.opsets == {"": 17, "local": 1}


def test_sparse_tensors() -> None:
    def sparse(name: str) -> onnx.SparseTensorProto:
        values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), name)
        indices = numpy_helper.from_array(np.array([0, 4], np.int64), name + "_idx")
        return helper.make_sparse_tensor(values, indices, [2, 3])

    model = _model(
        [
            helper.make_node("Constant", [], ["c"], sparse_value=sparse("sv")),
            helper.make_node("Add", ["x", "s"], ["t"]),
            helper.make_node("Add", ["t", "c"], ["y"]),
        ]
    )
    model.graph.sparse_initializer.append(sparse("s"))
    assert parse_model(model.SerializeToString()).external_refs == []

    for i, tensor in enumerate(
        [
            model.graph.sparse_initializer[0].values,
            model.graph.sparse_initializer[0].indices,
            model.graph.node[0].attribute[0].sparse_tensor.values,
        ]
    ):
        set_external_data(tensor, "w.bin", offset=100 * i, length=8, checksum=f"sum{i}")
    refs = parse_model(model.SerializeToString()).external_refs
    assert refs == [
        ExternalRef("sv", "w.bin", 200, 8, "sum2"),
        ExternalRef("s", "w.bin", 0, 8, "sum0"),
        ExternalRef("s_idx", "w.bin", 100, 8, "sum1"),
    ]


def test_external_data_without_offset() -> None:
    model = _small()
    set_external_data(model.graph.initializer[0], "w.bin")
    refs = parse_model(model.SerializeToString()).external_refs
    assert refs == [ExternalRef("w", "w.bin", None, None, None)]


def test_op_types_and_metadata() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"], domain="ai.onnx"),
        helper.make_node("Gelu", ["b"], ["c"], domain="com.microsoft"),
        helper.make_node("Identity", ["c"], ["y"]),
    ]
    model = _model(nodes, opsets={"": 17, "com.microsoft": 1})
    helper.set_model_props(model, {"k1": "v1", "k2": "ünïcode"})
    info = parse_model(model.SerializeToString())
    assert info.op_types == {"Relu": 2, "com.microsoft::Gelu": 1, "Identity": 1}
    assert info.node_count == 4
    assert info.metadata == {"k1": "v1", "k2": "ünïcode"}
    assert info.opsets == {"": 17, "com.microsoft": 1}


def test_epcontext_node() -> None:
    ctx = helper.make_node(
        "EPContext",
        ["x"],
        ["y"],
        name="ctx0",
        domain="com.microsoft",
        main_context=1,
        ep_cache_context="a_ctx_qnn.bin",
        embed_mode=0,
        source="qnn",
        blob=b"\xff\xfe\x00",
        scale=0.5,
        neg=-5,
        most_neg=-(2**63),
        ints=[1, 2],
    )
    model = _model([ctx], opsets={"": 17, "com.microsoft": 1})
    info = parse_model(model.SerializeToString())
    assert info.context_nodes == [
        ContextNode(
            "ctx0",
            "EPContext",
            "com.microsoft",
            {
                "main_context": 1,
                "ep_cache_context": "a_ctx_qnn.bin",
                "embed_mode": 0,
                "source": "qnn",
                "blob": b"\xff\xfe\x00",
                "scale": 0.5,
                "neg": -5,
                "most_neg": -(2**63),
            },
        )
    ]
    assert info.op_types == {"com.microsoft::EPContext": 1}


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ProtoError, match=r"^empty file$"):
        parse_model(b"")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ProtoError, match=r"^empty file$"):
        read_model(empty)
    with pytest.raises(ProtoError, match="truncated or corrupt protobuf at byte 0"):
        parse_model(b"\xff" * 50)
    with pytest.raises(ProtoError, match=r"^no graph in the model$"):
        parse_model(onnx.ModelProto(ir_version=8).SerializeToString())
    with pytest.raises(ProtoError, match="wrong wire type 2 for ModelProto field 1"):
        parse_model(b"\x0a\x01\x00")  # ir_version as a length-delimited field
    with pytest.raises(ProtoError, match="truncated or corrupt protobuf at byte 0"):
        parse_model(b"\x3a\x05\x00")  # graph of length 5 with 1 byte left
    with pytest.raises(ProtoError, match="invalid field number 0"):
        parse_model(b"\x00\x01")


def _rich() -> bytes:
    """A small model using every part of the reader: EPContext attributes, a subgraph
    with an external initializer, a sparse initializer, metadata."""
    sub = helper.make_graph(
        [helper.make_node("Identity", ["sw"], ["sy"])],
        "then",
        [],
        [helper.make_tensor_value_info("sy", FLOAT, [2])],
        initializer=[_weights("sw", 2)],
    )
    set_external_data(sub.initializer[0], "sub.bin", offset=0, length=8)
    nodes = [
        helper.make_node("If", ["c"], ["t"], then_branch=sub, else_branch=sub),
        helper.make_node(
            "EPContext", ["t"], ["y"], domain="com.microsoft", main_context=1, source="qnn", f=-1.5
        ),
    ]
    model = _model(nodes, [_weights("c", 1)], opsets={"": 17, "com.microsoft": 1})
    model.graph.sparse_initializer.append(
        helper.make_sparse_tensor(_weights("sv", 1), _weights("si", 1), [4])
    )
    helper.set_model_props(model, {"k": "v"})
    data: bytes = model.SerializeToString()
    return data


@pytest.mark.parametrize("data", [_small().SerializeToString(), _rich()], ids=["small", "rich"])
def test_truncated_at_every_byte(data: bytes) -> None:
    full = parse_model(data)
    for n in range(len(data)):
        try:
            info = parse_model(data[:n])
        except ProtoError:
            continue
        assert info.node_count <= full.node_count


def test_rich_model() -> None:
    info = parse_model(_rich())
    assert [r.tensor for r in info.external_refs] == ["sw", "sw"]
    assert info.context_nodes[0].attributes == {"main_context": 1, "source": "qnn", "f": -1.5}


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_proto_error(data: bytes) -> None:
    try:
        parse_model(data)
    except ProtoError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_model_only_raises_proto_error(data: st.DataObject) -> None:
    raw = bytearray(_rich())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        parse_model(bytes(raw))
    except ProtoError:
        pass


def _len_field(field: int, payload: bytes) -> bytes:
    assert len(payload) < 1 << 14
    n = len(payload)
    size = bytes([n]) if n < 0x80 else bytes([n & 0x7F | 0x80, n >> 7])
    return bytes([field << 3 | 2]) + size + payload


def test_deep_nesting_is_a_proto_error() -> None:
    # Too deep for protobuf itself to build, so written by hand: graph.node.attribute.g ...
    graph = b""
    for _ in range(100):
        graph = _len_field(1, _len_field(5, _len_field(6, graph)))
    with pytest.raises(ProtoError, match="nested more than"):
        parse_model(_len_field(7, graph))


@pytest.mark.parametrize("path", LIGHT, ids=[p.stem for p in LIGHT])
def test_light_model_zoo(path: Path) -> None:
    model = onnx.load(path)
    info = read_model(path)
    assert info.node_count == len(model.graph.node)
    assert info.op_types == dict(collections.Counter(n.op_type for n in model.graph.node))
    assert info.ir_version == model.ir_version
    assert info.opsets == {o.domain: o.version for o in model.opset_import}
    assert info.external_refs == []


def test_does_not_import_onnx() -> None:
    code = (
        "import sys, epbuild.onnx.proto; "
        "bad = [m for m in ('onnx', 'onnxruntime', 'google.protobuf') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=waits.scaled(120))


# ---------------------------------------------------------------------------------------
# External-data references alone (what a model's key reads)


def _if_model() -> onnx.ModelProto:
    """An If whose branches have initializers of their own."""

    def branch(name: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node("Add", ["x", f"{name}_w"], [f"{name}_y"])],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_y", FLOAT, [2, 3])],
            initializer=[_weights(f"{name}_w", 2, 3)],
        )

    cond = numpy_helper.from_array(np.array(True), "cond")
    node = helper.make_node(
        "If", ["cond"], ["y"], then_branch=branch("then"), else_branch=branch("else")
    )
    return _model([node], [cond])


def _function_model() -> onnx.ModelProto:
    """A Constant's tensor in the graph and one in a local function."""
    func = helper.make_function(
        "local",
        "AddConst",
        ["a"],
        ["b"],
        [
            helper.make_node("Constant", [], ["k"], value=_weights("fval", 2, 3)),
            helper.make_node("Add", ["a", "k"], ["b"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    nodes = [
        helper.make_node("Constant", [], ["c"], value=_weights("cval", 2, 3)),
        helper.make_node("AddConst", ["x"], ["t"], domain="local"),
        helper.make_node("Add", ["t", "c"], ["y"]),
    ]
    return _model(nodes, opsets={"": 17, "local": 1}, functions=[func])


@pytest.fixture(name="external_models")
def _external_models(tmp_path: Path) -> list[Path]:
    """Models with external data where each part of the reader finds it: initializers,
    subgraph initializers, a Constant's and a function's tensors, sparse tensors, a torch
    CNN's weights, a dynamo export's; and one that says "location" with none."""
    named = _model([helper.make_node("Relu", ["x"], ["y"], name="location")])
    for name, model in (("small", _small()), ("if", _if_model()), ("named", named)):
        _save_external(model, tmp_path / f"{name}.onnx")
    func = _function_model()
    convert_model_to_external_data(func, location="w.bin", size_threshold=0, convert_attribute=True)
    onnx.save(func, tmp_path / "func.onnx")
    cnn = onnx.load(CORPUS_DIR / "cnn_torchscript.onnx")
    onnx.save(
        cnn,
        tmp_path / "cnn.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="cnn.data",
        size_threshold=0,
    )
    (tmp_path / "rich.onnx").write_bytes(_rich())
    names = ("small", "if", "named", "func", "cnn", "rich")
    return [*(tmp_path / f"{n}.onnx" for n in names), CORPUS_DIR / "llama_dynamo_external.onnx"]


def test_external_refs_are_the_full_readers(external_models: list[Path]) -> None:
    """The same references in the same order as `read_model`, also read in pages."""
    for path in [*LIGHT, *CORPUS, *external_models]:
        refs = read_external_refs(path)
        assert refs == read_model(path).external_refs, path
        assert parse_external_refs(path.read_bytes()) == refs, path
    found = {p.stem: read_external_refs(p) for p in external_models}
    assert [r.tensor for r in found["small"]] == ["w"]
    assert [r.tensor for r in found["if"]] == ["else_w", "then_w", "cond"]  # nodes first
    assert found["named"] == []
    assert [r.tensor for r in found["func"]] == ["cval", "fval"]
    assert [r.tensor for r in found["rich"]] == ["sw", "sw"]
    cnn = onnx.load(CORPUS_DIR / "cnn_torchscript.onnx")
    assert len(found["cnn"]) == len(list(_get_all_tensors(cnn))) > 4
    assert {r.location for r in found["cnn"]} == {"cnn.data"}
    assert set(found["cnn"]) == _onnx_refs(external_models[4])
    assert len(found["llama_dynamo_external"]) == 16


def test_external_refs_paged(external_models: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proto, "_PAGED_MIN", 0)
    monkeypatch.setattr(proto, "_PAGE_BITS", 8)
    for path in [*CORPUS, *external_models]:
        assert read_external_refs(path) == read_model(path).external_refs, path


def test_external_refs_of_inline_tensors() -> None:
    """Inline weights, with or without "location" written elsewhere: none."""
    for model in (_small(), _if_model(), _function_model()):
        assert parse_external_refs(model.SerializeToString()) == []
        model.doc_string = "location"
        model.graph.node[0].name = "location"
        for tensor in model.graph.initializer:
            tensor.doc_string = "location"
        assert parse_external_refs(model.SerializeToString()) == []


def test_external_refs_beside_location_elsewhere() -> None:
    """A reference is found where "location" is also written elsewhere (a node's name)."""
    model = _small()
    model.graph.node[1].name = "location"
    set_external_data(model.graph.initializer[0], "w.bin", offset=0, length=24)
    assert parse_external_refs(model.SerializeToString()) == [
        ExternalRef("w", "w.bin", 0, 24, None)
    ]


def test_external_data_entries_of_any_length_and_order() -> None:
    """Entries with long texts (lengths of two bytes), a value before its key, repeated
    keys: the last one counts."""
    model = _small()
    tensor = model.graph.initializer[0]
    long = "d/" * 100 + "w.bin"
    set_external_data(tensor, long, offset=0, length=24, checksum="c" * 300)
    entry = tensor.external_data.add()
    entry.key, entry.value = "length", "16"
    data = model.SerializeToString()
    expect = [ExternalRef("w", long, 0, 16, "c" * 300)]
    assert parse_model(data).external_refs == parse_external_refs(data) == expect
    value_first = b"\x12\x05w.bin\x0a\x08location"  # field 2, then field 1
    raw = _small().graph.initializer[0].SerializeToString()
    tensor.ParseFromString(raw + _len_field(13, value_first) + b"\x70\x01")
    assert tensor.external_data[0].key == "location"  # onnx reads it so too
    data = model.SerializeToString()
    expect = [ExternalRef("w", "w.bin", None, None, None)]
    assert parse_model(data).external_refs == parse_external_refs(data) == expect


def test_external_refs_errors(tmp_path: Path) -> None:
    with pytest.raises(ProtoError, match=r"^empty file$"):
        parse_external_refs(b"")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ProtoError, match=r"^empty file$"):
        read_external_refs(empty)
    with pytest.raises(ProtoError, match="truncated or corrupt protobuf at byte 0"):
        parse_external_refs(b"\xff" * 50)
    with pytest.raises(ProtoError, match=r"^no graph in the model$"):
        parse_external_refs(onnx.ModelProto(ir_version=8).SerializeToString())
    with pytest.raises(ProtoError, match="wrong wire type 2 for ModelProto field 1"):
        parse_external_refs(b"\x0a\x01\x00")
    with pytest.raises(ProtoError, match="truncated or corrupt protobuf at byte 0"):
        parse_external_refs(b"\x3a\x05\x00")
    with pytest.raises(ProtoError, match="invalid field number 0"):
        parse_external_refs(b"\x00\x01")
    model = _small()
    set_external_data(model.graph.initializer[0], "w.bin", offset=0, length=24)
    model.graph.initializer[0].external_data[1].value = "zero"
    with pytest.raises(ProtoError, match="offset is not an integer: 'zero'"):
        parse_external_refs(model.SerializeToString())


@pytest.mark.parametrize("data", [_small().SerializeToString(), _rich()], ids=["small", "rich"])
def test_external_refs_truncated_at_every_byte(data: bytes) -> None:
    """A model cut short is a `ProtoError`, or (cut between two of the model's own fields)
    reads as far as it goes."""
    full = parse_external_refs(data)
    for n in range(len(data)):
        try:
            refs = parse_external_refs(data[:n])
        except ProtoError:
            continue
        assert refs == full[: len(refs)]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_model_external_refs_only_raise_proto_error(data: st.DataObject) -> None:
    raw = bytearray(_rich())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        parse_external_refs(bytes(raw))
    except ProtoError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_external_refs_only_raise_proto_error(data: bytes) -> None:
    try:
        parse_external_refs(data)
    except ProtoError:
        pass
