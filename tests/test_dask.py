"""The Dask executor against a real two-worker LocalCluster (processes, 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import Workspace

from epbuild.api import Outcome

distributed = pytest.importorskip("distributed")


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about compiling: keep a shared action cache out of them."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    import dask

    # Worker processes import onnxruntime on start; on a busy 2-core CI box that can take
    # longer than Dask's default 30 s connect timeout.
    limit = f"{waits.scaled(180):.0f}s"
    slow = {"distributed.comm.timeouts.connect": limit, "distributed.comm.timeouts.tcp": limit}
    with dask.config.set(slow), distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
        dashboard_address=":0", silence_logs=50,  # a free port: 8787 may be taken
    ) as lc:  # fmt: skip
        yield lc


def _files(root: Path) -> dict[str, bytes]:
    out = root / "build"
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".staging" not in p.parts
    }


def _twin(ws: Workspace, tmp_path: Path) -> Workspace:
    """A copy of the workspace (before building) elsewhere, for the local reference build."""
    twin = Workspace(tmp_path / "local")
    shutil.copytree(ws.root, twin.root)
    return twin


@pytest.mark.slow
def test_dask_build_is_byte_identical_to_local(
    simple_ws: Callable[..., Workspace], tmp_path: Path, cluster: Any
) -> None:
    ws = simple_ws()
    local = _twin(ws, tmp_path)
    result = ws.build(executor="dask", scheduler=cluster.scheduler_address)
    assert result.ok, [a.error for a in result.actions]
    assert result.count(Outcome.COMPILED) == 2
    assert local.build().ok
    assert _files(ws.root) == _files(local.root)
    assert len(_files(ws.root)) == 5  # a, b + shared bin; c + its bin
    again = ws.build(executor="dask", scheduler=cluster.scheduler_address)
    assert again.count(Outcome.UP_TO_DATE) == 2  # the state is the coordinator's, as locally


@pytest.mark.slow
def test_dask_via_manifest_and_cli_json(workspace: Workspace, cluster: Any) -> None:
    from conftest import HTP73

    workspace.model("m/x.onnx")
    address = cluster.scheduler_address
    workspace.manifest({"workspace": {"executor": "dask", "scheduler": address},
                        "providers": {"htp": HTP73},
                        "groups": {"g": {"models": ["m/x.onnx"],
                                         "providers": ["htp"]}}})  # fmt: skip
    data = workspace.cli_json("build")
    assert data["summary"]["compiled"] == 1, data
    assert (workspace.root / "build/g/htp/x_ctx.onnx").is_file()


def test_dask_compile_failure_is_reported_like_local(workspace: Workspace, cluster: Any) -> None:
    from conftest import HTP73
    from modelgen import unsupported_model

    workspace.model("m/bad.onnx", unsupported_model())
    workspace.model("m/ok.onnx")
    workspace.manifest({"providers": {"htp": HTP73},
                        "groups": {"g": {"models": ["m/bad.onnx", "m/ok.onnx"],
                                         "providers": ["htp"]}}})  # fmt: skip
    result = workspace.build(executor="dask", scheduler=cluster.scheduler_address,
                             keep_going=True)  # fmt: skip
    by_id = {a.id: a for a in result.actions}
    assert by_id["g/htp/bad"].outcome is Outcome.FAILED
    assert "no EPContext model was written" in (by_id["g/htp/bad"].error or "")
    assert by_id["g/htp/ok"].outcome is Outcome.COMPILED
    assert not (workspace.root / "build/g/htp/bad_ctx.onnx").exists()


def test_dask_needs_a_scheduler(simple_ws: Callable[..., Workspace]) -> None:
    proc = simple_ws().cli("build", "--executor", "dask")
    assert proc.returncode == 2
    assert "needs a scheduler address" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_killed_worker_mid_compile_is_retried_elsewhere(
    simple_ws: Callable[..., Workspace], tmp_path: Path, cluster: Any
) -> None:
    import psutil

    ws = simple_ws()
    local = _twin(ws, tmp_path)
    client = distributed.Client(cluster.scheduler_address, set_as_default=False)
    try:
        pids = set(client.run(os.getpid).values())
    finally:
        client.close()
    killed: list[int] = []
    missed: list[str] = []
    built = threading.Event()

    def busy() -> int | None:
        for pid in pids:
            try:
                children = psutil.Process(pid).children(recursive=True)
                if any("executors.worker" in " ".join(c.cmdline()) for c in children):
                    return pid
            except psutil.Error:
                continue
        return None

    def killer() -> None:
        try:
            pid = waits.wait_for(lambda: busy() or built.is_set(),
                                 "a compile running under a Dask worker")  # fmt: skip
        except waits.WaitExpired as exc:
            missed.append(str(exc))
            return
        if pid is not True:  # a compile is running under this Dask worker: kill the worker
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        result = ws.build("single", executor="dask", scheduler=cluster.scheduler_address)
    finally:
        built.set()
        thread.join()
    assert killed, missed or "the build ended before a compile was seen on a Dask worker"
    assert result.ok, [a.error for a in result.actions]
    assert result.count(Outcome.COMPILED) == 1
    assert local.build("single").ok
    assert _files(ws.root) == _files(local.root)
    assert not list((ws.root / "build").glob(".staging/*"))
    # The cluster recovers (the nanny restarts the worker) for the tests after this one.
    client = distributed.Client(cluster.scheduler_address, set_as_default=False)
    try:
        client.wait_for_workers(2, timeout=waits.scaled(120))
    finally:
        client.close()


@pytest.mark.slow
def test_farm_with_other_versions_is_refused(
    simple_ws: Callable[..., Workspace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real cluster whose workers' environment says onnxruntime-qnn 0.0.1 (a dist-info
    first on their path, as a farm with another release installed would have): its results
    are neither committed nor cached, and the message names both versions."""
    import dask

    from epbuild.providers.base import dist_version

    farm_site = tmp_path / "farm-site"
    meta = farm_site / "onnxruntime_qnn-0.0.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime-qnn\nVersion: 0.0.1\n")
    monkeypatch.setenv("EPBUILD_CACHE", str(tmp_path / "cache"))
    ws = simple_ws()
    slow = {"distributed.comm.timeouts.connect": "180s", "distributed.comm.timeouts.tcp": "180s"}
    with dask.config.set(slow), distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
        dashboard_address=":0", silence_logs=50, env={"PYTHONPATH": str(farm_site)},
    ) as farm:  # fmt: skip
        result = ws.build(executor="dask", scheduler=farm.scheduler_address, keep_going=True)
    here = dist_version("onnxruntime-qnn")
    for action in result.actions:
        assert action.outcome is Outcome.FAILED
        assert f"onnxruntime-qnn 0.0.1 (worker) vs {here} (key)" in (action.error or ""), action
    assert not list((ws.root / "build").rglob("*_ctx.onnx"))
    assert not list((tmp_path / "cache").rglob("*.json"))  # nothing cached
    assert ws.build().count(Outcome.COMPILED) == 2  # and nothing recorded as built
