"""The worker: one fresh process per action, compiling through real ONNX Runtime sessions.

Run as ``python -m epbuild.executors.worker`` with the workspace root as working directory. It reads
one JSON job line on stdin and keeps stdin open: when the coordinator dies, stdin closes and
the worker exits at once (no orphaned compiles). It writes the ctx models into the job's
staging directory, checks what it produced, and writes a JSON result file.
"""

from __future__ import annotations

import json
import os
import posixpath
import resource
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from epbuild._names import RESULT_NAME, ctx_name

if TYPE_CHECKING:
    from epbuild.providers.base import Provider, ProviderConfig


class CompileFailure(Exception):
    """The compile ran but did not produce a valid EPContext model."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def _watch_parent() -> None:
    # Block on stdin after the job line; EOF means the coordinator is gone.
    sys.stdin.buffer.read()
    os._exit(70)


def _test_hook(model: str) -> None:
    """A narrow seam for crash tests: ``EPBUILD_TEST_HOOK=KIND:SUBSTRING[:SECONDS]``.

    Before the session of a model whose path contains SUBSTRING: ``segv`` kills the worker
    with SIGSEGV, ``abort`` aborts it (what a crashing native SDK does), ``sleep`` waits
    SECONDS (a slow compile). Unset in normal use.
    """
    hook = os.environ.get("EPBUILD_TEST_HOOK")
    if not hook:
        return
    kind, _, rest = hook.partition(":")
    needle, _, arg = rest.partition(":")
    if not needle or needle not in model:
        return
    print(f"epbuild test hook: {kind} before compiling {model}", file=sys.stderr, flush=True)
    if kind == "segv":
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "abort":
        os.abort()
    elif kind == "sleep":
        time.sleep(float(arg or 1))


def compile_action(job: dict[str, Any]) -> dict[str, Any]:
    """Create the sessions of one action in order, destroy them in reverse, check outputs."""
    import onnxruntime as ort

    from epbuild.providers import get_provider
    from epbuild.providers.base import ProviderConfig

    p = job["provider"]
    config = ProviderConfig.from_json(p)
    adapter = get_provider(config.ep)
    staging = job["staging"]
    models: list[str] = job["models"]
    share = bool(job["share_weights"])
    sessions: list[Any] = []
    t0 = time.perf_counter()
    try:
        for index, model in enumerate(models):
            so = ort.SessionOptions()
            ctx_path = posixpath.join(staging, ctx_name(model))
            entries = {
                "ep.context_enable": "1",
                "ep.context_file_path": ctx_path,
                "ep.context_embed_mode": str(job["embed_mode"]),
            }
            if job.get("node_name_prefix"):
                entries["ep.context_node_name_prefix"] = job["node_name_prefix"]
            if job.get("external_initializers"):
                entries["ep.context_model_external_initializers_file_name"] = job[
                    "external_initializers_names"
                ][index]
            if share:
                entries["ep.share_ep_contexts"] = "1"
                if index == len(models) - 1:
                    entries["ep.stop_share_ep_contexts"] = "1"
            if job["load"] == "bytes":
                entries["session.model_external_initializers_file_folder_path"] = (
                    posixpath.dirname(model) or "."
                )
            entries.update(config.session_options)
            for k, v in entries.items():
                so.add_session_config_entry(k, v)
            extra = adapter.context_options(config, ctx_path, int(job["embed_mode"]))
            adapter.attach(ort, so, _with_options(config, extra) if extra else config)
            _test_hook(model)
            try:
                if job["load"] == "bytes":
                    with open(model, "rb") as f:
                        sessions.append(ort.InferenceSession(f.read(), so))
                else:
                    sessions.append(ort.InferenceSession(model, so))
            except Exception as exc:
                raise CompileFailure(f"{model}: ONNX Runtime failed: {_ort_message(exc)}") from exc
    finally:
        while sessions:  # reverse order of creation
            sessions.pop()
    seconds = time.perf_counter() - t0
    detail = check_outputs(staging, models, adapter, config)
    return {
        "ok": True,
        "seconds": seconds,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "detail": detail,
    }


def _ort_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _with_options(config: Any, extra: dict[str, str]) -> Any:
    from dataclasses import replace

    return replace(config, options={**config.options, **extra})


def check_outputs(
    staging: str, models: list[str], adapter: Provider, config: ProviderConfig
) -> dict[str, Any]:
    """Never trust a successful return: every ctx model must hold the provider's EPContext
    nodes. Returns the build detail (node counts, CPU fallback, compatibility info)."""
    from epbuild.onnx.context import COMPAT_PREFIX, missing_context, source_problems
    from epbuild.onnx.proto import ProtoError, read_model

    key = adapter.compatibility_key(config)
    detail: dict[str, Any] = {"models": {}}
    for model in models:
        ctx = posixpath.join(staging, ctx_name(model))
        if not os.path.exists(ctx):
            raise CompileFailure(
                f"{model}: no EPContext model was written — the EP compiled nothing and ONNX "
                "Runtime silently ran the model on the CPU EP",
                hint="check for unsupported ops or dynamic (symbolic) input dimensions, and "
                "the provider options (an unknown soc_model or backend makes the EP fall back)",
            )
        try:
            info = read_model(ctx)
            src = read_model(model)
        except ProtoError as exc:
            raise CompileFailure(f"{ctx}: unreadable ctx model: {exc}") from exc
        missing = missing_context(ctx, info)
        if missing is not None:
            raise CompileFailure(
                f"{model}: the ctx model {missing.message} — nothing was compiled by the EP",
                hint="the model's ops are probably unsupported by this EP",
            )
        wrong = source_problems(ctx, info, adapter.context_source(config), config.ep)
        if wrong:
            raise CompileFailure(
                f"{model}: EPContext node {wrong[0].node}: source {wrong[0].message}"
            )
        nodes = info.context_nodes
        cpu_ops = {op: n for op, n in info.op_types.items() if not op.endswith("EPContext")}
        detail["models"][model] = {
            "ctx": posixpath.basename(ctx),
            "context_nodes": len(nodes),
            "source_nodes": src.node_count,
            "cpu_nodes": sum(cpu_ops.values()),
            "cpu_op_types": cpu_ops,
            "node_names": [n.name for n in nodes],
            "compatibility": info.metadata.get(COMPAT_PREFIX + key) if key else None,
        }
    return detail


def main() -> None:
    """Entry point: read one job line, compile, write the result file."""
    import onnxruntime  # noqa: F401  (import first: the bulk of the start-up cost)

    line = sys.stdin.buffer.readline()
    threading.Thread(target=_watch_parent, daemon=True).start()
    job = json.loads(line)
    result_path = posixpath.join(job["staging"], RESULT_NAME)
    try:
        result = compile_action(job)
    except CompileFailure as exc:
        result = {"ok": False, "error": str(exc), "hint": exc.hint}
    except Exception as exc:
        from epbuild.errors import EpbuildError

        if isinstance(exc, EpbuildError):
            result = {"ok": False, "error": exc.message, "hint": exc.hint}
        else:
            result = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
    with open(result_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
