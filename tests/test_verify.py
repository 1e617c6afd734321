"""``epbuild verify``: passes on good builds, catches each kind of hand-broken output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
import waits
from conftest import HTP73, Workspace
from test_options import mod_model

from epbuild.errors import UserError
from epbuild.inspection.verify import LoadOutcome, verify_outputs
from epbuild.onnx.context import Problem

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build with a sharing pair, a plain model and a partial model with external
    initializers; each test corrupts its own copy."""
    import numpy as np
    from modelgen import matmul_model

    ws = Workspace(tmp_path_factory.mktemp("verify") / "ws")
    w = np.random.default_rng(7).standard_normal((32, 32), dtype=np.float32) * 0.1
    ws.model("m/a.onnx", matmul_model(1, shared=w))
    ws.model("m/b.onnx", matmul_model(2, shared=w, batch=4))
    ws.model("m/c.onnx", matmul_model(3))
    ws.model("m/p.onnx", mod_model(1))
    ws.manifest({"providers": {"htp": HTP73}, "groups": {
        "pair": {"models": ["m/a.onnx", "m/b.onnx"], "providers": ["htp"], "share_weights": True},
        "single": {"models": ["m/c.onnx"], "providers": ["htp"], "embed_mode": 1},
        "part": {"models": ["m/p.onnx"], "providers": ["htp"],
                 "external_initializers": "w.bin"}}})  # fmt: skip
    result = ws.build()
    assert result.ok, [a.error for a in result.actions]
    return ws.root


@pytest.fixture
def copy(good: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(good, dest)
    return dest


def edit_ctx(ctx: Path, change: Callable[[onnx.ModelProto], None]) -> None:
    model = onnx.load(str(ctx), load_external_data=False)
    change(model)
    onnx.save(model, str(ctx))


def set_attr(name: str, value: bytes) -> Callable[[onnx.ModelProto], None]:
    def change(model: onnx.ModelProto) -> None:
        for node in model.graph.node:
            for a in node.attribute:
                if a.name == name:
                    a.s = value

    return change


def set_location(value: str) -> Callable[[onnx.ModelProto], None]:
    def change(model: onnx.ModelProto) -> None:
        for t in model.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = value

    return change


def lines(problems: list[Problem]) -> str:
    return "\n".join(p.line() for p in problems)


def test_good_builds_pass(good: Path) -> None:
    result = verify_outputs(good)
    assert result.ok, lines(result.problems)
    assert sorted(result.checked) == [
        "build/pair/htp/a_ctx.onnx", "build/pair/htp/b_ctx.onnx",
        "build/part/htp/p_ctx.onnx", "build/single/htp/c_ctx.onnx"]  # fmt: skip


def test_verify_load_good_build(good: Path) -> None:
    result = verify_outputs(good, load=True)
    assert result.ok, result.lines()
    outcomes = {c.file: c.outcome for c in result.loads}
    assert outcomes["build/pair/htp/a_ctx.onnx"] is LoadOutcome.NOT_LOADABLE
    assert outcomes["build/single/htp/c_ctx.onnx"] is LoadOutcome.PASSED
    assert outcomes["build/part/htp/p_ctx.onnx"] is LoadOutcome.PASSED
    assert all((c.max_error or 0) < 2e-2 for c in result.loads)


def test_absolute_ep_cache_context(copy: Path) -> None:
    ctx = copy / "build/pair/htp/a_ctx.onnx"
    absolute = str(copy / "build/pair/htp/a_ctx_qnn.bin").encode()
    edit_ctx(ctx, set_attr("ep_cache_context", absolute))
    result = verify_outputs(copy)
    found = [p for p in result.problems if p.attribute == "ep_cache_context"]
    assert len(found) == 1 and found[0].file == "build/pair/htp/a_ctx.onnx"
    assert "is absolute" in found[0].message and found[0].node is not None
    assert any("absolute path" in p.message for p in result.problems)  # the leak scan too


def test_dotdot_in_location(copy: Path) -> None:
    out = copy / "build/part/htp"
    shutil.copyfile(out / "w.bin", copy / "build/part/w.bin")  # it exists, but out of bounds
    edit_ctx(out / "p_ctx.onnx", set_location("../w.bin"))
    result = verify_outputs(copy)
    found = [p for p in result.problems if (p.attribute or "").endswith("location")]
    assert len(found) == 1 and "contains '..'" in found[0].message
    assert found[0].line().startswith("build/part/htp/p_ctx.onnx: tensor M: location: ")


def test_missing_bin(copy: Path) -> None:
    os.unlink(copy / "build/pair/htp/a_ctx_qnn.bin")
    result = verify_outputs(copy)
    text = lines(result.problems)
    assert "build/pair/htp/a_ctx_qnn.bin: recorded output is missing" in text
    assert "build/pair/htp/b_ctx.onnx: node " in text and "'a_ctx_qnn.bin' does not exist" in text


def test_sharing_group_with_two_binaries(copy: Path) -> None:
    out = copy / "build/pair/htp"
    shutil.copyfile(out / "a_ctx_qnn.bin", out / "b_ctx_qnn.bin")
    edit_ctx(out / "b_ctx.onnx", set_attr("ep_cache_context", b"b_ctx_qnn.bin"))
    result = verify_outputs(copy)
    found = [p for p in result.problems if "ep.share_ep_contexts" in p.message]
    assert len(found) == 1 and found[0].file == "build/pair/htp/b_ctx.onnx"
    assert found[0].message.startswith("references 'b_ctx_qnn.bin', not the group's shared ")


def test_truncated_external_data(copy: Path) -> None:
    path = copy / "build/part/htp/w.bin"
    path.write_bytes(path.read_bytes()[:50])
    result = verify_outputs(copy)
    found = [p for p in result.problems if p.attribute == "tensor M: offset/length"]
    assert len(found) == 1 and "past the end of 'w.bin' (50 bytes)" in found[0].message


def test_wrong_source(copy: Path) -> None:
    edit_ctx(copy / "build/single/htp/c_ctx.onnx", set_attr("source", b"openvino"))
    result = verify_outputs(copy)
    found = [p for p in result.problems if p.attribute == "source"]
    assert len(found) == 1 and "'openvino'" in found[0].message and found[0].node


def test_digest_mismatch(copy: Path) -> None:
    path = copy / "build/pair/htp/a_ctx_qnn.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    result = verify_outputs(copy)
    assert [p.line() for p in result.problems] == [
        "build/pair/htp/a_ctx_qnn.bin: content does not match the digest recorded by the build"
    ]


def test_load_catches_a_corrupt_binary(copy: Path) -> None:
    path = copy / "build/part/htp/p_ctx_qnn.bin"
    data = bytearray(path.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    path.write_bytes(bytes(data))
    result = verify_outputs(copy, selectors=["part"], load=True)
    (check,) = result.loads
    assert check.outcome is LoadOutcome.FAILED and not result.ok
    assert any(line.startswith("build/part/htp/p_ctx.onnx: load: ") for line in result.lines())


def test_wrong_target_in_compatibility_info(copy: Path) -> None:
    def change(model: onnx.ModelProto) -> None:
        for p in model.metadata_props:
            if p.key.startswith("ep_compatibility_info."):  # QNNExecutionProvider, or qnn
                p.value = p.value.replace(":73:60:", ":75:69:")

    edit_ctx(copy / "build/single/htp/c_ctx.onnx", change)
    found = [p for p in verify_outputs(copy).problems
             if (p.attribute or "").startswith("ep_compatibility_info.")]  # fmt: skip
    assert len(found) == 1 and "htp_arch 75" in found[0].message


def test_cli_exit_codes_and_json(copy: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return waits.run([sys.executable, "-m", "epbuild", "-C", str(copy), "verify", *args],
                         f"epbuild verify {' '.join(args)}")  # fmt: skip

    ok = cli()
    assert ok.returncode == 0 and "0 problem(s)" in ok.stdout, ok.stderr
    os.unlink(copy / "build/part/htp/w.bin")
    bad = cli("--json")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    doc = json.loads(bad.stdout)
    assert not doc["ok"] and {p["file"] for p in doc["problems"]} == {
        "build/part/htp/w.bin", "build/part/htp/p_ctx.onnx"}  # fmt: skip
    assert {e["file"] for e in doc["ort_compatibility"]} == set(doc["checked"])


def test_status_detail_cli(copy: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(copy), "status", "--detail", "--json"],
        capture_output=True, text=True, timeout=waits.scaled(120),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    actions = {a["id"]: a for a in json.loads(proc.stdout)["actions"]}
    part = actions["part/htp/p"]
    assert part["models"][0]["cpu_op_types"] == {"Mod": 1}
    assert part["models"][0]["context_nodes"] == 2 and part["binary_bytes"] > 0
    assert part["seconds"] > 0 and part["peak_rss"] > 0
    assert actions["single/htp/c"]["binary_bytes"] == 0  # embedded
    text = subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(copy), "status", "--detail"],
        capture_output=True, text=True, timeout=waits.scaled(120),
    ).stdout  # fmt: skip
    assert "m/p.onnx: 2 EPContext node(s) from 4 source nodes; on the CPU EP: Mod x1" in text


def _example(name: str, dest: Path) -> Path:
    shutil.copytree(EXAMPLES / name, dest,
                    ignore=shutil.ignore_patterns("build", ".epbuild", "models"))  # fmt: skip
    if (EXAMPLES / name / "models").is_dir() and name == "quickstart":
        shutil.copytree(EXAMPLES / name / "models", dest / "models")
    return dest


def _build_and_verify_load(root: Path) -> Any:
    from epbuild import build

    result = build(root)
    assert result.ok, [(a.id, a.error, a.log_tail) for a in result.actions if a.error]
    checked = verify_outputs(root, load=True)
    assert checked.ok, checked.lines()
    return checked


def test_loads_run_jobs_at_once_in_action_order(
    good: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify --load -j 2`` runs two loaders at once (a model-zoo verify takes half as long
    on two cores) and still reports them in action order."""
    import threading

    from epbuild.inspection import loading as v

    def alone(root: str, ctx: str, job: dict[str, Any], toolchain: Any) -> Any:
        return v.LoadCheck(ctx, LoadOutcome.PASSED, "one by one")

    monkeypatch.setattr(v, "_run_loader", alone)
    first = verify_outputs(good, load=True, jobs=1).loads
    order = [c.file for c in first]
    assert [c.file for c in first if c.message == "one by one"] == [
        "build/single/htp/c_ctx.onnx", "build/part/htp/p_ctx.onnx"]  # fmt: skip
    both = threading.Barrier(2, timeout=waits.scaled(60))

    def together(root: str, ctx: str, job: dict[str, Any], toolchain: Any) -> Any:
        both.wait()  # returns once the other load runs too; breaks if they run one by one
        return v.LoadCheck(ctx, LoadOutcome.PASSED, "at once")

    monkeypatch.setattr(v, "_run_loader", together)
    result = verify_outputs(good, load=True, jobs=2)
    assert [c.file for c in result.loads] == order
    assert [c.message for c in result.loads if c.file in order[2:]] == ["at once", "at once"]
    with pytest.raises(UserError, match="--jobs must be at least 1"):
        verify_outputs(good, load=True, jobs=0)


def test_verify_load_quickstart(tmp_path: Path) -> None:
    root = _example("quickstart", tmp_path / "quickstart")
    checked = _build_and_verify_load(root)
    outcomes = {c.file: c.outcome.value for c in checked.loads}
    assert outcomes == {
        "build/llm/htp-v73/prefill_ctx.onnx": "not_loadable_here",
        "build/llm/htp-v73/decode_ctx.onnx": "not_loadable_here",
        "build/vision/htp-v73/classifier_ctx.onnx": "passed",
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_load_model_zoo(tmp_path: Path) -> None:
    root = _example("model-zoo", tmp_path / "zoo")
    subprocess.run([sys.executable, str(root / "fetch_models.py")], check=True,
                   capture_output=True, timeout=waits.scaled(120))  # fmt: skip
    checked = _build_and_verify_load(root)
    assert len(checked.loads) == 18
    # The QNN EP segfaults loading inception_v1's v73 context on x86_64 (it runs the same
    # model compiled just in time fine): reported as not loadable here, never as a failure.
    passed = [c for c in checked.loads if c.outcome is LoadOutcome.PASSED]
    assert len(passed) >= 16, [(c.file, c.message) for c in checked.loads]


# ---------------------------------------------------------------------------------------
# ONNX Runtime's own verdict, source aliases, loads that may not compile


def ort_says(monkeypatch: pytest.MonkeyPatch, verdict: str) -> list[tuple[list[Any], str]]:
    """Make ORT's device check answer ``verdict`` for this host's (CPU-typed) QNN device: the
    real EP judges only NPU devices, which this host lacks; returns the calls it got."""
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    from epbuild.providers.qnn import QnnProvider

    monkeypatch.setattr(QnnProvider, "compatibility_device_types", frozenset({"CPU", "NPU"}))

    calls: list[tuple[list[Any], str]] = []

    def judge(devices: list[Any], info: str) -> Any:
        calls.append((list(devices), info))
        return getattr(capi.OrtCompiledModelCompatibility, verdict)

    monkeypatch.setattr(capi, "get_model_compatibility_for_ep_devices", judge)
    return calls


def test_ort_verdict_is_not_available_on_this_host(good: Path) -> None:
    result = verify_outputs(good, selectors=["single"])
    (entry,) = result.to_json()["ort_compatibility"]
    assert entry["file"] == "build/single/htp/c_ctx.onnx" and entry["ep"] == "QNNExecutionProvider"
    assert entry["info"].startswith("v2:") and ":73:60:" in entry["info"]
    assert entry["verdict"] is None and "judges only NPU devices" in entry["note"]
    assert entry["target_check"] == "ok" and result.ok


def test_ort_unsupported_is_an_error(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = ort_says(monkeypatch, "EP_UNSUPPORTED")
    result = verify_outputs(good, selectors=["single"])
    assert not result.ok and [c.verdict.value for c in result.ort if c.verdict] == [
        "EP_UNSUPPORTED"
    ]
    ((devices, info),) = calls
    assert {d.ep_name for d in devices} == {"QNNExecutionProvider"} and ":73:60:" in info
    assert any(
        line.startswith(
            "build/single/htp/c_ctx.onnx: ONNX Runtime says the QNNExecutionProvider EP cannot run"
        )
        for line in result.lines()
    )


def test_ort_prefer_recompilation_is_a_warning(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ort_says(monkeypatch, "EP_SUPPORTED_PREFER_RECOMPILATION")
    result = verify_outputs(good, selectors=["single"])
    assert result.ok
    (line,) = result.lines()
    assert line.startswith("warning: build/single/htp/c_ctx.onnx: ") and "recompiled" in line
    ort_says(monkeypatch, "EP_SUPPORTED_OPTIMAL")
    optimal = verify_outputs(good, selectors=["single"])
    assert optimal.ok and not optimal.lines()
    assert optimal.to_json()["ort_compatibility"][0]["verdict"] == "EP_SUPPORTED_OPTIMAL"


def test_ort_verdict_beside_a_failed_target_check(
    copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def change(model: onnx.ModelProto) -> None:
        for p in model.metadata_props:
            if p.key.startswith("ep_compatibility_info."):  # QNNExecutionProvider, or qnn
                p.value = p.value.replace(":73:60:", ":75:69:")

    edit_ctx(copy / "build/single/htp/c_ctx.onnx", change)
    calls = ort_says(monkeypatch, "EP_SUPPORTED_OPTIMAL")
    (entry,) = verify_outputs(copy, selectors=["single"]).to_json()["ort_compatibility"]
    assert ":75:69:" in calls[0][1] and entry["verdict"] == "EP_SUPPORTED_OPTIMAL"
    assert "htp_arch 75" in entry["target_check"]


@pytest.mark.parametrize("alias", [b"QNN", b"QnnExecutionProvider", b"QNNEXECUTIONPROVIDER"])
def test_source_aliases_the_ep_loads_are_accepted(copy: Path, alias: bytes) -> None:
    edit_ctx(copy / "build/single/htp/c_ctx.onnx", set_attr("source", alias))
    result = verify_outputs(copy, selectors=["single"], load=True)
    # the digest changed (the file was edited); the source rule and a real load accept it
    assert [p.message for p in result.problems] == [
        "content does not match the digest recorded by the build"
    ]
    assert [c.outcome for c in result.loads] == [LoadOutcome.PASSED]


@pytest.mark.parametrize("bad", [b"QNN_EP", b"qnn ", b""])
def test_source_near_misses_are_refused(copy: Path, bad: bytes) -> None:
    edit_ctx(copy / "build/single/htp/c_ctx.onnx", set_attr("source", bad))
    found = [p for p in verify_outputs(copy, selectors=["single"]).problems
             if p.attribute == "source"]  # fmt: skip
    assert len(found) == 1 and "expects 'QNNExecutionProvider'" in found[0].message


def test_load_refuses_a_model_the_ep_would_compile(
    good: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain model the QNN EP would compile at load: the runtime's EPContext checks
    # refuse it first, so they are switched off to reach ORT's own refusal.
    from epbuild import runtime
    from epbuild.inspection import loadcheck

    monkeypatch.setattr(runtime, "check_context", lambda *args: None)
    plain = str(good / "m/c.onnx")
    job = {"ctx": plain, "source": plain,
           "provider": {"name": "htp", "ep": "qnn",
                        "options": {"backend_type": "htp", **HTP73["options"]}}}  # fmt: skip
    result = loadcheck.check(job)
    assert result["outcome"] == "failed", result
    assert "the EP would compile nodes of it at load" in result["message"]
    assert "disable_model_compile" in result["message"]
