"""Out of memory in a worker: telling it apart from other failures, and saying so.

A compile that runs out of memory ends one of four ways: the QNN EP's
``QNN_COMMON_ERROR_MEM_ALLOC`` (it failed to finalize the graph: measured on a 0.5B decoder
under a 12 GB cap, ORT-QNN-FACTS), ONNX Runtime's ``std::bad_alloc`` or ``Cannot allocate
memory`` (an allocation or a thread refused, as under ``ulimit -v``), Python's
``MemoryError``, or the kernel's out-of-memory killer (SIGKILL). Each is reported as ``out of
memory <doing> <model> (peak ...)`` with what to change. One exception: the QNN error on a
torch dynamo export is a known failure of the EP on such graphs at any size (a few hundred MB
of peak), which keeps its own hint (``docs/troubleshooting.md#qnn-mem-alloc``).
"""

from __future__ import annotations

from epbuild._dataclass import dataclass
from epbuild.fs import format_bytes

QNN_MEM_ALLOC = "QNN_COMMON_ERROR_MEM_ALLOC"
"""The QNN EP's error when it fails to finalize a graph it accepted (``EP_FAIL``)."""
MEMORY_MARKERS = (QNN_MEM_ALLOC, "std::bad_alloc", "Cannot allocate memory", "MemoryError")
"""Text of an error that ran out of memory (ONNX Runtime's, the EP's, Python's)."""
DYNAMO_METADATA = "pkg.torch.onnx."
"""Prefix of the node metadata keys torch's dynamo exporter writes (stack traces, scopes)."""


def says_out_of_memory(text: str) -> bool:
    """Whether an error's text is one of running out of memory."""
    return any(marker in text for marker in MEMORY_MARKERS)


def dynamo_export(model: str) -> bool | None:
    """Whether ``model`` was written by torch's dynamo exporter (its nodes carry
    ``pkg.torch.onnx.*`` metadata); None when it cannot be read."""
    from epbuild.onnx.proto import ProtoError, read_model  # the worker's failure path only

    try:
        info = read_model(model, strings=True)
    except (OSError, ProtoError):
        return None
    return any(f.field.startswith(f"metadata_props['{DYNAMO_METADATA}") for f in info.strings)


def address_space_limit() -> int:
    """This process's address-space limit (``ulimit -v``) in bytes, 0 when there is none."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return 0 if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


@dataclass(frozen=True)
class MemorySettings:
    """What the build allowed when a worker ran out of memory."""

    jobs: int | None
    budget: int | None
    """The memory budget (None: none)."""
    predicted: int = 0
    """The peak predicted for the action (0: none)."""


def explain(
    *,
    doing: str,
    what: str,
    peak: int,
    cause: str,
    plan: MemorySettings,
    llm: str | None = None,
    limit: int = 0,
) -> tuple[str, str]:
    """(error, hint) of a worker that ran out of memory ``doing`` (``compiling``) ``what``
    (a model, an action), after reaching ``peak`` bytes (0: not known), for ``cause`` (the
    error, or how the worker was killed). ``llm``: the ``[llms]`` entry it belongs to;
    ``limit``: the worker's address-space limit (0: none)."""
    reached = format_bytes(peak) if peak else "not known"
    capped = f"; address-space limit {format_bytes(limit)}" if limit else ""
    budget = (
        f"memory budget {format_bytes(plan.budget)}" if plan.budget is not None else "no budget"
    )
    jobs = f", -j {plan.jobs}" if plan.jobs is not None else ""
    guess = f", predicted {format_bytes(plan.predicted)}" if plan.predicted else ""
    setting = f"{budget}{jobs}{guess}"
    return f"out of memory {doing} {what} (peak {reached}{capped}): {cause} ({setting})", (
        memory_hint(llm)
    )


def killed_cause(error: str | None, peak: int) -> str:
    """What to say of a worker ended by SIGKILL: what the kernel does when memory runs out."""
    how = (error or "the worker was killed by SIGKILL").split(" while ", 1)[0]
    after = " after reaching that peak" if peak else ""
    return f"{how}{after}, most likely by the kernel for lack of memory"


def memory_hint(llm: str | None) -> str:
    """What to change: fewer compiles at once, more memory, and for an LLM smaller parts
    (``parts`` on ``[llms.X]``) or a shorter context."""
    hint = (
        "build with a lower -j (or a --memory-budget that fits this machine), or give the "
        "build more memory (its memory cap: ulimit -v, the container's limit)"
    )
    if llm is None:
        return hint
    return (
        f"{hint}; an LLM needs memory in proportion to its size and context_length: split it "
        f"into more parts (parts = N on [llms.{llm}]) or lower context_length"
    )


def strip_model(error: str, model: str | None) -> str:
    """``error`` without the ``<model>: `` it starts with (the message names it already)."""
    if model and error.startswith(model + ": "):
        return error[len(model) + 2 :]
    return error
