"""Weight-sharing groups: one shared context binary per group, and QNN spill-fill sizes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild.api import Outcome
from epbuild.inspection.verify import verify_outputs
from epbuild.onnx.context import sharing_problems
from epbuild.onnx.proto import read_model
from epbuild.providers import get_provider
from epbuild.providers.base import ProviderConfig

QNN = ProviderConfig("htp", "qnn", HTP73["options"])
IGNORED = "apparently ignored ep.share_ep_contexts; this group would not share weights"


def _ctx(ref: str | None, embed_mode: int = 0, max_size: int | None = None) -> onnx.ModelProto:
    """A one-node ctx model whose main EPContext node references ``ref``."""
    from onnx import TensorProto, helper

    attrs: dict[str, Any] = {"embed_mode": embed_mode, "main_context": 1, "source": "qnn"}
    if ref is not None:
        attrs["ep_cache_context"] = ref
    if max_size is not None:
        attrs["max_size"] = max_size
    node = helper.make_node("EPContext", ["x"], ["y"], domain="com.microsoft", name="n", **attrs)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("x", "y")]
    graph = helper.make_graph([node], "g", io[:1], io[1:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("com.microsoft", 1)])


def _problems(tmp_path: Path, models: dict[str, onnx.ModelProto]) -> list[str]:
    for name, model in models.items():
        onnx.save(model, tmp_path / name)
    infos = [read_model(tmp_path / name) for name in models]
    found = sharing_problems([f"out/{n}" for n in models], infos, get_provider("qnn"), QNN)
    return [p.line() for p in found]


# ---------------------------------------------------------------------------------------
# The rule on its own


def test_one_shared_binary_passes(tmp_path: Path) -> None:
    models = {"a_ctx.onnx": _ctx("a_ctx_qnn.bin"), "b_ctx.onnx": _ctx("./a_ctx_qnn.bin")}
    assert _problems(tmp_path, models) == []


def test_an_unusable_path_is_left_to_the_reference_rule(tmp_path: Path) -> None:
    models = {"a_ctx.onnx": _ctx("a_ctx_qnn.bin"), "b_ctx.onnx": _ctx("/w/out/a_ctx_qnn.bin")}
    assert _problems(tmp_path, models) == []  # reported once, by embed_problems


def test_a_binary_per_model_is_refused(tmp_path: Path) -> None:
    models = {n: _ctx(f"{n[0]}_ctx_qnn.bin") for n in ("a_ctx.onnx", "b_ctx.onnx", "c_ctx.onnx")}
    found = _problems(tmp_path, models)
    assert [line.split(":", 1)[0] for line in found] == ["out/b_ctx.onnx", "out/c_ctx.onnx"]
    assert found[0].startswith(
        "out/b_ctx.onnx: ep_cache_context: references 'b_ctx_qnn.bin', not the group's shared "
        "binary 'a_ctx_qnn.bin': its 3 ctx models reference 3 context binaries "
    )
    assert IGNORED in found[0] and "The qnn EP (onnxruntime " in found[0]


@pytest.mark.parametrize(
    "model", [_ctx(None), _ctx("x", embed_mode=1)], ids=["no-reference", "embedded"]
)
def test_a_model_without_a_reference_is_refused(tmp_path: Path, model: onnx.ModelProto) -> None:
    found = _problems(tmp_path, {"a_ctx.onnx": _ctx("a_ctx_qnn.bin"), "b_ctx.onnx": model})
    assert found == [
        "out/b_ctx.onnx: ep_cache_context: no main EPContext node references a context binary "
        "(embed_mode 0 ep_cache_context); every ctx model of a weight-sharing group references "
        "the group's one shared binary"
    ]


# ---------------------------------------------------------------------------------------
# The rule in a real build, in the coordinator's staging check, and in verify


def test_real_sharing_group_passes(simple_built: Workspace) -> None:
    ws = simple_built
    out = ws.root / "build" / "pair" / "htp"
    files = [f"build/pair/htp/{n}" for n in ("a_ctx.onnx", "b_ctx.onnx")]
    infos = [read_model(ws.root / f) for f in files]
    assert sharing_problems(files, infos, get_provider("qnn"), QNN) == []
    assert sorted(p.name for p in out.iterdir()) == ["a_ctx.onnx", "a_ctx_qnn.bin", "b_ctx.onnx"]


def test_ep_ignoring_share_ep_contexts_fails_the_action(
    simple_ws: Callable[..., Workspace], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker leaves the sharing entries out (as an EP that ignores them would): each
    model gets its own binary, and the action fails saying why; the rest builds."""
    ws = simple_ws()
    monkeypatch.setenv("EPBUILD_TEST_HOOK", "noshare:models/")
    result = ws.build(keep_going=True)
    actions = {a.id: a for a in result.actions}
    assert actions["single/htp/c"].outcome is Outcome.COMPILED
    failed = actions["pair/htp"]
    assert failed.outcome is Outcome.FAILED and failed.error is not None
    assert failed.error.startswith("b_ctx.onnx: ep_cache_context: references 'b_ctx_qnn.bin'")
    assert IGNORED in failed.error and "share_weights = false" in (failed.hint or "")
    assert not (ws.root / "build" / "pair").exists()


def test_staging_check_refuses_two_binaries(simple_built: Workspace, tmp_path: Path) -> None:
    """The coordinator holds the rule whatever the worker said (a farm worker, a cache)."""
    from epbuild.errors import VerificationError
    from epbuild.onnx.staged import check_staged

    ws = simple_built
    staging = ws.root / "build" / ".staging" / "pair-1"
    shutil.copytree(ws.root / "build" / "pair" / "htp", staging)
    shutil.copyfile(staging / "a_ctx_qnn.bin", staging / "b_ctx_qnn.bin")
    model = onnx.load(str(staging / "b_ctx.onnx"))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "ep_cache_context":
                attr.s = b"b_ctx_qnn.bin"
    onnx.save(model, str(staging / "b_ctx.onnx"))
    names = ("a_ctx.onnx", "b_ctx.onnx")
    rel = "build/.staging/pair-1"
    assert "b_ctx_qnn.bin" in check_staged(str(ws.root), rel, names)[0]  # only sharing breaks
    with pytest.raises(VerificationError, match=IGNORED) as err:
        check_staged(str(ws.root), rel, names, shared_by=QNN)
    assert err.value.message.startswith("b_ctx.onnx: ep_cache_context: references")


# The verify side lives in test_verify.py (test_sharing_group_with_two_binaries).


# ---------------------------------------------------------------------------------------
# QNN spill-fill buffers: every ctx model of a group carries the group's max_size


def _main_max_sizes(ctx: Path) -> list[int]:
    nodes = read_model(ctx).context_nodes
    return [int(n.attributes["max_size"]) for n in nodes if n.attributes["main_context"] == 1]


def test_spill_fill_size_is_aligned_across_the_group(workspace: Workspace) -> None:
    """The middle model needs a spill-fill buffer (4096 × 512 activations); the EP writes
    0 into the first ctx model, which epbuild raises to the group's size."""
    import numpy as np

    w = np.random.default_rng(5).standard_normal((512, 512), dtype=np.float32) * 0.05
    for i, batch in enumerate((1, 4096, 8)):
        workspace.model(f"m/s{i}.onnx", matmul_model(i, n=512, shared=w, batch=batch))
    spill = {"ep": "qnn", "options": {**HTP73["options"], "enable_htp_spill_fill_buffer": True}}
    workspace.manifest({"providers": {"spill": spill}, "groups": {
        "g": {"models": ["m/s0.onnx", "m/s1.onnx", "m/s2.onnx"], "providers": ["spill"],
              "share_weights": True},
        "alone": {"models": ["m/s0.onnx"], "providers": ["spill"]}}})  # fmt: skip
    result = workspace.build()
    assert result.ok, [a.error for a in result.actions]
    out = workspace.root / "build"
    assert _main_max_sizes(out / "alone/spill/s0_ctx.onnx") == [0]  # what the EP writes
    sizes = [_main_max_sizes(out / f"g/spill/s{i}_ctx.onnx") for i in range(3)]
    assert sizes[2][0] > 0 and sizes == [sizes[2]] * 3
    assert verify_outputs(workspace.root).ok
    # The rewrite is in the key of the group (built before it existed: rebuilt), only there.
    from epbuild.state.journal import load_state

    records = load_state(str(workspace.root / ".epbuild" / "state.jsonl")).records
    assert records["g/spill"].components["group"]["rewrite"].startswith("spill-fill")
    assert "rewrite" not in records["alone/spill/s0"].components["group"]


def test_align_spill_fill_size_rewrites_earlier_models(tmp_path: Path) -> None:
    from epbuild.providers.qnn import align_spill_fill_size

    paths = [tmp_path / f"{n}_ctx.onnx" for n in "abcd"]
    for path, size in zip(paths, (0, None, 8192, 8192), strict=True):
        onnx.save(_ctx("a_ctx_qnn.bin", max_size=size), path)
    inodes = [p.stat().st_ino for p in paths]
    assert align_spill_fill_size([str(p) for p in paths]) == 8192
    assert [_main_max_sizes(p) for p in paths] == [[8192]] * 4
    after = [p.stat().st_ino for p in paths]
    assert after[0] != inodes[0] and after[2:] == inodes[2:]  # renamed over; equal: untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]  # no temp file


def test_spill_fill_alignment_needs_the_option(tmp_path: Path) -> None:
    """Like ONNX Runtime's tool: only with ``enable_htp_spill_fill_buffer = 1``."""
    paths = [tmp_path / f"{n}_ctx.onnx" for n in "ab"]
    for path, size in zip(paths, (0, 4096), strict=True):
        onnx.save(_ctx("a_ctx_qnn.bin", max_size=size), path)
    adapter: Any = get_provider("qnn")
    adapter.finish_sharing_group(QNN, [str(p) for p in paths])
    assert _main_max_sizes(paths[0]) == [0]
    spill = ProviderConfig("s", "qnn", {**QNN.options, "enable_htp_spill_fill_buffer": "1"})
    adapter.finish_sharing_group(spill, [str(p) for p in paths])
    assert _main_max_sizes(paths[0]) == [4096]


@pytest.mark.parametrize("size", [None, 0, 300, 1 << 40])
def test_the_wire_rewrite_equals_the_onnx_edit(size: int | None) -> None:
    """epbuild's own writer gives the model onnx would: the attribute set (or added where a
    protobuf writer puts it), every other field as it was; other nodes untouched."""
    from epbuild.onnx.rewrite import set_context_int

    model = _ctx("a_ctx_qnn.bin", max_size=size)
    other = onnx.helper.make_node("EPContext", ["y"], ["z"], domain="com.microsoft",
                                  main_context=0, max_size=5)  # fmt: skip
    model.graph.node.append(other)
    model.doc_string = "kept"
    data = model.SerializeToString()
    got = set_context_int(data, "max_size", 4096)
    want = onnx.ModelProto()
    want.CopyFrom(model)
    attrs = want.graph.node[0].attribute
    found = [a for a in attrs if a.name == "max_size"]
    if found:
        found[0].i = 4096
    else:
        attrs.append(onnx.helper.make_attribute("max_size", 4096))
    assert got == want.SerializeToString()
    assert set_context_int(got, "max_size", 4096) is None  # nothing left to change


def test_spill_fill_alignment_runs_without_onnx(tmp_path: Path) -> None:
    """A toolchain's worker has ONNX Runtime and the EP, not the onnx package."""
    paths = [tmp_path / f"{n}_ctx.onnx" for n in "ab"]
    for path, size in zip(paths, (0, 4096), strict=True):
        onnx.save(_ctx("a_ctx_qnn.bin", max_size=size), path)
    code = (
        "import sys; sys.modules['onnx'] = None\n"
        "from epbuild.providers.qnn import align_spill_fill_size\n"
        f"print(align_spill_fill_size({[str(p) for p in paths]!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "4096", proc.stderr
    assert _main_max_sizes(paths[0]) == [4096]
