"""ONNX Runtime's own verdict on a compiled model, beside epbuild's target check.

ORT (1.23 and later) reads a compiled model's ``ep_compatibility_info.<ep>`` metadata
(``get_compatibility_info_from_model``) and asks the EP about it for the EP's devices on this
machine (``get_model_compatibility_for_ep_devices``), answering with an
``OrtCompiledModelCompatibility``: ``EP_SUPPORTED_OPTIMAL``, ``EP_SUPPORTED_PREFER_RECOMPILATION``,
``EP_UNSUPPORTED`` or ``EP_NOT_APPLICABLE``. Both functions live in
``onnxruntime.capi.onnxruntime_pybind11_state`` only (ORT 1.32 does not re-export them).

Where there is no verdict (no onnxruntime, an older one, no device of the EP, or an EP that
declines to judge) the result says why and nothing fails. An adapter may name the device
types its EP judges (``compatibility_device_types``); ORT is then asked only with those (why
QNN names only NPU devices: docs/research/qnn-plugin.md). onnxruntime is imported here,
lazily: only ``verify`` and the runtime call this, never the build's coordinator.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import Any

from epbuild._dataclass import dataclass
from epbuild.errors import EpbuildError
from epbuild.onnx.context import Problem, Severity
from epbuild.providers import get_provider
from epbuild.providers.contract import ProviderConfig


class OrtVerdict(enum.Enum):
    """ORT's ``OrtCompiledModelCompatibility`` values, by name."""

    EP_NOT_APPLICABLE = "EP_NOT_APPLICABLE"
    EP_SUPPORTED_OPTIMAL = "EP_SUPPORTED_OPTIMAL"
    EP_SUPPORTED_PREFER_RECOMPILATION = "EP_SUPPORTED_PREFER_RECOMPILATION"
    EP_UNSUPPORTED = "EP_UNSUPPORTED"


@dataclass(frozen=True)
class OrtCompatibility:
    """ORT's verdict on one compiled model for the EP's devices on this machine."""

    file: str
    verdict: OrtVerdict | None
    """None: not available here (``note`` says why)."""
    info: str | None = None
    """The compatibility info ORT read from the model, if any."""
    ep: str = ""
    """The EP name asked (the ``ep_compatibility_info.<ep>`` key)."""
    note: str = ""
    """Why there is no verdict; empty when there is one."""

    def problem(self) -> Problem | None:
        """``EP_UNSUPPORTED`` is an error, ``EP_SUPPORTED_PREFER_RECOMPILATION`` a warning."""
        if self.verdict is OrtVerdict.EP_UNSUPPORTED:
            message = (
                f"ONNX Runtime says the {self.ep} EP cannot run this compiled model on this "
                f"machine's devices (EP_UNSUPPORTED for {self.info!r}); rebuild it for them"
            )
            return Problem(self.file, message)
        if self.verdict is OrtVerdict.EP_SUPPORTED_PREFER_RECOMPILATION:
            message = (
                f"ONNX Runtime says the {self.ep} EP runs it but would do better recompiled "
                f"for this machine (EP_SUPPORTED_PREFER_RECOMPILATION for {self.info!r})"
            )
            return Problem(self.file, message, severity=Severity.WARNING)
        return None

    def to_json(self) -> dict[str, Any]:
        """The ``verify --json`` form (``verdict`` null when not available)."""
        return {
            "file": self.file,
            "ep": self.ep,
            "info": self.info,
            "verdict": self.verdict.value if self.verdict else None,
            "note": self.note,
        }


def _stored_info(read: Any, keys: Sequence[str], source: str | bytes) -> Any:
    """The compatibility info a model stored under the EP's name, else under an older name
    its outputs carried (``compatibility_keys``); None when it stored none."""
    for key in keys:
        info = read(source, key)
        if info is not None:
            return info
    return None


def ort_compatibility(
    file: str, path: str | os.PathLike[str], config: ProviderConfig, data: bytes | None = None
) -> OrtCompatibility:
    """ORT's verdict on the ctx model at ``path`` (or in ``data``) for ``config``'s EP; never
    raises: where ORT cannot judge, the verdict is None and ``note`` says why."""
    adapter = get_provider(config.ep)
    ep = adapter.compatibility_key(config)
    if ep is None:
        return OrtCompatibility(
            file, None, note=f"the {config.ep} EP records no compatibility info"
        )
    try:
        import onnxruntime as ort
        from onnxruntime.capi import onnxruntime_pybind11_state as capi
    except ImportError:
        return OrtCompatibility(file, None, ep=ep, note="onnxruntime is not installed")
    name = "get_compatibility_info_from_model" + ("_bytes" if data is not None else "")
    read, judge = (
        getattr(capi, name, None),
        getattr(capi, "get_model_compatibility_for_ep_devices", None),
    )
    if read is None or judge is None:
        note = f"onnxruntime {ort.__version__} has no compatibility API (1.23 or later has)"
        return OrtCompatibility(file, None, ep=ep, note=note)
    keys = adapter.compatibility_keys(config) or (ep,)
    try:
        info = _stored_info(read, keys, data if data is not None else os.fspath(path))
    except Exception as exc:  # ORT raises its own pybind classes
        return OrtCompatibility(
            file, None, ep=ep, note=f"ONNX Runtime cannot read it: {_first(exc)}"
        )
    if info is None:
        note = f"the model carries no ep_compatibility_info.{ep}"
        return OrtCompatibility(file, None, ep=ep, note=note)
    try:
        devices = _ep_devices(ort, config, ep)
    except EpbuildError as exc:
        return OrtCompatibility(file, None, str(info), ep, exc.message)
    except Exception as exc:  # a third-party adapter's attach may raise anything
        return OrtCompatibility(file, None, str(info), ep, f"no {ep} device: {_first(exc)}")
    if not devices:
        return OrtCompatibility(
            file, None, str(info), ep, f"ONNX Runtime lists no {ep} device here"
        )
    judged = adapter.compatibility_device_types
    if judged is not None:
        devices = [d for d in devices if d.device.type.name in judged]
        if not devices:
            kinds = "/".join(sorted(judged))
            note = f"the {ep} EP judges only {kinds} devices and this machine lists none"
            return OrtCompatibility(file, None, str(info), ep, note)
    try:
        verdict = judge(devices, info)
        found = OrtVerdict(verdict.name)
    except Exception as exc:  # the EP declines (QNN: no NPU device) or answers oddly
        note = f"the {ep} EP gives no verdict here: {_first(exc)}"
        return OrtCompatibility(file, None, str(info), ep, note)
    return OrtCompatibility(file, found, str(info), ep)


def _ep_devices(ort: Any, config: ProviderConfig, ep: str) -> list[Any]:
    """The EP's devices, after the adapter registered its library (a plugin EP lists none
    before): ``attach`` on a throwaway ``SessionOptions`` does exactly that."""
    get_provider(config.ep).attach(ort, ort.SessionOptions(), config)
    return [d for d in ort.get_ep_devices() if d.ep_name == ep]


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
