"""The memory plan: predictions, the default budget, and admission in the scheduler."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from epbuild.engine.memory import (
    BASE_PEAK,
    MemoryPlan,
    available_memory,
    default_budget,
    predict_from_inputs,
    predict_peak,
)
from epbuild.engine.scheduler import schedule as _schedule
from epbuild.results import ActionResult, Outcome, Reporter

if TYPE_CHECKING:
    from conftest import Workspace


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about compiling: keep a shared action cache out of them."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


def test_meminfo_parsing(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n")
    no_cgroup = {"proc_cgroup": str(tmp_path / "absent")}
    assert available_memory(str(info), **no_cgroup) == 8_000_000 * 1024
    assert default_budget(str(info), **no_cgroup) == int(8_000_000 * 1024 * 0.75)
    info.write_text("MemTotal:       2000 kB\n")
    assert available_memory(str(info), **no_cgroup) == 2000 * 1024
    assert available_memory(str(tmp_path / "absent"), **no_cgroup) > 0  # falls back to sysconf


def test_prediction_from_inputs_then_from_record(simple_ws: Callable[..., Workspace]) -> None:
    from epbuild.planning.staleness import make_plan
    from epbuild.planning.workspace import open_workspace

    ws = simple_ws()
    w = open_workspace(ws.root)
    plans = {p.action.id: p for p in make_plan(w.actions, w.state, w.keys, w.stats, w.root)}
    size = (ws.root / "models/c.onnx").stat().st_size
    assert predict_peak(plans["single/htp/c"], w.state, w.stats, w.root) == predict_from_inputs(
        size
    ) == BASE_PEAK + int(3.5 * size)  # fmt: skip
    assert ws.build().ok
    w = open_workspace(ws.root)
    recorded = w.state.records["single/htp/c"].peak_rss
    assert recorded > 50 << 20  # a real worker's peak RSS, not a placeholder
    plans = {p.action.id: p for p in make_plan(w.actions, w.state, w.keys, w.stats, w.root)}
    assert predict_peak(plans["single/htp/c"], w.state, w.stats, w.root) == max(
        recorded, predict_from_inputs(size)
    )


def test_prediction_grows_with_inputs_past_a_stale_record(
    simple_ws: Callable[..., Workspace],
) -> None:
    """A recorded peak is a floor, not the answer: inputs that grew predict more."""
    from modelgen import matmul_model

    from epbuild.planning.staleness import make_plan
    from epbuild.planning.workspace import open_workspace
    from epbuild.state.journal import ActionRecord, State

    ws = simple_ws()
    small = (ws.root / "models/c.onnx").stat().st_size
    recorded = predict_from_inputs(small) + (1 << 20)  # what the last run (small model) took
    state = State(records={"single/htp/c": ActionRecord(
        "single/htp/c", "old", {}, {}, seconds=1.0, peak_rss=recorded, at=1.0)})  # fmt: skip

    def predicted() -> int:
        w = open_workspace(ws.root)
        plans = {p.action.id: p for p in make_plan(w.actions, w.state, w.keys, w.stats, w.root)}
        return predict_peak(plans["single/htp/c"], state, w.stats, w.root)

    assert predicted() == recorded  # inputs unchanged: the measured peak, above the formula
    ws.model("models/c.onnx", matmul_model(3, n=512))  # about 2 MB of weights now
    big = (ws.root / "models/c.onnx").stat().st_size
    assert big > 100 * small
    assert predicted() == predict_from_inputs(big) > recorded


def _plan(action_id: str) -> Any:
    return SimpleNamespace(action=SimpleNamespace(id=action_id), reasons=[], stale=True)


def test_take_admits_what_fits_and_a_too_big_one_alone() -> None:
    plan = MemoryPlan(1000, {"big": 5000, "a": 400, "b": 400, "c": 400})
    pending = deque(_plan(i) for i in ("big", "a", "b", "c"))
    first = plan.take(pending, idle=False)
    assert first is not None and first.action.id == "a"  # big does not fit: skip to what does
    second = plan.take(pending, idle=False)
    assert second is not None and second.action.id == "b"
    assert plan.take(pending, idle=False) is None  # c would exceed 1000
    plan.release(first)
    plan.release(second)
    alone = plan.take(pending, idle=True)  # nothing runs: the too-big one goes, alone
    assert alone is not None and alone.action.id == "big"
    assert plan.take(pending, idle=False) is None
    plan.release(alone)
    assert plan.in_use == 0


class FakeBuilder:
    """What ``schedule`` needs from ``Builder``; the fake executor records start/end times."""

    def __init__(self, jobs: int, memory: MemoryPlan, seconds: float) -> None:
        self.jobs = jobs
        self.keep_going = True
        self.reporter = Reporter()
        self.memory = memory
        self.executor = SimpleNamespace(cancel=lambda: None)
        self.seconds = seconds
        self.spans: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def run_one(self, plan: Any) -> ActionResult:
        start = time.monotonic()
        time.sleep(self.seconds)
        with self._lock:
            self.spans[plan.action.id] = (start, time.monotonic())
        return ActionResult(plan.action.id, "g", "p", Outcome.COMPILED)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_small_budget_serialises_large_actions_and_parallelises_small_ones() -> None:
    mb = 1 << 20
    peaks = {"large1": 700 * mb, "large2": 700 * mb, **{f"small{i}": 100 * mb for i in range(4)}}
    builder = FakeBuilder(jobs=4, memory=MemoryPlan(1000 * mb, peaks), seconds=0.15)
    order = ["large1", "large2", "small0", "small1", "small2", "small3"]
    results = _schedule(builder, [_plan(i) for i in order])  # type: ignore[arg-type]
    assert {r.outcome for r in results.values()} == {Outcome.COMPILED}
    spans = builder.spans
    assert not _overlap(spans["large1"], spans["large2"])
    small = [spans[f"small{i}"] for i in range(4)]
    assert any(_overlap(x, y) for i, x in enumerate(small) for y in small[i + 1 :])
    assert builder.memory.in_use == 0


def test_budget_bigger_than_everything_runs_up_to_jobs() -> None:
    peaks = {f"a{i}": 10 for i in range(4)}
    builder = FakeBuilder(jobs=4, memory=MemoryPlan(10**12, peaks), seconds=0.15)
    _schedule(builder, [_plan(f"a{i}") for i in range(4)])  # type: ignore[arg-type]
    spans = list(builder.spans.values())
    assert all(_overlap(spans[0], s) for s in spans[1:])


@pytest.mark.slow
def test_tiny_budget_serialises_real_compiles(simple_ws: Callable[..., Workspace],
                                              tmp_path: Path) -> None:  # fmt: skip
    ws = simple_ws()
    trace = tmp_path / "t.json"
    result = ws.build(jobs=2, memory_budget=1, trace=trace)
    assert result.ok and result.count(Outcome.COMPILED) == 2
    events = json.loads(trace.read_text())["traceEvents"]
    compiles = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "compile"]
    assert len(compiles) == 2
    assert not _overlap(compiles[0], compiles[1])


def test_cli_rejects_a_bad_budget(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    proc = ws.cli("build", "--memory-budget", "lots")
    assert proc.returncode == 2 and "--memory-budget 'lots' is not a size" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["0", "0M"])
def test_cli_rejects_a_zero_budget(simple_ws: Callable[..., Workspace], value: str) -> None:
    proc = simple_ws().main("build", "--memory-budget", value)
    assert proc.returncode == 2 and "must be positive" in proc.stderr


def _cgroups(tmp_path: Path, proc: str, files: dict[str, str]) -> dict[str, str]:
    (tmp_path / "cgroup").write_text(proc)
    for rel, text in files.items():
        path = tmp_path / "sys" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return {"proc_cgroup": str(tmp_path / "cgroup"), "sys_cgroup": str(tmp_path / "sys")}


def test_a_cgroup_v2_limit_caps_the_budget(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n")
    paths = _cgroups(tmp_path, "0::/ci/job7\n", {
        "ci/job7/memory.max": "max", "ci/job7/memory.current": str(100 << 20),
        "ci/memory.max": str(2 << 30), "ci/memory.current": str(500 << 20),
    })  # fmt: skip
    assert available_memory(str(info), **paths) == (2 << 30) - (500 << 20)
    assert default_budget(str(info), **paths) == int(((2 << 30) - (500 << 20)) * 0.75)


def test_a_cgroup_v1_limit_caps_the_budget(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n")
    paths = _cgroups(tmp_path, "4:memory:/docker/abc\n1:cpu:/\n0::/\n", {
        "memory/docker/abc/memory.limit_in_bytes": str(1 << 30),
        "memory/docker/abc/memory.usage_in_bytes": str(200 << 20),
        "memory/memory.limit_in_bytes": "9223372036854771712",  # the root: no limit
    })  # fmt: skip
    assert available_memory(str(info), **paths) == (1 << 30) - (200 << 20)
    # inside the container's namespace the cgroup path is not mounted: the root's files
    paths = _cgroups(tmp_path, "4:memory:/elsewhere\n", {
        "memory/memory.limit_in_bytes": str(3 << 30), "memory/memory.usage_in_bytes": "0",
    })  # fmt: skip
    assert available_memory(str(info), **paths) == 3 << 30


def test_no_cgroup_limit_leaves_the_host_figure(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemAvailable: 6000 kB\n")
    paths = _cgroups(tmp_path, "0::/\n", {"memory.max": "max", "memory.current": "5"})
    assert available_memory(str(info), **paths) == 6000 * 1024


def test_warm_spares_count_against_the_budget(simple_ws: Callable[..., Workspace]) -> None:
    from epbuild.engine.memory import SPARE_RSS
    from epbuild.engine.scheduler import executor_for
    from epbuild.planning.staleness import make_plan
    from epbuild.planning.workspace import open_workspace

    ws = open_workspace(simple_ws().root)
    plans = make_plan(ws.actions, ws.state, ws.keys, ws.stats, ws.root)
    execution = executor_for(ws, [p for p in plans if p.stale], None, None, 1, 1 << 30)
    try:
        assert execution.memory.budget == (1 << 30) - SPARE_RSS  # one worker command
    finally:
        execution.executor.close()
