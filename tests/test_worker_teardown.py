"""Build-time teardown: the worker creates a group's sessions in order and destroys them in
reverse, before it checks the outputs, also when creating the k-th session fails.

``compile_action`` runs in-process with a fake ``onnxruntime`` module and a fake adapter:
the order is the worker's own code, not ONNX Runtime's.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any

import pytest

import epbuild.providers
from epbuild.executors import worker
from epbuild.kinds.compilework import CompileWork
from epbuild.manifest.model import ContextSettings
from epbuild.providers.base import BaseProvider, ProviderConfig


class _Session:
    pass


def _fake_ort(log: list[str], fail: str | None) -> types.ModuleType:
    class SessionOptions:
        def __init__(self) -> None:
            self.entries: dict[str, str] = {}

        def add_session_config_entry(self, key: str, value: str) -> None:
            self.entries[key] = value

    def inference_session(model: str, so: SessionOptions) -> _Session:
        name = model.rsplit("/", 1)[-1].removesuffix(".onnx")
        if name == fail:
            raise RuntimeError(f"cannot compile {name}")
        stop = so.entries.get("ep.stop_share_ep_contexts") == "1"
        log.append(f"open {name}" + (" (stop)" if stop else ""))
        session = _Session()
        weakref.finalize(session, log.append, f"close {name}")
        return session

    ort = types.ModuleType("onnxruntime")
    ort.SessionOptions = SessionOptions  # type: ignore[attr-defined]
    ort.InferenceSession = inference_session  # type: ignore[attr-defined]
    ort.GraphOptimizationLevel = types.SimpleNamespace(ORT_ENABLE_ALL=99)  # type: ignore[attr-defined]
    return ort


class _Adapter(BaseProvider):
    kind = "qnn"

    def context_source(self, config: Any) -> str:
        return "qnn"

    def context_options(self, config: Any, ctx_path: str, embed_mode: int) -> dict[str, str]:
        return {}

    def attach(self, ort: Any, so: Any, config: Any, ep_name: str | None = None) -> None:
        pass

    def versions(self, config: Any) -> dict[str, str]:
        return {"onnxruntime-qnn": "0"}  # the worker reports what it compiled with


def _fake(monkeypatch: pytest.MonkeyPatch, fail: str | None) -> tuple[list[str], CompileWork]:
    log: list[str] = []
    monkeypatch.setitem(sys.modules, "onnxruntime", _fake_ort(log, fail))
    # The registry's entry, not the function: a module first imported in this window binds
    # ``get_provider`` for good, and a patched function would outlive the test there.
    monkeypatch.setitem(epbuild.providers._cache, "qnn", _Adapter())

    def check_outputs(*args: Any) -> dict[str, Any]:
        log.append("check outputs")
        return {"models": {}}

    monkeypatch.setattr(worker, "check_outputs", check_outputs)
    job = CompileWork(
        action_id="g/qnn",
        provider=ProviderConfig("qnn", "qnn", {}, {}, {}),
        models=("m/a.onnx", "m/b.onnx", "m/c.onnx"),
        staging="build/.staging/x",
        context=ContextSettings(share_weights=True),
        initializer_names=(),
    )
    return log, job


def test_sessions_are_released_in_reverse_before_the_outputs_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log, job = _fake(monkeypatch, fail=None)
    result = worker.result_of(job.as_job(), ".")
    assert result["ok"], result
    assert log == [
        "open a", "open b", "open c (stop)", "close c", "close b", "close a", "check outputs",
    ]  # fmt: skip


def test_a_failed_compile_releases_the_first_in_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    log, job = _fake(monkeypatch, fail="c")
    with pytest.raises(worker.CompileFailure, match="cannot compile c") as info:
        worker.compile_action(job)
    # Released before the error propagates, although its traceback is still alive here.
    assert info.value.__traceback__ is not None
    assert log == ["open a", "open b", "close b", "close a"]
    log.clear()
    result = worker.result_of(job.as_job(), ".")  # what the worker process reports
    assert not result["ok"] and "cannot compile c" in result["error"]
    assert log == ["open a", "open b", "close b", "close a"]
