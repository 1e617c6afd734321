"""What epbuild depends on fails: a Dask cluster without workers or that loses its scheduler,
a plugin EP library named relative to the manifest. Each ends in one message naming the
thing and what to do, with no traceback, no hang and no false verdict."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import Workspace
from llmfixture import TEXT_PROMPTS, chat_manifest, place_source
from modelgen import matmul_model

from epbuild.api import Outcome
from epbuild.errors import UserError

QNN_OPTIONS = {"backend_type": "htp", "htp_arch": "73", "soc_model": "60"}


# ---------------------------------------------------------------- plugin EP library


def test_a_plugin_library_relative_to_the_manifest_is_loaded(workspace: Workspace) -> None:
    """ONNX Runtime looks a relative library path up in its own directory: the library
    the setting names (it exists) must be what is loaded."""
    qnn = pytest.importorskip("onnxruntime_qnn")
    ws = workspace
    ws.model("models/c.onnx", matmul_model(3))
    (ws.root / "libs").mkdir()
    (ws.root / "libs" / "qnn").symlink_to(Path(qnn.get_library_path()).parent)
    library = "libs/qnn/" + Path(qnn.get_library_path()).name
    ws.manifest(
        {
            "providers": {
                "p": {
                    "ep": "plugin",
                    "library": library,
                    "ep_name": "QNNExecutionProvider",
                    "options": QNN_OPTIONS,
                }
            },
            "groups": {"g": {"models": ["models/c.onnx"], "providers": ["p"]}},
        }
    )
    proc = ws.cli("build")
    assert proc.returncode == 0, proc.stderr
    assert (ws.root / "build/g/p/c_ctx.onnx").is_file()


# ---------------------------------------------------------------- EP packages


def _shadow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rel: str, text: str) -> None:
    """A directory first on the ``PYTHONPATH`` of the processes a test starts, holding
    ``rel`` (a module that shadows an installed one, or a ``sitecustomize``)."""
    (tmp_path / "shadow" / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "shadow" / rel).write_text(text)
    path = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)


@pytest.mark.parametrize(
    ("rel", "text", "needle", "hint"),
    [
        (
            "onnxruntime_qnn/__init__.py",
            "raise ImportError('libQnnHtp.so: cannot open')\n",
            "onnxruntime-qnn is installed but does not import: ImportError: libQnnHtp.so",
            "--force-reinstall",
        ),
        (
            "sitecustomize.py",
            "import sys\nsys.modules['onnxruntime_qnn'] = None\n",
            "onnxruntime-qnn is not installed",
            'pip install "epbuild[qnn]"',
        ),
    ],
    ids=["broken", "missing"],
)
def test_a_qnn_package_that_does_not_import_is_not_called_missing(
    simple_ws: Callable[..., Workspace],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    rel: str,
    text: str,
    needle: str,
    hint: str,
) -> None:
    ws = simple_ws()
    _shadow(tmp_path, monkeypatch, rel, text)
    proc = ws.cli("build", "single")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in proc.stderr and hint in proc.stderr, proc.stderr
    assert not (ws.root / "build/single").exists()


def test_a_worker_environment_that_cannot_import_onnxruntime_is_named(
    simple_ws: Callable[..., Workspace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a toolchain whose packages were deleted after it was made does (a worker that
    dies importing onnxruntime): one message naming the environment and what to do, not
    the worker's traceback."""
    ws = simple_ws()
    _shadow(
        tmp_path,
        monkeypatch,
        "onnxruntime/__init__.py",
        "raise ImportError('libonnxruntime.so.1: cannot open shared object file')\n",
    )
    proc = ws.cli("build", "single")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        f"the worker's Python environment {sys.prefix} cannot import onnxruntime: "
        "ImportError: libonnxruntime.so.1" in proc.stderr
    ), proc.stderr
    assert "delete that directory and build again" in proc.stderr
    assert not (ws.root / "build/single").exists()


# ---------------------------------------------------------------- onnxruntime-genai

SHADOWS = {
    # a wheel that fails to import (a library it needs is missing)
    "broken": (
        "onnxruntime_genai/__init__.py",
        "raise ImportError('libonnxruntime-genai.so: "
        "cannot open shared object file: No such file or directory')\n",
    ),
    # not installed at all (find_spec sees nothing, an import fails)
    "missing": ("sitecustomize.py", "import sys\nsys.modules['onnxruntime_genai'] = None\n"),
}


@pytest.mark.parametrize(
    ("shadow", "needle"),
    [
        (
            "broken",
            "onnxruntime-genai is installed but does not import: ImportError: "
            "libonnxruntime-genai.so",
        ),
        ("missing", "verify --generate needs onnxruntime-genai"),
    ],
    ids=["broken", "missing"],
)
def test_verify_generate_without_a_usable_genai_is_a_user_error(
    llm_built: Workspace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shadow: str,
    needle: str,
) -> None:
    """Not "0 problems" and exit 0 with the check marked not checkable: the check asked
    for cannot run here, which is said once, exit 2."""
    _shadow(tmp_path, monkeypatch, *SHADOWS[shadow])
    proc = llm_built.cli("verify", "--generate", "--tokens", "2")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr
    assert proc.stderr.count("epbuild: error: ") == 1 and "hint: " in proc.stderr


@pytest.mark.parametrize(
    ("shadow", "needle"),
    [
        ("broken", "onnxruntime-genai is installed but does not import: ImportError: "),
        ("missing", "calibrating an LLM needs onnxruntime-genai"),
    ],
    ids=["broken", "missing"],
)
def test_calibrating_without_a_usable_genai_names_it(
    workspace: Workspace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shadow: str,
    needle: str,
) -> None:
    """A quantized LLM's calibration reads its prompts with genai's tokenizer: a genai that
    does not import is named with what to do, not a bare ``ImportError``."""
    place_source(workspace.root, "llama-text")
    shutil.copy(TEXT_PROMPTS, workspace.root / "prompts.txt")
    recipe = 'calibration = "prompts.txt"\nactivations = "uint16"\nweights = "uint8"\n'
    workspace.manifest(chat_manifest() + f'quantize = "w8a16"\n\n[quantization.w8a16]\n{recipe}')
    _shadow(tmp_path, monkeypatch, *SHADOWS[shadow])
    proc = workspace.cli("build")
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    assert "FAILED chat/calibrate" in proc.stderr and needle in proc.stderr, proc.stderr
    assert "hint: " in proc.stderr and "epbuild[genai]" in proc.stderr


# ---------------------------------------------------------------- Dask

distributed = pytest.importorskip("distributed")


@pytest.fixture
def scheduler() -> Iterator[str]:
    """An in-process Dask scheduler with no workers; yields its address."""
    with distributed.LocalCluster(
        n_workers=0,
        processes=False,
        protocol="tcp",
        host="127.0.0.1",
        dashboard_address=":0",
        silence_logs=50,
    ) as cluster:
        yield str(cluster.scheduler_address)


def test_a_scheduler_without_workers_is_named_not_waited_on_forever(
    simple_ws: Callable[..., Workspace], scheduler: str
) -> None:
    from epbuild.executors.dask import DaskExecutor

    ws = simple_ws()
    with pytest.raises(UserError) as info:
        DaskExecutor(str(ws.root), scheduler, worker_wait=1)
    assert f"the Dask scheduler at {scheduler} has no workers" in info.value.message
    assert info.value.hint and f"dask worker {scheduler}" in info.value.hint


def _worker(address: str, go: Path, *, nanny: bool = True) -> subprocess.Popen[bytes]:
    """A ``dask worker`` process whose compile of ``c.onnx`` waits until ``go`` exists."""
    env = {**os.environ, "EPBUILD_TEST_HOOK": f"wait:c.onnx:{go}"}
    args = [
        sys.executable,
        "-m",
        "distributed.cli.dask_worker",
        address,
        "--nthreads",
        "2",
        "--no-dashboard",
        *([] if nanny else ["--no-nanny"]),
    ]
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _compiling(worker: subprocess.Popen[bytes]) -> bool:
    """Whether a compile of epbuild runs under the Dask worker process."""
    import psutil

    try:
        children = psutil.Process(worker.pid).children(recursive=True)
        return any("executors.worker" in " ".join(c.cmdline()) for c in children)
    except psutil.Error:
        return False


def _stop(*procs: subprocess.Popen[Any]) -> None:
    for proc in procs:
        if proc.poll() is None:
            waits.kill_tree(proc.pid)
        proc.wait(timeout=waits.scaled(60))


@pytest.mark.slow
def test_the_last_worker_killed_mid_compile_fails_the_action_not_the_wait(
    simple_ws: Callable[..., Workspace], scheduler: str, tmp_path: Path
) -> None:
    """SIGKILL (the kernel's out-of-memory kill) of the only Dask worker: the task would
    wait for a worker forever; the action fails instead, naming the scheduler."""
    from epbuild.executors.dask import DaskExecutor

    ws = simple_ws()
    go = tmp_path / "go"
    worker = _worker(scheduler, go, nanny=False)
    executor: DaskExecutor | None = None
    try:
        executor = DaskExecutor(str(ws.root), scheduler, connect_timeout=waits.scaled(120))
        executor.grace = 2
        killed = threading.Event()

        def kill() -> None:
            waits.wait_for(
                lambda: _compiling(worker),
                "a compile under the Dask worker",
                proc=worker,
                timeout=240,
            )
            killed.set()
            worker.kill()

        thread = threading.Thread(target=kill, daemon=True)
        thread.start()
        result = ws.build("single", executor=executor)
        thread.join()
        assert killed.is_set()
    finally:
        go.touch()  # lets the orphaned compile end
        if executor is not None:
            executor.close()
        _stop(worker)
    [action] = result.actions
    assert action.outcome == Outcome.FAILED, action
    assert f"the Dask scheduler at {scheduler} has had no workers for 2 s" in (action.error or "")
    assert not (ws.root / "build/single").exists()


@pytest.mark.slow
def test_a_scheduler_that_dies_mid_compile_is_one_clear_failure(
    simple_ws: Callable[..., Workspace], tmp_path: Path
) -> None:
    ws = simple_ws()
    go, file = tmp_path / "go", tmp_path / "scheduler.json"
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker: subprocess.Popen[bytes] | None = None
    try:
        waits.wait_for(file.is_file, "the scheduler file", proc=scheduler, timeout=120)
        address = waits.wait_for(lambda: _address(file), "the scheduler's address")
        worker = _worker(address, go)
        build = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "epbuild",
                "-C",
                str(ws.root),
                "build",
                "-k",
                "--executor",
                "dask",
                "--scheduler",
                address,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        waits.wait_for(
            lambda: _compiling(worker), "a compile under the Dask worker", proc=build, timeout=240
        )
        scheduler.kill()
        _, err = waits.communicate(build, "the build after its scheduler died", timeout=240)
    finally:
        go.touch()
        _stop(scheduler, *([worker] if worker else []))
    assert build.returncode == 1, err
    assert "Traceback" not in err and "distributed.client" not in err, err
    assert f"lost the connection to the Dask scheduler at {address}" in err, err
    assert "check that the scheduler is running" in err
    assert "FAILED single/htp/c" in err and not (ws.root / "build/single").exists()


def _address(file: Path) -> str | None:
    import json

    try:
        return str(json.loads(file.read_text())["address"])
    except (ValueError, KeyError):
        return None  # half written
