"""The worker: one fresh process per action, running its job's runner; and the compile
kind's runner, compiling with ONNX Runtime's compile API or sessions.

Run as ``python -m epbuild.executors.worker`` with the workspace root as working directory. It reads
one JSON job line on stdin and keeps stdin open: when the coordinator dies, stdin closes and
the worker exits at once (no orphaned compiles). The job's runner writes the outputs into the
job's staging directory (a compile: the ctx models, checked here), and the worker writes a
JSON result file.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import posixpath
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from epbuild._names import RESULT_NAME, ctx_name, ctx_stem, model_label
from epbuild.docsite import page_url
from epbuild.errors import ActionFailedError, EpbuildError
from epbuild.executors.hostinfo import peak_rss, write_trouble
from epbuild.executors.job import Job
from epbuild.executors.outofmemory import (
    QNN_MEM_ALLOC,
    address_space_limit,
    dynamo_export,
    says_out_of_memory,
)
from epbuild.executors.testhooks import hook_for, run_test_hook
from epbuild.fs import atomic_write_text
from epbuild.kinds.compilework import CompileWork

if TYPE_CHECKING:
    from epbuild.onnx.proto import ModelInfo
    from epbuild.providers.contract import Provider, ProviderConfig


class CompileFailure(ActionFailedError):
    """The compile ran but did not produce a valid EPContext model."""

    def __init__(self, message: str, hint: str | None = None, *, memory: bool = False) -> None:
        super().__init__(message, hint=hint)
        self.memory = memory
        """It ran out of memory (``executors.outofmemory``)."""


def _watch_parent() -> None:
    # Block on stdin after the job line; EOF means the coordinator is gone.
    sys.stdin.buffer.read()
    os._exit(70)


COMPILING = "epbuild: compiling "
"""What the worker writes to its log before each model's compile (`say_compiling`): a
worker that dies inside the EP (a native crash) then still names the model it was on."""


def say_compiling(model: str) -> None:
    """Log the model about to be compiled (read back by ``executors.local.outcome_of``)."""
    print(COMPILING + model, file=sys.stderr, flush=True)


NOTHING_COMPILED = "Unable to compile any nodes"
"""ONNX Runtime's message when ``ERROR_IF_NO_NODES_COMPILED`` fails a compile."""
FALLBACK_REFUSED = "fallback to CPU EP has been explicitly disabled"
"""ONNX Runtime's message when ``session.disable_cpu_ep_fallback`` fails a compile."""
OPTIMIZATION_LEVELS = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
"""Manifest ``graph_optimization_level`` → ``onnxruntime.GraphOptimizationLevel`` member."""


AUTO_LEVELS = ("all", "basic", "disabled")
"""What ``graph_optimization_level = "auto"`` tries, in order: the next only while nodes are
left on the CPU EP."""


def run_compile(job: Job, root: str) -> dict[str, Any]:
    """The compile kind's runner (``root``: this process's working directory)."""
    return compile_action(CompileWork.from_job(job))


def compile_action(job: CompileWork) -> dict[str, Any]:
    """Compile the models of one action in order with the job's compiler, check outputs."""
    t0 = time.perf_counter()
    if job.compile.graph_optimization_level == "auto":
        detail = _compile_auto(job)
    else:
        detail = _compile_checked(job)
    detail["compiler"] = job.compile.compiler
    seconds = time.perf_counter() - t0
    return {
        "ok": True,
        "seconds": seconds,
        "detail": detail,
        "versions": compiled_with(job.provider),
    }


def compiled_with(config: ProviderConfig) -> dict[str, str]:
    """The versions this process compiled with, under the names an action key gives them
    (``KeyComputer.versions``): read here, in the worker's own environment — a farm's or a
    toolchain's — never taken from the coordinator."""
    from epbuild.planning.keys import ORT_KEY, with_library
    from epbuild.providers import get_provider
    from epbuild.providers.distributions import onnxruntime_version

    adapter = get_provider(config.ep)
    found = with_library(adapter, config, dict(adapter.versions(config)))
    found[ORT_KEY] = onnxruntime_version()
    found["python"] = ".".join(map(str, sys.version_info[:3]))
    return found


def _epbuild_version() -> str:
    from epbuild._version import __version__

    return __version__


def _compile_checked(job: CompileWork) -> dict[str, Any]:
    """Compile the job into its staging directory; the checked outputs' detail."""
    import onnxruntime as ort

    from epbuild.providers import get_provider

    config = job.provider
    adapter = get_provider(config.ep)
    if job.compile.compiler == "compile_api":
        _compile_with_api(ort, job, adapter)
    else:
        _compile_with_sessions(ort, job, adapter)
    if job.context.share_weights:
        adapter.finish_sharing_group(
            config, [posixpath.join(job.staging, n) for n in job.ctx_names]
        )
    return check_outputs(
        job.staging,
        list(job.models),
        adapter,
        config,
        job.context.share_weights,
        list(job.ctx_names),
    )


def _compile_auto(job: CompileWork) -> dict[str, Any]:
    """``graph_optimization_level = "auto"``: compile at ``all``; only where nodes are left
    on the CPU EP, also at ``basic`` and ``disabled`` (each in a folder of its own and a
    process of its own: the EP crashes on some graphs at lower levels, which must cost only
    that try), and keep the result with the fewest CPU nodes, then the fewest EPContext
    nodes (the earlier level on a tie). Where ``all`` fails (ORT's fusions can make an op
    the EP refuses out of ops it takes, e.g. a rank-5 LayerNormalization), the lower levels
    are tried too; only when every level fails does the action fail, with ``all``'s error.
    The detail records the choice and every try."""
    import shutil
    from dataclasses import replace

    def score(detail: dict[str, Any]) -> tuple[int, int]:
        models = detail["models"].values()
        return sum(m["cpu_nodes"] for m in models), sum(m["context_nodes"] for m in models)

    best: dict[str, Any] | None = None
    failure: EpbuildError | None = None
    try:
        best = _compile_checked(
            replace(job, compile=replace(job.compile, graph_optimization_level="all"))
        )
        tried: dict[str, list[int] | str] = {"all": list(score(best))}
    except EpbuildError as exc:  # a CompileFailure among them
        failure = exc
        tried = {"all": f"failed: {exc.message}"}
    level = "all"
    for lower in AUTO_LEVELS[1:]:
        if best is not None and score(best)[0] == 0:
            break
        staging = posixpath.join(job.staging, f".auto-{lower}")
        outcome = _try_level(job, lower, staging)
        if isinstance(outcome, str):
            tried[lower] = outcome
            continue
        tried[lower] = list(score(outcome))
        if best is None or score(outcome) < score(best):
            best, level = outcome, lower
    if best is None:  # no level built: the action fails as it would at "all"
        for lower in AUTO_LEVELS[1:]:
            shutil.rmtree(posixpath.join(job.staging, f".auto-{lower}"), ignore_errors=True)
        assert failure is not None
        raise failure
    if level != "all":  # the chosen outputs replace those of "all"
        chosen = posixpath.join(job.staging, f".auto-{level}")
        for name in os.listdir(job.staging):
            if not name.startswith(".auto-"):
                os.unlink(posixpath.join(job.staging, name))
        for name in os.listdir(chosen):
            os.replace(posixpath.join(chosen, name), posixpath.join(job.staging, name))
    for lower in AUTO_LEVELS[1:]:
        shutil.rmtree(posixpath.join(job.staging, f".auto-{lower}"), ignore_errors=True)
    for model in best["models"].values():
        model["optimization_level"] = level
    return {**best, "optimization_level": level, "optimization_tried": tried}


def _try_level(job: CompileWork, level: str, staging: str) -> dict[str, Any] | str:
    """Compile the job at ``level`` into ``staging`` in a child worker; its checked detail,
    or why it failed."""
    import subprocess
    from dataclasses import replace

    os.makedirs(staging, exist_ok=True)
    attempt = replace(
        job, staging=staging, compile=replace(job.compile, graph_optimization_level=level)
    )
    home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"import sys; sys.path.insert(0, {home!r}); from {__name__} import main; main()"
    sys.stdout.flush()
    sys.stderr.flush()
    # Its output goes to this worker's log.
    with subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE) as child:
        assert child.stdin is not None
        child.stdin.write(json.dumps(attempt.as_job().to_json()).encode() + b"\n")
        child.stdin.flush()
        code_ = child.wait()  # its stdin stays open until it ends (it exits when it closes)
    try:
        with open(posixpath.join(staging, RESULT_NAME), encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        return f"failed (exit status {code_})" if code_ >= 0 else f"crashed (signal {-code_})"
    if not result.get("ok"):
        return f"failed: {result.get('error', '?')}"
    os.unlink(posixpath.join(staging, RESULT_NAME))
    detail: dict[str, Any] = result["detail"]
    return detail


def _compile_with_sessions(ort: Any, job: CompileWork, adapter: Provider) -> None:
    """Create the sessions in order (each writes its ctx model), destroy them in reverse."""
    sessions: list[Any] = []
    try:
        for index, model in enumerate(job.models):
            so = session_options(ort, job, index, adapter)
            say_compiling(model)
            run_test_hook(model)
            # No local name for a session: it would outlive the reverse teardown below (and,
            # through a traceback, the failure of the next one). tests/test_worker_teardown.
            sessions.append(_open_session(ort, job, job.repeat_prefix(index) + model, so))
    finally:
        while sessions:  # reverse order of creation; the pop drops the last reference
            sessions.pop()


def _compile_with_api(ort: Any, job: CompileWork, adapter: Provider) -> None:
    """One ``onnxruntime.ModelCompiler`` per model, in order. A sharing group is the loop
    ONNX Runtime recommends in place of its ``ep_weight_sharing_ctx_gen`` tool: the same
    ``ep.share_ep_contexts`` entries as sessions, the stop entry on the last model."""
    for index, model in enumerate(job.models):
        so = session_options(ort, job, index, adapter)
        say_compiling(model)
        run_test_hook(model)
        _compile_model(ort, job, index, so)


def session_options(ort: Any, job: CompileWork, index: int, adapter: Provider) -> Any:
    """The ``SessionOptions`` that compile model ``index`` of the job, for either compiler:
    config entries, graph optimisation level, threads, and the EP attached."""
    so = ort.SessionOptions()
    ctx_path = posixpath.join(job.staging, job.ctx_names[index])
    for k, v in _session_entries(job, index, ctx_path).items():
        so.add_session_config_entry(k, v)
    for dim, value in job.free_dimensions_of(index).items():
        so.add_free_dimension_override_by_name(dim, value)
    settings = job.compile
    so.graph_optimization_level = _optimization_level(ort, settings.graph_optimization_level)
    if settings.intra_op_num_threads is not None:
        so.intra_op_num_threads = settings.intra_op_num_threads
    config = job.provider
    extra = {}
    if settings.compiler == "session":  # the compile API sets the ctx output itself
        extra = adapter.context_options(config, ctx_path, job.context.embed_mode)
    adapter.attach(ort, so, _with_options(config, extra) if extra else config)
    return so


def _optimization_level(ort: Any, level: str | None) -> Any:
    return getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[level or "all"])


def _session_entries(job: CompileWork, index: int, ctx_path: str) -> dict[str, str]:
    """The session config entries of model ``index`` of the job: with sessions, those that
    make it write its ctx model; with either compiler, sharing and session settings."""
    model = job.models[index]
    settings = job.compile
    entries: dict[str, str] = {}
    if settings.compiler == "session":
        entries["ep.context_enable"] = "1"
        entries["ep.context_file_path"] = ctx_path
        entries["ep.context_embed_mode"] = str(job.context.embed_mode)
        if job.initializer_names:
            name = job.initializer_names[index]
            entries["ep.context_model_external_initializers_file_name"] = name
    if job.context.node_name_prefix:
        entries["ep.context_node_name_prefix"] = job.context.node_name_prefix
    if job.context.share_weights and (hook_for(model) or ("",))[0] != "noshare":
        entries["ep.share_ep_contexts"] = "1"
        if index == len(job.models) - 1:
            entries["ep.stop_share_ep_contexts"] = "1"
    if job.context.load == "bytes":
        folder = job.repeat_prefix(index) + (
            settings.external_data_folder or posixpath.dirname(model) or "."
        )
        entries["session.model_external_initializers_file_folder_path"] = folder
    if settings.disable_cpu_ep_fallback:
        entries["session.disable_cpu_ep_fallback"] = "1"
    entries.update(job.provider.session_options)
    return entries


def _open_session(ort: Any, job: CompileWork, model: str, so: Any) -> Any:
    """One session (the compile happens here); an ONNX Runtime error is a CompileFailure."""
    try:
        if job.context.load == "bytes":
            with open(model, "rb") as f:
                return ort.InferenceSession(f.read(), so)
        return ort.InferenceSession(model, so)
    except Exception as exc:
        raise ort_failure(job, model, exc) from exc


ESCAPES_FOLDER = "External data path escapes model directory"
"""ONNX Runtime's words for external data it refuses to read: outside the model's folder,
through a symbolic link."""


def ort_failure(job: CompileWork, model: str, exc: Exception) -> CompileFailure:
    """The failure of an ONNX Runtime error while compiling ``model``."""
    hint = None
    if job.compile.disable_cpu_ep_fallback and FALLBACK_REFUSED in str(exc):
        hint = (
            "disable_cpu_ep_fallback = true refuses a model with nodes the EP cannot take; "
            "set it to false to leave them on the CPU EP"
        )
    elif ESCAPES_FOLDER in str(exc):
        hint = (
            "ONNX Runtime reads external data only from inside the model's folder, and this "
            "data file is a symbolic link that leads out of it: keep the file itself, or a "
            "hard link to it, beside the model (a DVC checkout: cache.type = hardlink or copy)"
        )
    elif QNN_MEM_ALLOC in str(exc):
        dynamo = dynamo_export(model)  # out of memory, unless a known failure of the EP
        if dynamo is not False:  # a dynamo export, or a model that cannot be read
            seen = "seen with torch dynamo exports" if dynamo else "memory, or a dynamo export"
            hint = (
                f"the QNN EP could not finalize this graph ({seen}); "
                f"see {page_url('troubleshooting.md', 'qnn-mem-alloc')}"
            )
    memory = hint is None and says_out_of_memory(str(exc))
    message = f"{model}: ONNX Runtime failed: {_ort_message(exc)}"
    return CompileFailure(message, hint, memory=memory)


def _compile_model(ort: Any, job: CompileWork, index: int, so: Any) -> None:
    """Compile model ``index`` with the compile API; it fails when no node was compiled."""
    # A source repeated in the group gets a distinct path spelling (``Job.repeat_prefix``):
    # the EP names its graphs by the path, and one shared context cannot hold two of a name.
    model = job.repeat_prefix(index) + job.models[index]
    ctx_path = posixpath.join(job.staging, job.ctx_names[index])
    options: dict[str, Any] = {}
    if job.initializer_names:
        # Relative to the ctx model's folder; threshold 0 moves every CPU-side
        # initializer, as ep.context_model_external_initializers_file_name does.
        options["external_initializers_file_path"] = job.initializer_names[index]
        options["external_initializers_size_threshold"] = 0
    try:
        if job.context.load == "bytes":
            with open(model, "rb") as f:
                source: str | bytes = f.read()
        else:
            source = model
        compiler = ort.ModelCompiler(
            so,
            source,
            embed_compiled_data_into_model=job.context.embed_mode == 1,
            flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED,
            graph_optimization_level=_optimization_level(ort, job.compile.graph_optimization_level),
            **options,
        )
        compiler.compile_to_file(ctx_path)
    except Exception as exc:
        if NOTHING_COMPILED in str(exc):
            raise nothing_compiled(model, "(ONNX Runtime: unable to compile any nodes)") from exc
        raise ort_failure(job, model, exc) from exc


def nothing_compiled(model: str, how: str) -> CompileFailure:
    """The failure of a model the EP compiled no node of."""
    return CompileFailure(
        f"{model}: no EPContext model was written — the EP compiled nothing {how}",
        hint="check for unsupported ops or dynamic (symbolic) input dimensions, and "
        "the provider options (an unknown soc_model or backend makes the EP fall back); "
        f"see {page_url('troubleshooting.md', 'the-ep-compiled-nothing')}",
    )


def _ort_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _with_options(config: Any, extra: dict[str, str]) -> Any:
    from dataclasses import replace

    return replace(config, options={**config.options, **extra})


def check_outputs(
    staging: str,
    models: list[str],
    adapter: Provider,
    config: ProviderConfig,
    share_weights: bool = False,
    ctx_names: list[str] | None = None,
) -> dict[str, Any]:
    """Never trust a successful return: every ctx model must hold the provider's EPContext
    nodes, and a weight-sharing group's must all reference one binary. Returns the build
    detail (node counts, CPU fallback, compatibility info), per model under its
    ``model_label``. ``ctx_names``: the ctx model of each model (default: its file stem's)."""
    from epbuild.onnx.context import sharing_problems

    detail: dict[str, Any] = {"models": {}}
    infos: list[ModelInfo] = []
    names = ctx_names if ctx_names is not None else [ctx_name(m) for m in models]
    for model, ctx_file in zip(models, names, strict=True):
        label = model_label(model, ctx_stem(ctx_file))
        info, detail["models"][label] = _checked_ctx(
            posixpath.join(staging, ctx_file), model, label, adapter, config
        )
        infos.append(info)
    if share_weights:
        shared = sharing_problems(names, infos, adapter, config)
        if shared:
            raise CompileFailure(
                shared[0].line(),
                hint="compile this group with an EP version that supports "
                "ep.share_ep_contexts, or set share_weights = false",
            )
    return detail


def _checked_ctx(
    ctx: str, model: str, label: str, adapter: Provider, config: ProviderConfig
) -> tuple[ModelInfo, dict[str, Any]]:
    """One model's ctx model, read and checked (it exists, holds EPContext nodes of this
    EP), and its build detail."""
    from epbuild.onnx.context import compatibility_entry, missing_context, source_problems
    from epbuild.onnx.proto import ProtoError, read_model

    if not os.path.exists(ctx):
        raise nothing_compiled(label, "and ONNX Runtime silently ran the model on the CPU EP")
    try:
        info = read_model(ctx)
        src = read_model(model)
    except ProtoError as exc:
        raise CompileFailure(f"{ctx}: unreadable ctx model: {exc}") from exc
    missing = missing_context(ctx, info)
    if missing is not None:
        raise CompileFailure(
            f"{label}: the ctx model {missing.message} — nothing was compiled by the EP",
            hint="the model's ops are probably unsupported by this EP",
        )
    wrong = source_problems(ctx, info, adapter, config)
    if wrong:
        raise CompileFailure(f"{label}: EPContext node {wrong[0].node}: source {wrong[0].message}")
    cpu_ops = {op: n for op, n in info.op_types.items() if not op.endswith("EPContext")}
    return info, {
        "ctx": posixpath.basename(ctx),
        "context_nodes": len(info.context_nodes),
        "source_nodes": src.node_count,
        "cpu_nodes": sum(cpu_ops.values()),
        "cpu_op_types": cpu_ops,
        "cpu_ops_in_source": sorted(op for op in cpu_ops if "::" in op and op in src.op_types),
        "node_names": [n.name for n in info.context_nodes],
        "compatibility": compatibility_entry(info.metadata, adapter, config)[1],
    }


def main() -> None:
    """Entry point: read one job line, run it, write the result file."""
    import epbuild._stacks as _stacks

    _stacks.register()
    unusable: ImportError | None = None
    try:
        import onnxruntime  # noqa: F401  (import first: the bulk of the start-up cost)
    except ImportError as exc:  # said as the job's failure, naming the environment
        unusable = exc

    line = sys.stdin.buffer.readline()
    threading.Thread(target=_watch_parent, daemon=True).start()
    job = Job.from_json(json.loads(line))
    result = result_of(job, ".") if unusable is None else _no_onnxruntime(job, unusable)
    result_path = posixpath.join(job.staging, RESULT_NAME)
    try:
        atomic_write_text(result_path, json.dumps(result), durable=False)
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError as exc:  # a full disk: the coordinator finds why (``write_trouble``)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"epbuild worker: cannot write its result: {exc}\n")
            sys.stderr.flush()
        os._exit(NO_RESULT)  # never the interpreter's shutdown, which aborts on a full disk
    os._exit(0 if result["ok"] else 1)


def _no_onnxruntime(job: Job, exc: ImportError) -> dict[str, Any]:
    """The failed result of a worker whose Python environment cannot import onnxruntime:
    a toolchain damaged after it was made (a package deleted), a broken install."""
    return _failure(
        job,
        f"the worker's Python environment {sys.prefix} cannot import onnxruntime: "
        f"{type(exc).__name__}: {exc}",
        "if it is a toolchain epbuild made, delete that directory and build again (it is "
        "made anew); otherwise reinstall onnxruntime there",
    )


NO_RESULT = 75
"""The worker's exit status when it could not write its result document."""


def result_of(job: Job, root: str) -> dict[str, Any]:
    """The result document of a job: what its runner reports, or why it failed (an
    ``EpbuildError``: the message, hint and exit code; anything else: a bug, with its
    traceback)."""
    module, _, name = job.runner.partition(":")
    try:
        report = getattr(importlib.import_module(module), name)(job, root)
    except EpbuildError as exc:  # a user error (a bad sample, say) keeps its exit code
        memory = isinstance(exc, CompileFailure) and exc.memory
        failed = _failure(job, exc.message, exc.hint, memory=memory)
        return {**failed, "exit_code": exc.exit_code}
    except Exception as exc:
        return unexpected_failure(job, exc)
    return {"ok": True, "peak_rss": peak_rss(), **report, "epbuild": _epbuild_version()}


def unexpected_failure(job: Job, exc: Exception) -> dict[str, Any]:
    """The failed result of an error no check expected: out of memory (a ``MemoryError``,
    an ``std::bad_alloc`` from native code), else a bug, with its traceback."""
    text = f"{type(exc).__name__}: {exc}".removesuffix(": ")
    if isinstance(exc, MemoryError) or says_out_of_memory(text):
        return _failure(job, text, None, memory=True)
    return {**_failure(job, text, None), "traceback": traceback.format_exc()}


def _failure(job: Job, error: str, hint: str | None, *, memory: bool = False) -> dict[str, Any]:
    """A failed result; says so when a write limit explains it (an EP's own message, such
    as ONNX Runtime's "Failed to write context cache file", often does not). ``memory``:
    it ran out of memory, which the coordinator explains (``executors.outofmemory``) with
    the peak and the limit given here."""
    trouble = write_trouble(job.staging)
    if trouble is not None:
        error, hint = f"{error} ({trouble[0]})", trouble[1]
    failed: dict[str, Any] = {"ok": False, "error": error, "hint": hint}
    if memory and trouble is None:
        failed.update(out_of_memory=True, peak_rss=peak_rss(), memory_limit=address_space_limit())
    return failed


if __name__ == "__main__":
    main()
