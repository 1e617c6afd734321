"""Absolute paths in outputs: caught where a path can be written, never found by chance.

A context binary or an initializer holds any short byte string somewhere; a workspace at a
short root (``/w``) must still build. A real leak — a text field of a ctx model holding a
path of the build machine — fails, naming the file and the field (tests/test_leak_rule.py
has the rule's other cases).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace
from onnx import helper, numpy_helper
from test_options import mod_model

from epbuild.engine.staging import hash_staged
from epbuild.errors import VerificationError
from epbuild.inspection.verify import verify_outputs
from epbuild.onnx.context import LONG_PATH_MIN, Severity, absolute_paths, scan_needles
from epbuild.onnx.staged import check_staged


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("/w", ["/w"]),
        ("built from /home/ci/ws/m.onnx today", ["/home/ci/ws/m.onnx"]),
        ('"/srv/x"', ["/srv/x"]),
        ("at (/src/model.py:12)", ["/src/model.py:12"]),
        ("C:\\Users\\me\\m.onnx", ["C:\\Users\\me\\m.onnx"]),
        ("\\\\server\\share\\m.onnx", ["\\\\server\\share\\m.onnx"]),
        ("file:///opt/m.onnx", ["file:///opt/m.onnx"]),
        ("N/A", []),
        ("1/2 of the batch", []),
        ("a / b", []),
        ("https://github.com/onnx/onnx", []),
        ("qnn_qnn_14445237120030626993_1_0", []),
        ("v2:6:2.51.0:5.51.0:73:60:0:0", []),
        ("/", []),
    ],
)
def test_absolute_paths(text: str, found: list[str]) -> None:
    assert absolute_paths(text) == found


@pytest.fixture
def short_root() -> Iterator[Path]:
    """A workspace root whose path is too short to be scanned for in opaque bytes."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    root = Path(tempfile.mkdtemp(prefix="w", dir=base))
    try:
        if len(os.path.realpath(root)) + 1 >= LONG_PATH_MIN:
            pytest.skip(f"no short temp directory here ({root})")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _holding(data: bytes, size: int) -> np.ndarray:
    """``size`` float32 values whose bytes hold ``data``."""
    raw = (data * (4 * size // len(data) + 1))[: 4 * size]
    return np.frombuffer(raw, dtype=np.float32).copy()


def test_short_root_builds_though_outputs_hold_its_bytes(short_root: Path) -> None:
    ws = Workspace(short_root)
    model = mod_model(3)
    needle = (os.path.realpath(short_root) + os.sep).encode()
    # Mod and its initializer M stay on the CPU EP: M's bytes go verbatim into the ctx model.
    m = next(i for i in model.graph.initializer if i.name == "M")
    m.CopyFrom(numpy_helper.from_array(_holding(needle, 32), "M"))
    model.graph.node[2].doc_string = "torch/nn/functional.py: /opt/torch/nn/functional.py(12)"
    helper.set_model_props(model, {"exported_from": f"{short_root}/export.py"})
    ws.model("m/p.onnx", model)
    ws.manifest({"providers": {"htp": HTP73}, "groups": {"p": {"models": ["m/p.onnx"],
                 "providers": ["htp"]}}})  # fmt: skip
    result = ws.build()
    assert result.ok, [a.error for a in result.actions]
    ctx = short_root / "build/p/htp/p_ctx.onnx"
    assert needle in ctx.read_bytes()  # the chance bytes are really there
    # What the ctx model kept from the source is said, not failed.
    warnings = [w for a in result.actions for w in a.warnings]
    assert any("kept from m/p.onnx" in w and "p_ctx.onnx" in w for w in warnings), warnings
    checked = verify_outputs(short_root)
    assert checked.ok, checked.lines()
    kept = [p for p in checked.problems if p.severity is Severity.WARNING]
    assert kept and all(p.file == "build/p/htp/p_ctx.onnx" for p in kept)


def _ctx_model(cache: str = "a_ctx_qnn.bin", **attrs: object) -> onnx.ModelProto:
    node = helper.make_node(
        "EPContext", ["x"], ["y"], "ctx_0", domain="com.microsoft",
        main_context=1, embed_mode=0, ep_cache_context=cache, source="qnn", **attrs,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _stage(root: Path, model: onnx.ModelProto, binary: bytes) -> str:
    staging = root / "build" / ".staging" / "x-1"
    staging.mkdir(parents=True)
    onnx.save(model, str(staging / "a_ctx.onnx"))
    (staging / "a_ctx_qnn.bin").write_bytes(binary)
    return "build/.staging/x-1"


def test_chance_bytes_in_a_context_binary_pass(short_root: Path) -> None:
    needle = (os.path.realpath(short_root) + os.sep).encode()
    binary = os.urandom(1000) + needle + b"models/a.onnx\0" + os.urandom(1000)
    model = _ctx_model()
    model.graph.initializer.append(numpy_helper.from_array(_holding(needle, 64), "chance"))
    staging = _stage(short_root, model, binary)
    names, warnings = check_staged(str(short_root), staging, ("a_ctx.onnx",))
    assert not warnings
    records = hash_staged(str(short_root), staging, "build/g/p", names)
    assert records["build/g/p/a_ctx_qnn.bin"].size == len(binary)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m, ws: m.graph.node[0].attribute.append(
            helper.make_attribute("notes", f"compiled from {ws}/a.onnx")), "notes"),
        (lambda m, ws: m.graph.node[0].attribute.append(
            helper.make_attribute("onnx_model_filename", "/home/ci/ws/a.onnx")),
         "onnx_model_filename"),
        (lambda m, ws: helper.set_model_props(m, {"origin": f"{ws}/a.onnx"}),
         "metadata_props['origin']"),
        (lambda m, ws: setattr(m.graph, "doc_string", os.path.expanduser("~/ws/a.onnx")),
         "doc_string"),
        (lambda m, ws: m.graph.node[0].attribute.append(
            helper.make_attribute("onnx_model_filename", "../../a.onnx")),
         "onnx_model_filename"),
    ],
)  # fmt: skip
def test_a_path_in_a_text_field_fails_naming_file_and_field(
    tmp_path: Path, change: object, field: str
) -> None:
    model = _ctx_model()
    change(model, tmp_path)  # type: ignore[operator]
    staging = _stage(tmp_path, model, b"binary")
    with pytest.raises(VerificationError, match=r"a_ctx\.onnx: .*" + field.replace("[", r"\[")):
        check_staged(str(tmp_path), staging, ("a_ctx.onnx",))


def test_a_long_workspace_path_in_a_binary_is_still_refused(tmp_path: Path) -> None:
    needle = (os.path.realpath(tmp_path) + os.sep).encode()
    assert needle in scan_needles(str(tmp_path))
    binary = b"\0" * ((3 << 20) - 5) + needle + b"models/a.onnx"  # across a read boundary
    staging = _stage(tmp_path, _ctx_model(), binary)
    names, _ = check_staged(str(tmp_path), staging, ("a_ctx.onnx",))
    with pytest.raises(VerificationError, match=r"a_ctx_qnn\.bin: contains the absolute"):
        hash_staged(str(tmp_path), staging, "build/g/p", names)


def test_external_data_checksum_is_checked_in_pieces(tmp_path: Path) -> None:
    import hashlib

    from epbuild.onnx.context import external_data_problems
    from epbuild.onnx.proto import ExternalRef, ModelInfo

    data = os.urandom((2 << 20) + 123)  # over two read pieces
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "w.bin").write_bytes(data)
    part = hashlib.sha1(data[1000 : 1000 + (1 << 20)]).hexdigest()
    whole = hashlib.sha1(data).hexdigest()

    def problems(checksum: str) -> list[str]:
        ref = ExternalRef("t", "w.bin", 1000, 1 << 20, checksum)
        info = ModelInfo(9, {}, [ref], [], {}, {}, 0)
        return [p.line() for p in external_data_problems(str(tmp_path), "out/a.onnx", info, "out")]

    assert problems(part) == [] and problems(whole) == []
    assert problems("0" * 40) == ["out/a.onnx: tensor t: checksum: SHA1 of 'w.bin' does not match"]


@pytest.mark.parametrize(
    "value",
    ["", "a", "a/b.onnx", "/abs", "C:x", "c:", "a\\b", "a\x00b", "..", "../a", "a/../b", "a/..",
     "a..b", "..a/b", "a/b..", "./a", "a//b", ":a", "é/ü.bin", "a/.../b"],
)  # fmt: skip
def test_is_safe_reference_is_reference_problem_finding_nothing(value: str) -> None:
    from epbuild.fs import is_safe_reference, reference_problem

    assert is_safe_reference(value) == (reference_problem(value) is None)
