"""The compile settings (issue #12): the compile API or sessions, the graph optimisation
level, and the session settings, from the manifest to the key, the job and the real QNN EP."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace
from modelgen import _model, matmul_model, unsupported_model
from onnx import helper, numpy_helper
from test_options import mod_model

import epbuild.providers
from epbuild.api import Outcome, status
from epbuild.errors import ManifestError
from epbuild.executors import worker
from epbuild.executors.job import Job
from epbuild.inspection.detail import render, status_detail
from epbuild.inspection.verify import verify_outputs
from epbuild.kinds.compilework import CompileWork
from epbuild.manifest import defaults as defaults_module
from epbuild.manifest.load import load_manifest
from epbuild.manifest.model import SESSION_SETTINGS, CompileSettings, ContextSettings
from epbuild.onnx.proto import read_model
from epbuild.providers.base import BaseProvider, ProviderConfig, has_compile_api


def folded_model(seed: int = 0, n: int = 32) -> onnx.ModelProto:
    """x @ (A + B) → Relu: constant folding turns A + B into one initializer; without it the
    Add of two constants is compiled into the QNN graph."""
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) * 0.1 for _ in range(2))
    nodes = [
        helper.make_node("Add", ["A", "B"], ["W"]),
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    inits = [numpy_helper.from_array(a, "A"), numpy_helper.from_array(b, "B")]
    return _model(nodes, inits, [1, n], [1, n])


def outputs(root: Path) -> dict[str, bytes]:
    """Every file under ``build/``, by relative path."""
    out = root / "build"
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def one_group(ws: Workspace, group: dict[str, Any], provider: dict[str, Any] | None = None) -> None:
    ws.manifest({"providers": {"htp": {**HTP73, **(provider or {})}},
                 "groups": {"g": {"providers": ["htp"], **group}}})  # fmt: skip


def settings(ws: Workspace, group: str = "g", provider: str = "htp") -> CompileSettings:
    return load_manifest(ws.root / "epbuild.toml").groups[group].compile[provider]


# --- the manifest --------------------------------------------------------------------------


def test_defaults_are_the_compile_api_and_all_optimisations(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    one_group(workspace, {"models": ["m/a.onnx"]})
    assert has_compile_api()  # onnxruntime >= 1.23 is installed here
    assert settings(workspace) == CompileSettings("compile_api", "all", False, None, None)


def test_group_settings_win_over_the_provider(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    one_group(
        workspace,
        {"models": ["m/a.onnx"], "graph_optimization_level": "disabled"},
        {"compiler": "session", "graph_optimization_level": "basic", "intra_op_num_threads": 2,
         "disable_cpu_ep_fallback": True},
    )  # fmt: skip
    assert settings(workspace) == CompileSettings("session", "disabled", True, 2, None)
    # the provider table keeps its adapter settings apart: these are not EP settings
    assert load_manifest(workspace.root / "epbuild.toml").providers["htp"].settings == {}


def test_old_onnxruntime_resolves_to_sessions(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(defaults_module, "has_compile_api", lambda: False)
    monkeypatch.setattr(defaults_module, "onnxruntime_version", lambda: "1.22.1")
    workspace.model("m/a.onnx")
    one_group(workspace, {"models": ["m/a.onnx"]})
    assert settings(workspace).compiler == "session"
    one_group(workspace, {"models": ["m/a.onnx"], "compiler": "compile_api"})
    with pytest.raises(ManifestError) as info:
        load_manifest(workspace.root / "epbuild.toml")
    err = info.value
    lines = (workspace.root / "epbuild.toml").read_text().splitlines()
    assert err.key == "groups.g.compiler"
    assert err.line == lines.index('compiler = "compile_api"') + 1
    assert "onnxruntime 1.22.1 has no compile API" in str(err) and 'compiler = "session"' in str(
        err
    )


def test_compile_api_version_rule() -> None:
    assert not has_compile_api("1.22.2") and has_compile_api("1.23.0") and has_compile_api("2.0")
    assert not has_compile_api("absent") and has_compile_api("1.32.0.dev20260101")


@pytest.mark.parametrize(
    ("setting", "key", "message"),
    [
        ('compiler = "ort"', "compiler", '"ort" is not allowed'),
        ('graph_optimization_level = "max"', "graph_optimization_level", '"max" is not allowed'),
        ("graph_optimization_level = 99", "graph_optimization_level", "must be string"),
        ('disable_cpu_ep_fallback = "yes"', "disable_cpu_ep_fallback", "must be boolean"),
        ("intra_op_num_threads = 0", "intra_op_num_threads", "must be at least 1"),
        ("intra_op_num_threads = 1.5", "intra_op_num_threads", "must be integer"),
        ('external_data_folder = "../w"', "external_data_folder", ".."),
        ('external_data_folder = "/abs"', "external_data_folder", "relative"),
        ('external_data_folder = "w"', "external_data_folder", 'load = "bytes"'),
    ],
)
@pytest.mark.parametrize("table", ["providers.htp", "groups.g"])
def test_bad_settings_name_file_line_and_key(
    workspace: Workspace, setting: str, key: str, message: str, table: str
) -> None:
    workspace.model("m/a.onnx")
    text = (
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
        + (setting + "\n" if table == "providers.htp" else "")
        + '\n[groups.g]\nmodels = ["m/a.onnx"]\nproviders = ["htp"]\n'
        + (setting + "\n" if table == "groups.g" else "")
    )
    path = workspace.manifest(text)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    err = info.value
    assert err.key == f"{table}.{key}", str(err)
    assert err.line == text.splitlines().index(setting) + 1
    assert message in str(err), str(err)
    assert f"epbuild.toml:{err.line}" in str(err)


def test_compile_api_refused_for_tensorrt_and_fallback_set_twice(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    trt_group = {"g": {"models": ["m/a.onnx"], "providers": ["trt"]}}
    workspace.manifest({"providers": {"trt": {"ep": "tensorrt", "compiler": "compile_api"}},
                        "groups": trt_group})  # fmt: skip
    with pytest.raises(ManifestError, match="cannot compile through the compile API") as info:
        load_manifest(workspace.root / "epbuild.toml")
    assert info.value.key == "providers.trt.compiler"
    workspace.manifest({"providers": {"trt": {"ep": "tensorrt"}}, "groups": trt_group})
    assert settings(workspace, provider="trt").compiler == "session"  # its default
    one_group(
        workspace,
        {"models": ["m/a.onnx"], "disable_cpu_ep_fallback": True},
        {"session_options": {"session.disable_cpu_ep_fallback": "1"}},
    )
    with pytest.raises(ManifestError, match="also set as session_options") as info:
        load_manifest(workspace.root / "epbuild.toml")
    assert info.value.key == "groups.g.disable_cpu_ep_fallback"


# --- the key -------------------------------------------------------------------------------


def test_each_setting_is_in_the_key_with_a_reason(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    one_group(workspace, {"models": ["m/a.onnx"]})
    (before,) = status(workspace.root).actions
    assert before.stale
    changes: list[tuple[dict[str, Any], str]] = [
        ({"compiler": "session"}, 'compile setting compiler: "compile_api" → "session"'),
        ({"graph_optimization_level": "disabled"},
         'compile setting graph_optimization_level: "all" → "disabled"'),
        ({"disable_cpu_ep_fallback": True},
         "compile setting disable_cpu_ep_fallback: false → true"),
        ({"intra_op_num_threads": 1}, "compile setting intra_op_num_threads: unset → 1"),
    ]  # fmt: skip
    assert workspace.build().ok
    for change, reason in changes:
        one_group(workspace, {"models": ["m/a.onnx"], **change})
        (plan,) = status(workspace.root).actions
        assert plan.stale and plan.key != before.key
        assert plan.reasons == [reason]


def test_record_from_before_the_settings_explains_itself() -> None:
    from epbuild.planning.keys import explain_difference

    new = {"format": "1", "models": [], "compile": SESSION_SETTINGS.to_json()}
    old = {"format": "1", "models": []}
    assert explain_difference(old, new) == ["the compile settings were not in the recorded key"]
    new["compile"] = {**SESSION_SETTINGS.to_json(), "compiler": "compile_api"}
    assert explain_difference(old, new) == [
        'compile setting compiler: "session" → "compile_api"']  # fmt: skip


# --- the worker, with a fake onnxruntime ----------------------------------------------------


def _fake_ort(log: list[Any], fail: str | None = None) -> types.ModuleType:
    class SessionOptions:
        def __init__(self) -> None:
            self.entries: dict[str, str] = {}
            self.graph_optimization_level = "ORT_ENABLE_ALL"
            self.intra_op_num_threads = 0

        def add_session_config_entry(self, key: str, value: str) -> None:
            self.entries[key] = value

    class ModelCompiler:
        def __init__(self, so: SessionOptions, model: str | bytes, **kw: Any) -> None:
            self.so, self.model, self.kw = so, model, kw

        def compile_to_file(self, path: str) -> None:
            if fail is not None and path.endswith(f"/{fail}_ctx.onnx"):
                raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Unable to compile any nodes.")
            log.append((self.model, path, self.so.entries, self.so.intra_op_num_threads, self.kw))

    ort = types.ModuleType("onnxruntime")
    ort.SessionOptions = SessionOptions  # type: ignore[attr-defined]
    ort.ModelCompiler = ModelCompiler  # type: ignore[attr-defined]
    ort.OrtCompileApiFlags = types.SimpleNamespace(ERROR_IF_NO_NODES_COMPILED=1)  # type: ignore[attr-defined]
    ort.GraphOptimizationLevel = types.SimpleNamespace(  # type: ignore[attr-defined]
        ORT_DISABLE_ALL=0, ORT_ENABLE_BASIC=1, ORT_ENABLE_EXTENDED=2, ORT_ENABLE_ALL=99
    )
    return ort


class _Adapter(BaseProvider):
    kind = "qnn"

    def context_source(self, config: Any) -> str:
        return "qnn"

    def context_options(self, config: Any, ctx_path: str, embed_mode: int) -> dict[str, str]:
        raise AssertionError("the compile API path needs no context options")

    def attach(self, ort: Any, so: Any, config: Any, ep_name: str | None = None) -> None:
        so.entries["attached"] = "1"

    def versions(self, config: Any) -> dict[str, str]:
        return {"onnxruntime-qnn": "0"}  # the worker reports what it compiled with


def _job(**kw: Any) -> CompileWork:
    fields: dict[str, Any] = {
        "action_id": "g/htp",
        "provider": ProviderConfig("htp", "qnn", {}, {"user.entry": "x"}, {}),
        "models": ("m/a.onnx", "m/b.onnx"),
        "staging": "build/.staging/x",
        "context": ContextSettings(share_weights=True),
        "initializer_names": ("a_w.bin", "b_w.bin"),
        "compile": CompileSettings("compile_api", "disabled", True, 3, None),
    }
    return CompileWork(**{**fields, **kw})


def test_compile_api_worker_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[Any] = []
    monkeypatch.setitem(sys.modules, "onnxruntime", _fake_ort(log))
    monkeypatch.setitem(epbuild.providers._cache, "qnn", _Adapter())
    monkeypatch.setattr(worker, "check_outputs", lambda *a: {"models": {}})
    job = Job.from_json(_job().as_job().to_json())  # what crosses to the worker process
    result = worker.result_of(job, ".")
    assert result["ok"], result
    assert result["detail"]["compiler"] == "compile_api"
    (a, b) = log
    assert [a[0], b[0]] == ["m/a.onnx", "m/b.onnx"]  # by path, in order
    assert a[1] == "build/.staging/x/a_ctx.onnx"
    assert a[2] == {"ep.share_ep_contexts": "1", "session.disable_cpu_ep_fallback": "1",
                    "user.entry": "x", "attached": "1"}  # fmt: skip
    assert b[2]["ep.stop_share_ep_contexts"] == "1" and "ep.stop_share_ep_contexts" not in a[2]
    assert a[3] == 3
    assert a[4] == {"embed_compiled_data_into_model": False, "flags": 1,
                    "graph_optimization_level": 0, "external_initializers_file_path": "a_w.bin",
                    "external_initializers_size_threshold": 0}  # fmt: skip


def test_compile_api_bytes_with_a_data_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[Any] = []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.onnx").write_bytes(b"model-bytes")
    monkeypatch.setitem(sys.modules, "onnxruntime", _fake_ort(log))
    monkeypatch.setitem(epbuild.providers._cache, "qnn", _Adapter())
    monkeypatch.setattr(worker, "check_outputs", lambda *a: {"models": {}})
    settings = CompileSettings("compile_api", "all", False, None, "weights")
    job = _job(models=("m/a.onnx",), context=ContextSettings(load="bytes"), initializer_names=(),
               compile=settings)  # fmt: skip
    assert worker.result_of(job.as_job(), ".")["ok"]
    ((model, _, entries, threads, kw),) = log
    assert model == b"model-bytes" and threads == 0 and kw["graph_optimization_level"] == 99
    assert entries["session.model_external_initializers_file_folder_path"] == "weights"
    assert "session.disable_cpu_ep_fallback" not in entries


def test_compile_api_nothing_compiled_is_the_clear_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", _fake_ort([], fail="b"))
    monkeypatch.setitem(epbuild.providers._cache, "qnn", _Adapter())
    result = worker.result_of(_job().as_job(), ".")
    assert not result["ok"] and "traceback" not in result
    assert result["error"].startswith("m/b.onnx: no EPContext model was written — the EP compiled")
    assert "unsupported ops" in result["hint"]


# --- end to end with the real QNN EP --------------------------------------------------------


def _zoo(ws: Workspace) -> None:
    """A sharing pair, a single model, a partial model with external initializers, and a
    model with external data handed over as bytes."""
    w = np.random.default_rng(7).standard_normal((32, 32), dtype=np.float32) * 0.1
    ws.model("m/a.onnx", matmul_model(1, shared=w))
    ws.model("m/b.onnx", matmul_model(2, shared=w, batch=4))
    ws.model("m/c.onnx", matmul_model(3))
    ws.model("p/p.onnx", mod_model(1))
    ws.model("e/e.onnx", matmul_model(4), external="e.data")


def _zoo_manifest(ws: Workspace, compiler: str) -> None:
    ws.manifest({
        "providers": {"htp": {**HTP73, "compiler": compiler}},
        "groups": {
            "pair": {"models": ["m/a.onnx", "m/b.onnx"], "providers": ["htp"],
                     "share_weights": True},
            "single": {"models": ["m/c.onnx"], "providers": ["htp"]},
            "partial": {"models": ["p/p.onnx"], "providers": ["htp"],
                        "external_initializers": "w.bin"},
            "bytes": {"models": ["e/e.onnx"], "providers": ["htp"], "load": "bytes"},
        },
    })  # fmt: skip


@pytest.mark.slow
def test_both_compilers_give_identical_bytes(workspace: Workspace, tmp_path: Path) -> None:
    """Sessions and the compile API (at the same optimisation level) write the same files,
    byte for byte; each is reproducible run to run and wherever the workspace lives."""
    _zoo(workspace)
    _zoo_manifest(workspace, "session")
    first = workspace.build()
    assert first.ok, [a.error for a in first.actions]
    by_session = outputs(workspace.root)
    assert len(by_session) == 10 and "partial/htp/w.bin" in by_session
    _zoo_manifest(workspace, "compile_api")
    plans = status(workspace.root).actions
    assert all(p.reasons == ['compile setting compiler: "session" → "compile_api"'] for p in plans)
    assert workspace.build().count(Outcome.COMPILED) == 4
    by_api = outputs(workspace.root)
    assert by_api == by_session
    details = status_detail(workspace.root)
    assert {d.compiler for d in details} == {"compile_api"}
    assert any("with the compile API" in line for line in render(details))
    assert verify_outputs(workspace.root).ok
    other = tmp_path / "elsewhere" / "deeper"
    shutil.copytree(workspace.root, other)
    shutil.rmtree(other / "build")
    shutil.rmtree(other / ".epbuild")
    assert Workspace(other).build().count(Outcome.COMPILED) == 4  # a fresh run, elsewhere
    assert outputs(other) == by_api


@pytest.mark.parametrize("compiler", ["compile_api", "session"])
def test_nothing_compiled_fails_clearly(workspace: Workspace, compiler: str) -> None:
    workspace.model("m/u.onnx", unsupported_model())
    one_group(workspace, {"models": ["m/u.onnx"]}, {"compiler": compiler})
    (action,) = workspace.build().actions
    assert action.outcome is Outcome.FAILED
    assert action.error is not None and "the EP compiled nothing" in action.error
    assert ("unable to compile any nodes" in action.error) == (compiler == "compile_api")
    assert not (workspace.root / "build" / "g" / "htp").exists()


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["compile_api", "session"])
def test_graph_optimization_level_changes_the_graph(workspace: Workspace, compiler: str) -> None:
    workspace.model("m/f.onnx", folded_model())
    built: dict[str, dict[str, bytes]] = {}
    keys = set()
    for level in ("all", "disabled"):
        one_group(workspace, {"models": ["m/f.onnx"], "graph_optimization_level": level},
                  {"compiler": compiler})  # fmt: skip
        result = workspace.build()
        assert result.ok and result.count(Outcome.COMPILED) == 1, result.actions[0].error
        keys.add(status(workspace.root).actions[0].key)
        built[level] = outputs(workspace.root)
    assert len(keys) == 2
    assert built["all"]["g/htp/f_ctx_qnn.bin"] != built["disabled"]["g/htp/f_ctx_qnn.bin"]


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["compile_api", "session"])
def test_disable_cpu_ep_fallback_fails_a_partial_model(workspace: Workspace, compiler: str) -> None:
    workspace.model("p/p.onnx", mod_model(1))
    one_group(workspace, {"models": ["p/p.onnx"]}, {"compiler": compiler})
    assert workspace.build().ok  # Mod runs on the CPU EP
    one_group(workspace, {"models": ["p/p.onnx"], "disable_cpu_ep_fallback": True},
              {"compiler": compiler})  # fmt: skip
    (action,) = workspace.build().actions
    assert action.outcome is Outcome.FAILED and action.error is not None
    assert action.error.startswith("p/p.onnx: ONNX Runtime failed"), action.error
    assert "fallback to CPU EP has been explicitly disabled" in action.error
    assert action.hint is not None and "disable_cpu_ep_fallback = true" in action.hint
    workspace.model("m/a.onnx")  # a model the EP takes whole still builds
    one_group(workspace, {"models": ["m/a.onnx"], "disable_cpu_ep_fallback": True})
    assert workspace.build().ok


def test_intra_op_num_threads_builds(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    one_group(workspace, {"models": ["m/a.onnx"]}, {"intra_op_num_threads": 1})
    result = workspace.build()
    assert result.ok, result.actions[0].error
    (plan,) = status(workspace.root).actions
    assert not plan.stale


@pytest.mark.parametrize("compiler", ["compile_api", "session"])
def test_external_data_folder(workspace: Workspace, compiler: str) -> None:
    from test_options import run_cpu

    from epbuild.runtime import open_action

    src = workspace.model("m/e.onnx", matmul_model(4), external="e.data")
    (workspace.root / "weights").mkdir()
    shutil.move(workspace.root / "m" / "e.data", workspace.root / "weights" / "e.data")
    group = {"models": ["m/e.onnx"], "load": "bytes"}
    one_group(workspace, group, {"compiler": compiler})
    (plan,) = status(workspace.root).actions  # the data is not beside the model
    assert plan.key is None and "'m/e.data' (tensor" in plan.reasons[0]
    assert "is missing" in plan.reasons[0]
    one_group(workspace, {**group, "external_data_folder": "weights"}, {"compiler": compiler})
    result = workspace.build()
    assert result.ok, result.actions[0].error
    x = np.random.default_rng(1).standard_normal((1, 32), dtype=np.float32)
    shutil.copy(workspace.root / "weights" / "e.data", workspace.root / "m" / "e.data")
    expected = run_cpu(src, x)
    with open_action("g/htp", workspace.root) as b:
        got = b.run("e", {"x": x})[0]
    assert float(np.abs(got - expected).max() / np.abs(expected).max()) < 2e-2
    (workspace.root / "m" / "e.data").unlink()
    data = bytearray((workspace.root / "weights" / "e.data").read_bytes())
    data[8] ^= 0x01
    (workspace.root / "weights" / "e.data").write_bytes(bytes(data))
    (plan,) = status(workspace.root).actions
    assert plan.stale and plan.reasons == ["external data weights/e.data of m/e.onnx changed"]
    assert read_model(workspace.root / "build" / "g" / "htp" / "e_ctx.onnx").external_refs == []
