"""The manifest defaults that depend on the machine rather than on the manifest: how many
compiles run at once, and which compiler the installed ONNX Runtime offers (read from its
dist-info, never imported). Everything else ``manifest.load`` fills in is fixed."""

from __future__ import annotations

import os

from epbuild.providers.distributions import has_compile_api, onnxruntime_version


def default_jobs() -> int:
    """``workspace.jobs`` when unset: one compile per CPU."""
    return os.cpu_count() or 1


def compile_api_missing() -> str | None:
    """Why this environment's ONNX Runtime cannot compile through the compile API (None when
    it can)."""
    if has_compile_api():
        return None
    return (
        f"onnxruntime {onnxruntime_version()} has no compile API with the options epbuild "
        "needs (onnxruntime 1.23 or newer)"
    )


def default_compiler(adapter_can_use_api: bool) -> str:
    """``compiler`` when unset, for a provider without a toolchain: the compile API where the
    installed ONNX Runtime has it and the adapter can use it, else sessions."""
    return "compile_api" if adapter_can_use_api and has_compile_api() else "session"
