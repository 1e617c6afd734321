"""End-to-end builds with the real QNN EP: incrementality, weight sharing, relocatability."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import HTP73, HTP75, Workspace
from modelgen import matmul_model, unsupported_model

from epbuild.api import Outcome
from epbuild.onnx.proto import read_model


def outcomes(result) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {a.id: a.outcome.value for a in result.actions}


def test_first_build_then_noop(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    first = ws.build()
    assert outcomes(first) == {"pair/htp": "compiled", "single/htp/c": "compiled"}
    out = ws.root / "build"
    assert sorted(p.name for p in (out / "pair" / "htp").iterdir()) == [
        "a_ctx.onnx", "a_ctx_qnn.bin", "b_ctx.onnx"]  # fmt: skip
    second = ws.build()
    assert second.count(Outcome.UP_TO_DATE) == 2 and second.count(Outcome.COMPILED) == 0


def test_sharing_group_references_one_bin(simple_built: Workspace) -> None:
    ws = simple_built
    d = ws.root / "build" / "pair" / "htp"
    refs = set()
    for ctx in ("a_ctx.onnx", "b_ctx.onnx"):
        nodes = read_model(d / ctx).context_nodes
        assert nodes and all(n.attributes["source"] == "QNNExecutionProvider" for n in nodes)
        refs |= {
            n.attributes["ep_cache_context"] for n in nodes if n.attributes["main_context"] == 1
        }
    assert refs == {"a_ctx_qnn.bin"}


def test_three_model_sharing_group(workspace: Workspace) -> None:
    import numpy as np

    w = np.random.default_rng(3).standard_normal((32, 32), dtype=np.float32)
    for i, name in enumerate("xyz"):
        workspace.model(f"m/{name}.onnx", matmul_model(i, shared=w, batch=i + 1))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/*.onnx"], "providers": ["htp"], "share_weights": True}}})  # fmt: skip
    result = workspace.build()
    assert result.ok, result.actions[0].error
    files = sorted(p.name for p in (workspace.root / "build" / "g" / "htp").iterdir())
    assert files == ["x_ctx.onnx", "x_ctx_qnn.bin", "y_ctx.onnx", "z_ctx.onnx"]


def test_touch_rebuilds_nothing_and_rehashes_once(simple_built: Workspace) -> None:
    from epbuild.planning.staleness import make_plan
    from epbuild.planning.workspace import open_workspace

    ws = simple_built
    for p in (ws.root / "models").iterdir():
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - 5_000_000_000))
    result = ws.build()
    assert result.count(Outcome.COMPILED) == 0 and result.count(Outcome.UP_TO_DATE) == 2
    w = open_workspace(ws.root)
    plans = make_plan(w.actions, w.state, w.keys, w.stats, w.root)
    assert not any(p.stale for p in plans)
    assert w.stats.hashed == 0, "an untouched-since-last-run input was re-hashed"


def test_changed_model_rebuilds_exactly_its_actions(simple_built: Workspace) -> None:
    ws = simple_built
    ws.model("models/b.onnx", matmul_model(99, batch=4))  # b is in the sharing group
    status = {a.id: a for a in ws.build(dry_run=True).actions}
    assert status["pair/htp"].outcome is Outcome.WOULD_BUILD
    assert status["pair/htp"].reasons == ["model models/b.onnx changed"]
    assert status["single/htp/c"].outcome is Outcome.UP_TO_DATE
    assert outcomes(ws.build()) == {"pair/htp": "compiled", "single/htp/c": "up_to_date"}


def test_changed_option_rebuilds_that_provider(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    data = {"providers": {"v73": HTP73, "v75": HTP75},
            "groups": {"g": {"models": ["m/a.onnx"], "providers": ["v73", "v75"]}}}  # fmt: skip
    workspace.manifest(data)
    assert workspace.build().count(Outcome.COMPILED) == 2
    data["providers"]["v75"] = {"ep": "qnn", "options": {"htp_arch": "75", "soc_model": "57",
                                                         "vtcm_mb": 4}}  # fmt: skip
    workspace.manifest(data)
    result = workspace.build()
    assert outcomes(result) == {"g/v73/a": "up_to_date", "g/v75/a": "compiled"}
    assert result.actions[1].reasons == ['provider option vtcm_mb: unset → "4"']


def test_version_change_stales_everything(simple_built: Workspace,
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from epbuild import api
    from epbuild.providers import qnn

    ws = simple_built
    real = qnn.dist_version
    monkeypatch.setattr(qnn, "dist_version",
                        lambda d: "9.9.9" if d == "onnxruntime-qnn" else real(d))  # fmt: skip
    plans = api.status(ws.root).actions
    assert all(p.stale for p in plans)
    assert all(any("onnxruntime-qnn 2." in r and "→ 9.9.9" in r for r in p.reasons) for p in plans)


@pytest.mark.slow
def test_outputs_identical_across_workspace_paths(simple_ws: Callable[..., Workspace],
                                                  tmp_path: Path) -> None:  # fmt: skip
    ws = simple_ws()
    other = tmp_path / "elsewhere" / "deeper" / "copy"
    shutil.copytree(ws.root, other)
    ws.build()
    Workspace(other).build()
    a = {
        p.relative_to(ws.root / "build"): p.read_bytes()
        for p in (ws.root / "build").rglob("*")
        if p.is_file()
    }
    b = {
        p.relative_to(other / "build"): p.read_bytes()
        for p in (other / "build").rglob("*")
        if p.is_file()
    }
    assert a.keys() == b.keys() and len(a) == 5
    assert a == b
    for data in a.values():
        assert str(ws.root).encode() not in data and str(tmp_path).encode() not in data


@pytest.mark.slow
def test_moved_output_dir_stays_valid(simple_built: Workspace, tmp_path: Path) -> None:
    ws = simple_built
    moved = tmp_path / "moved"
    shutil.move(str(ws.root / "build"), moved)
    for ctx in moved.rglob("*_ctx.onnx"):
        info = read_model(ctx)
        for n in info.context_nodes:
            if n.attributes.get("main_context") == 1:
                ref = str(n.attributes["ep_cache_context"])
                assert not os.path.isabs(ref) and (ctx.parent / ref).is_file()
    # the build notices the outputs are gone and rebuilds them
    assert ws.build().count(Outcome.COMPILED) == 2


def test_modified_output_is_rebuilt(simple_built: Workspace) -> None:
    ws = simple_built
    bin_path = ws.root / "build" / "single" / "htp" / "c_ctx_qnn.bin"
    data = bytearray(bin_path.read_bytes())
    data[100] ^= 0xFF
    bin_path.write_bytes(bytes(data))
    result = ws.build(dry_run=True)
    reasons = {a.id: a.reasons for a in result.actions}
    assert reasons["single/htp/c"] == ["output build/single/htp/c_ctx_qnn.bin was modified"]


def test_no_context_node_fails_clearly(workspace: Workspace) -> None:
    workspace.model("m/bad.onnx", unsupported_model())
    workspace.model("m/good.onnx")
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/bad.onnx", "m/good.onnx"], "providers": ["htp"]}}})  # fmt: skip
    result = workspace.build(keep_going=True, jobs=1)
    by_id = {a.id: a for a in result.actions}
    assert by_id["g/htp/bad"].outcome is Outcome.FAILED
    assert "no EPContext model was written" in (by_id["g/htp/bad"].error or "")
    assert by_id["g/htp/good"].outcome is Outcome.COMPILED
    assert not (workspace.root / "build" / "g" / "htp" / "bad_ctx.onnx").exists()
    assert not list((workspace.root / "build").rglob(".staging/*"))


@pytest.mark.slow
def test_cli_json_and_exit_codes(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    doc = ws.cli_json("build")
    assert doc["summary"]["compiled"] == 2 and doc["summary"]["failed"] == 0
    first = doc["actions"][0]
    assert set(first) >= {"id", "group", "provider", "outcome", "seconds", "outputs", "reasons"}
    assert all(not o.startswith("/") and o.startswith("build/") for o in first["outputs"])
    again = ws.cli_json("build")
    assert again["summary"]["compiled"] == 0 and again["summary"]["up_to_date"] == 2
    status = ws.cli_json("status")
    assert [a["stale"] for a in status["actions"]] == [False, False]
    (ws.root / "models" / "c.onnx").write_bytes(b"garbage")
    proc = ws.cli("build")
    assert proc.returncode == 1 and "c.onnx" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_clean_removes_outputs(simple_built: Workspace) -> None:
    ws = simple_built
    assert ws.cli("clean").returncode == 0
    assert not list((ws.root / "build").rglob("*.onnx"))
    assert (ws.root / "models" / "a.onnx").exists()
    assert ws.build().count(Outcome.COMPILED) == 2


@pytest.mark.slow
def test_outputs_of_removed_actions_are_reported_and_cleaned(
    simple_built: Workspace,
) -> None:
    ws = simple_built
    text = (ws.root / "epbuild.toml").read_text()
    single = text.index("[groups.single]")
    (ws.root / "epbuild.toml").write_text(text[:single])
    proc = ws.cli("status")
    assert "orphaned    single/htp/c" in proc.stdout
    assert (ws.root / "build" / "single" / "htp" / "c_ctx.onnx").exists()
    assert ws.cli("clean").returncode == 0
    assert not (ws.root / "build" / "single").exists()
    assert (ws.root / "models" / "c.onnx").exists()
    assert "orphaned" not in ws.cli("status").stdout


@pytest.mark.slow
def test_status_json_lists_orphaned_actions(simple_built: Workspace) -> None:
    ws = simple_built
    text = (ws.root / "epbuild.toml").read_text()
    (ws.root / "epbuild.toml").write_text(text[: text.index("[groups.single]")])
    doc = ws.cli_json("status")
    assert doc["orphaned"] == ["single/htp/c"]
    assert [(a["id"], a["stale"]) for a in doc["actions"]] == [("pair/htp", False)]
    assert ws.cli_json("status", "pair")["orphaned"] == []  # selected: orphans not listed


def test_external_data_linked_from_outside_the_folder_is_refused_with_what_to_do(
    workspace: Workspace, tmp_path: Path
) -> None:
    """A data file that is a symbolic link out of the model's folder (DVC's ``symlink``
    cache type): ONNX Runtime refuses to read it; the failure says how to keep it."""
    import onnx

    store = tmp_path / "store"
    store.mkdir()
    model = matmul_model()
    onnx.save(model, store / "m.onnx", save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)  # fmt: skip
    (workspace.root / "models").mkdir(parents=True, exist_ok=True)
    shutil.copy(store / "m.onnx", workspace.root / "models" / "m.onnx")
    os.symlink(store / "m.onnx.data", workspace.root / "models" / "m.onnx.data")
    workspace.manifest({
        "providers": {"htp": HTP73},
        "groups": {"g": {"models": ["models/m.onnx"], "providers": ["htp"]}},
    })  # fmt: skip
    proc = workspace.main("build")
    assert proc.returncode == 1
    assert "escapes model directory" in proc.stderr and "hard link to it" in proc.stderr
