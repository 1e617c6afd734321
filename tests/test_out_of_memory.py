"""Out of memory in a compile names memory and what to do (epbuild/executors/outofmemory.py):
the QNN EP's QNN_COMMON_ERROR_MEM_ALLOC, std::bad_alloc, a thread refused for memory, a
MemoryError and the kernel's SIGKILL all read ``out of memory compiling X (peak ...)`` with
the hint to lower -j or give the build more memory (for an LLM: smaller pieces); only a
torch dynamo export keeps the hint about the EP's known failure on such graphs."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild.executors.outofmemory import (
    MemorySettings,
    explain,
    killed_cause,
    memory_hint,
    says_out_of_memory,
)
from epbuild.executors.worker import ort_failure
from epbuild.results import Outcome

CORPUS = Path(__file__).parent / "corpus"
QNN_MEM = (
    "[ONNXRuntimeError] : 11 : EP_FAIL : Failed to finalize QNN graph. Error: "
    "QNN_COMMON_ERROR_MEM_ALLOC"
)
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="ulimit -v through /proc")


@pytest.mark.parametrize(
    "text",
    [
        QNN_MEM,
        "[ONNXRuntimeError] : 1 : FAIL : Load model from m.onnx failed:std::bad_alloc",
        "pthread_create failed, error code: 12 error msg: Cannot allocate memory",
        "MemoryError: Unable to allocate 1.2 GiB for an array",
    ],
)
def test_memory_errors_are_recognised(text: str) -> None:
    assert says_out_of_memory(text)


def test_other_errors_are_not_memory() -> None:
    assert not says_out_of_memory("EP_FAIL : Failed to compose Qnn graph")
    assert not says_out_of_memory("the worker was killed by SIGSEGV while compiling m.onnx")


def test_the_message_names_memory_the_peak_and_the_settings() -> None:
    error, hint = explain(
        doing="compiling",
        what="models/decoder.onnx",
        peak=11_900 << 20,
        cause="ONNX Runtime failed: " + QNN_MEM,
        plan=MemorySettings(jobs=2, budget=12 << 30, predicted=6 << 30),
        limit=12 << 30,
    )
    assert error.startswith(
        "out of memory compiling models/decoder.onnx (peak 11.6 GB; address-space limit 12.0 GB)"
        ": ONNX Runtime failed: "
    )
    assert error.endswith("(memory budget 12.0 GB, -j 2, predicted 6.0 GB)")
    assert "lower -j" in hint and "more memory" in hint and "[llms" not in hint
    assert "dynamo" not in error + hint


def test_a_killed_worker_is_out_of_memory_most_likely() -> None:
    cause = killed_cause("the worker was killed by SIGKILL while compiling m/a.onnx", 3 << 30)
    assert cause == (
        "the worker was killed by SIGKILL after reaching that peak, most likely by the kernel "
        "for lack of memory"
    )
    assert "after reaching" not in killed_cause(None, 0)


def test_an_llm_is_told_to_make_its_pieces_smaller() -> None:
    hint = memory_hint("chat")
    assert "lower -j" in hint and "[llms.chat]" in hint
    assert "parts = N" in hint or "lower context_length" in hint


def test_qnn_mem_alloc_on_a_plain_model_is_out_of_memory(tmp_path: Path) -> None:
    import onnx

    model = tmp_path / "m.onnx"
    onnx.save(matmul_model(1), str(model))
    job = SimpleNamespace(compile=SimpleNamespace(disable_cpu_ep_fallback=False))
    failure = ort_failure(job, str(model), RuntimeError(QNN_MEM))  # type: ignore[arg-type]
    assert failure.memory and failure.hint is None


def test_qnn_mem_alloc_on_a_dynamo_export_keeps_its_own_hint() -> None:
    job = SimpleNamespace(compile=SimpleNamespace(disable_cpu_ep_fallback=False))
    model = str(CORPUS / "llama_dynamo_external.onnx")
    failure = ort_failure(job, model, RuntimeError(QNN_MEM))  # type: ignore[arg-type]
    assert not failure.memory
    assert failure.hint is not None and "seen with torch dynamo exports" in failure.hint


@linux_only
def test_a_compile_under_a_memory_cap_says_out_of_memory(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real cap (ulimit -v) on the worker, below the 32 MB the model needs: ONNX Runtime
    refuses the allocation (std::bad_alloc, or a thread: ENOMEM) inside the real compile."""
    workspace.model("m/big.onnx", matmul_model(1, n=2048))
    group = {"models": ["m/big.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    monkeypatch.setenv("EPBUILD_TEST_HOOK", "memcap:m/big.onnx:4")
    result = workspace.build(jobs=1, memory_budget=2 << 30)
    (bad,) = result.actions
    assert bad.outcome is Outcome.FAILED
    error = bad.error or ""
    assert error.startswith("out of memory compiling m/big.onnx (peak "), error
    assert "; address-space limit " in error and "ONNX Runtime failed: " in error, error
    assert "(memory budget " in error and ", -j 1" in error, error
    assert "lower -j" in (bad.hint or "") and "more memory" in (bad.hint or "")
    assert "dynamo" not in error + (bad.hint or "")


@linux_only
def test_an_llm_compile_under_a_memory_cap_names_the_entry(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace.llm("llama", share=False)
    monkeypatch.setenv("EPBUILD_TEST_HOOK", "memcap:prepared/context.onnx:4")
    proc = workspace.cli("build", "--no-cache")
    assert proc.returncode == 1, proc.stderr
    assert "out of memory compiling .epbuild/llm/chat/prepared/context.onnx (peak " in (proc.stderr)
    assert "[llms.chat]" in proc.stderr and "lower -j" in proc.stderr
    assert "dynamo" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_worker_killed_by_the_kernel_reads_out_of_memory(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL after growing (what the kernel's out-of-memory killer does): the same form."""
    workspace.model("m/a.onnx", matmul_model(1))
    group = {"models": ["m/a.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    monkeypatch.setenv("EPBUILD_TEST_HOOK", "oom:m/a.onnx:64")
    (bad,) = workspace.build(jobs=1).actions
    error = bad.error or ""
    assert error.startswith("out of memory compiling m/a.onnx (peak "), error
    assert "killed by SIGKILL after reaching that peak, most likely by the kernel" in error
    assert "lower -j" in (bad.hint or "") and "dynamo" not in error


@pytest.mark.parametrize(
    ("exc", "memory"),
    [
        (MemoryError(), True),
        (MemoryError("Unable to allocate 2.0 GiB"), True),
        (RuntimeError("Load model from m.onnx failed:std::bad_alloc"), True),
        (ValueError("a bug"), False),
    ],
)
def test_an_unexpected_error_is_memory_or_a_bug(
    tmp_path: Path, exc: Exception, memory: bool
) -> None:
    from epbuild.executors.worker import unexpected_failure

    job = SimpleNamespace(staging=str(tmp_path))
    try:
        raise exc
    except Exception as raised:
        failed = unexpected_failure(job, raised)  # type: ignore[arg-type]
    assert failed["ok"] is False and failed.get("out_of_memory", False) is memory
    assert ("traceback" in failed) is not memory
    if memory:
        assert failed["peak_rss"] > 0 and failed["error"].startswith(type(exc).__name__)
