"""The runtime API: open built actions with the real QNN EP, in order, closed in reverse."""

from __future__ import annotations

import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild.errors import CompatibilityError, LockTimeoutError, UserError
from epbuild.providers.base import ProviderConfig
from epbuild.runtime import open_action, open_models

PROVIDER = ProviderConfig("htp", "qnn", {"backend_type": "htp", **HTP73["options"]}, {}, {})


@pytest.fixture
def trio(workspace: Workspace) -> Workspace:
    """A non-sharing group of three models, built."""
    for i, name in enumerate("abc"):
        workspace.model(f"m/{name}.onnx", matmul_model(10 + i))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/a.onnx", "m/b.onnx", "m/c.onnx"], "providers": ["htp"]}}})  # fmt: skip
    assert workspace.build().ok
    return workspace


def cpu(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("load", ["path", "bytes"])
def test_open_from_path_and_bytes_matches_cpu(trio: Workspace, load: Any) -> None:
    x = np.random.default_rng(5).standard_normal((1, 32), dtype=np.float32)
    with open_action("g/htp", trio.root, load=load) as built:
        assert built.names == ["a", "b", "c"]
        for name in built.names:
            got = built.run(name, {"x": x})[0]
            want = cpu(trio.root / "m" / f"{name}.onnx", x)
            assert float(np.abs(got - want).max() / np.abs(want).max()) < 2e-2
    assert built.closed
    with pytest.raises(UserError, match="closed"):
        built.session("a")


def test_in_memory_buffer_needs_no_file_next_to_it(trio: Workspace, tmp_path: Path) -> None:
    # The ctx bytes come from elsewhere; ep.context_file_path points the EP at the bin.
    elsewhere = tmp_path / "copy_ctx.onnx"
    shutil.copyfile(trio.root / "build/g/htp/a_ctx.onnx", elsewhere)
    target = trio.root / "build/g/htp/a_ctx.onnx"
    x = np.ones((1, 32), dtype=np.float32)
    with open_models([(target, elsewhere.read_bytes())], PROVIDER) as built:
        got = built.run("a", {"x": x})[0]
    want = cpu(trio.root / "m/a.onnx", x)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 2e-2


def test_sessions_are_destroyed_in_reverse_order(trio: Workspace) -> None:
    destroyed: list[str] = []
    with open_action("g/htp", trio.root) as built:
        for name in built.names:
            weakref.finalize(built.session(name), destroyed.append, name)
        assert destroyed == []
    assert destroyed == ["c", "b", "a"]


def test_reverse_order_even_when_the_body_raises(trio: Workspace) -> None:
    destroyed: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), open_action("g/htp", trio.root) as built:
        for name in built.names:
            weakref.finalize(built.session(name), destroyed.append, name)
        raise RuntimeError("boom")
    assert destroyed == ["c", "b", "a"]


def _edit(ctx: Path, dest: Path, change: Any) -> Path:
    model = onnx.load(str(ctx), load_external_data=False)
    change(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dest))
    for bin_file in ctx.parent.glob("*.bin"):
        shutil.copyfile(bin_file, dest.parent / bin_file.name)
    return dest


def _set_compat(value: str) -> Any:
    def change(model: onnx.ModelProto) -> None:
        for p in model.metadata_props:
            if p.key == "ep_compatibility_info.qnn":
                p.value = value

    return change


def _set_source(model: onnx.ModelProto) -> None:
    for node in model.graph.node:
        for a in node.attribute:
            if a.name == "source":
                a.s = b"openvino"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set_compat("v2:6:2.40.0:5.40.0:73:60:0:0"), "QNN SDK 2.40.0"),
        (_set_compat("v2:6:2.51.0:5.51.0:75:69:0:0"), "htp_arch 75"),
        (_set_source, "source 'openvino'"),
    ],
)
def test_mismatched_context_is_rejected(trio: Workspace, tmp_path: Path, change: Any,
                                        message: str) -> None:  # fmt: skip
    bad = _edit(trio.root / "build/g/htp/a_ctx.onnx", tmp_path / "bad" / "a_ctx.onnx", change)
    with pytest.raises(CompatibilityError, match=message) as info:
        open_models([bad], PROVIDER)
    assert "a_ctx.onnx" in info.value.message


def test_shared_group_is_refused_here_not_crashed(simple_ws: Any) -> None:
    ws = simple_ws()
    assert ws.build().ok
    with pytest.raises(CompatibilityError, match="weight-shared QNN contexts"):
        open_action("pair/htp", ws.root)


def test_second_sharing_group_waits(simple_ws: Any) -> None:
    """Two sharing groups never hold the EP's process-wide shared workspace at once.

    Shared contexts cannot be loaded on x86_64, so the sessions here come from a recording
    factory; the lock, the order and the session options are epbuild's real code.
    """
    ws = simple_ws()
    text = (ws.root / "epbuild.toml").read_text()
    (ws.root / "epbuild.toml").write_text(
        text.replace(
            "[groups.single]",
            """[groups.pair2]
models = ["models/a.onnx", "models/b.onnx"]
providers = ["htp"]
share_weights = true

[groups.single]""",
        )
    )
    assert ws.build().ok
    events: list[str] = []

    def factory(tag: str) -> Any:
        def make(model: Any, so: Any) -> object:
            assert so.get_session_config_entry("ep.share_ep_contexts") == "1"
            events.append(f"{tag} open {Path(model).name}")
            return object()

        return make

    first = open_action("pair/htp", ws.root, session_factory=factory("1"))
    started = threading.Event()
    second: list[Any] = []

    def other() -> None:
        started.set()
        second.append(open_action("pair2/htp", ws.root, session_factory=factory("2")))

    t = threading.Thread(target=other)
    t.start()
    started.wait()
    time.sleep(0.3)
    assert events == ["1 open a_ctx.onnx", "1 open b_ctx.onnx"]  # the second is waiting
    with pytest.raises(LockTimeoutError, match="another weight-sharing group"):
        open_action("pair2/htp", ws.root, lock_timeout=0.05, session_factory=factory("3"))
    first.close()
    t.join(10)
    assert events[2:] == ["2 open a_ctx.onnx", "2 open b_ctx.onnx"]
    second[0].close()


def test_open_action_errors_are_clear(trio: Workspace) -> None:
    with pytest.raises(UserError, match="no action matches"):
        open_action("nope/htp", trio.root)
    (trio.root / "epbuild.toml").write_text(
        (trio.root / "epbuild.toml").read_text() + '\n[groups.h]\nmodels = ["m/a.onnx"]\n'
        'providers = ["htp"]\n'
    )
    with pytest.raises(UserError, match="has not been built"):
        open_action("h/htp", trio.root)


@pytest.mark.parametrize("load", ["path", "bytes"])
def test_ort_unsupported_verdict_refuses_before_any_session(
    trio: Workspace, monkeypatch: pytest.MonkeyPatch, load: str
) -> None:
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    from epbuild.providers.qnn import QnnProvider

    monkeypatch.setattr(QnnProvider, "compatibility_device_types", frozenset({"CPU"}))
    verdicts = capi.OrtCompiledModelCompatibility
    said: list[str] = []

    def judge(devices: list[Any], info: str) -> Any:
        said.append(info)
        return verdicts.EP_UNSUPPORTED if len(said) == 1 else verdicts.EP_SUPPORTED_OPTIMAL

    monkeypatch.setattr(capi, "get_model_compatibility_for_ep_devices", judge)
    with pytest.raises(CompatibilityError, match="EP_UNSUPPORTED") as info:
        open_action("g/htp", trio.root, load=load)  # type: ignore[arg-type]
    assert "a_ctx.onnx" in info.value.message and said[0].startswith("v2:")
    with open_action("g/htp", trio.root, load=load) as built:  # type: ignore[arg-type]
        assert built.names == ["a", "b", "c"]  # OPTIMAL (and no verdict) open as before
