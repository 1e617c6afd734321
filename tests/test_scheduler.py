"""The builder and scheduler behind the executor seam: a fake executor, no worker processes."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import pytest
from conftest import HTP73
from onnx import TensorProto, helper

from epbuild._names import ctx_name
from epbuild.errors import Interrupted
from epbuild.executors.job import Job
from epbuild.executors.local import WorkerOutcome
from epbuild.kinds.compilework import CompileWork
from epbuild.results import Outcome

if TYPE_CHECKING:
    from conftest import Workspace


def _ctx_model(shared_bin: str | None = None) -> onnx.ModelProto:
    """A minimal EPContext model: what a successful compile stages for one source model
    (a sharing group's reference ``shared_bin``; others embed their context)."""
    node = helper.make_node(
        "EPContext",
        ["x"],
        ["y"],
        domain="com.microsoft",
        embed_mode=0 if shared_bin else 1,
        main_context=1,
        ep_cache_context=shared_bin.encode() if shared_bin else b"context-binary",
        source="QNN",
    )
    graph = helper.make_graph(
        [node],
        "ctx",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class FakeExecutor:
    """Satisfies the ``Executor`` protocol: stages ctx models at once; ``raising`` actions
    raise from ``run`` instead (what a full disk does to a real executor)."""

    def __init__(self, root: str, raising: dict[str, BaseException]) -> None:
        self.root = root
        self.raising = raising
        self.jobs: list[Job] = []
        self.closed = 0
        self._lock = threading.Lock()

    def run(self, job: Job) -> WorkerOutcome:
        with self._lock:
            self.jobs.append(job)
        if job.action_id in self.raising:
            raise self.raising[job.action_id]
        staging = os.path.join(self.root, job.staging)
        work = CompileWork.from_job(job)
        shared = None
        if work.context.share_weights:
            shared = ctx_name(work.models[0]).removesuffix(".onnx") + "_qnn.bin"
            with open(os.path.join(staging, shared), "wb") as f:
                f.write(b"context-binary")
        for model in work.models:
            onnx.save(_ctx_model(shared), os.path.join(staging, ctx_name(model)))
        from epbuild import __version__
        from epbuild.executors.worker import compiled_with

        versions = compiled_with(work.provider)  # as a real worker reports them
        result = {"seconds": 0.01, "peak_rss": 1 << 20, "detail": {}, "versions": versions}
        return WorkerOutcome(True, {**result, "epbuild": __version__})

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def test_an_exception_in_one_action_fails_only_that_action(
    simple_ws: Callable[..., Workspace],
) -> None:
    ws = simple_ws()
    fake = FakeExecutor(str(ws.root), {"pair/htp": OSError(28, "No space left on device")})
    result = ws.build(executor=fake, keep_going=True)
    by_id = {r.id: r for r in result.actions}
    failed = by_id["pair/htp"]
    assert failed.outcome is Outcome.FAILED
    assert failed.error is not None and "Errno" not in failed.error  # said, not a repr
    assert failed.hint is not None and "free space" in failed.hint
    assert "No space left on device" in failed.error
    assert "Traceback" not in failed.error
    assert by_id["single/htp/c"].outcome is Outcome.COMPILED
    assert (ws.root / by_id["single/htp/c"].outputs[0]).is_file()
    assert fake.closed == 0  # an executor passed in belongs to the caller

    fake.raising.clear()  # the failed action is still stale, the compiled one is not
    again = {r.id: r.outcome for r in ws.build(executor=fake).actions}
    assert again == {"pair/htp": Outcome.COMPILED, "single/htp/c": Outcome.UP_TO_DATE}


def test_keyboard_interrupt_in_an_action_still_interrupts_the_build(
    simple_ws: Callable[..., Workspace],
) -> None:
    ws = simple_ws()
    fake = FakeExecutor(str(ws.root), {"single/htp/c": KeyboardInterrupt()})
    with pytest.raises(Interrupted):
        ws.build("single", executor=fake)


def test_the_job_is_complete_and_survives_json(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws(external_initializers="weights.bin")
    fake = FakeExecutor(str(ws.root), {})
    assert ws.build(executor=fake).ok
    jobs = {j.action_id: j for j in fake.jobs}
    pair, work = jobs["pair/htp"], CompileWork.from_job(jobs["pair/htp"])
    assert work.models == ("models/a.onnx", "models/b.onnx")
    assert work.initializer_names == ("a_weights.bin", "b_weights.bin")
    assert set(pair.inputs) == {"models/a.onnx", "models/b.onnx"}
    assert pair.predicted_peak > 0
    assert CompileWork.from_job(jobs["single/htp/c"]).initializer_names == ()
    for job in fake.jobs:  # base_dir stays behind: the worker runs in the workspace
        data = json.loads(json.dumps(job.to_json()))
        assert Job.from_json(data).to_json() == data


def test_peak_memory_and_liveness_are_portable_helpers() -> None:
    import subprocess
    import sys

    from epbuild.engine.staging import _alive
    from epbuild.executors.worker import peak_rss

    assert peak_rss() > 10 << 20  # this interpreter, in bytes (not KiB)
    assert _alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not _alive(child.pid)


class _FakeProc:
    """Enough of a Popen for ``LocalExecutor._take``: alive until reaped."""

    def poll(self) -> None:
        return None


@pytest.mark.parametrize(("jobs", "started"), [(1, 1), (2, 2), (3, 3), (None, 4)])
def test_spares_are_started_only_for_jobs_still_to_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int | None, started: int
) -> None:
    """A build that knows its job count starts one worker per job (a spare nobody takes
    costs a whole ``import onnxruntime`` beside the compiles); without a count (a watch
    session) one spare always stays warm for the next job."""
    from epbuild.executors.local import LocalExecutor

    executor = LocalExecutor(str(tmp_path), prewarm=True, jobs=jobs)
    spawned: list[tuple[str, ...]] = []

    def spawn(boot: tuple[str, ...]) -> _FakeProc:
        spawned.append(boot)
        return _FakeProc()

    monkeypatch.setattr(executor, "_spawn", spawn)
    for _ in range(jobs or 3):
        assert executor._take(()) is not None
    assert len(spawned) == started


# ---------------------------------------------------------------------------------------
# The graph: edges between actions


class GraphRunner:
    """What ``schedule`` needs from ``Builder``: records the order actions start in; the
    ``failing`` ones fail."""

    def __init__(self, jobs: int, keep_going: bool, failing: set[str]) -> None:
        from types import SimpleNamespace

        from epbuild.engine.memory import MemoryPlan
        from epbuild.results import Reporter

        self.jobs = jobs
        self.keep_going = keep_going
        self.restores_only = False
        self.reporter = Reporter()
        self.memory = MemoryPlan(None, {})
        self.executor = SimpleNamespace(cancel=lambda: None)
        self.failing = failing
        self.started: list[str] = []
        self.finished: set[str] = set()
        self.deps_done_at_start: dict[str, bool] = {}
        self.threads: list[threading.Thread] = []
        """The thread each run_one ran in."""
        self.inline: list[threading.Thread] = []
        """The thread each run_inline ran in."""
        self._lock = threading.Lock()

    def run_inline(self, plan: Any) -> Any:
        self.inline.append(threading.current_thread())
        return self.run_one(plan)

    def run_one(self, plan: Any) -> Any:
        from epbuild.results import ActionResult

        a = plan.action
        with self._lock:
            self.threads.append(threading.current_thread())
            self.started.append(a.id)
            self.deps_done_at_start[a.id] = all(d in self.finished for d in a.deps)
        outcome = Outcome.FAILED if a.id in self.failing else Outcome.COMPILED
        with self._lock:
            self.finished.add(a.id)
        return ActionResult(a.id, "g", "p", outcome)


def _node(action_id: str, *deps: str) -> Any:
    from types import SimpleNamespace

    action = SimpleNamespace(
        id=action_id, deps=deps, group_name="g", provider_name="p", kind="compile"
    )
    return SimpleNamespace(action=action, reasons=[], stale=True)


def _graph() -> list[Any]:
    """prep → (c1, c2) → pkg; an independent x."""
    return [
        _node("pkg", "c1", "c2"),
        _node("c1", "prep"),
        _node("x"),
        _node("c2", "prep"),
        _node("prep"),
    ]


@pytest.mark.parametrize("jobs", [1, 3])
def test_an_action_starts_only_after_the_actions_it_depends_on(jobs: int) -> None:
    from epbuild.engine.scheduler import schedule

    runner = GraphRunner(jobs, keep_going=False, failing=set())
    results = schedule(runner, _graph())  # type: ignore[arg-type]
    assert {r.outcome for r in results.values()} == {Outcome.COMPILED}
    assert sorted(runner.started) == ["c1", "c2", "pkg", "prep", "x"]
    assert all(runner.deps_done_at_start.values())
    assert runner.started.index("prep") < runner.started.index("c1") < runner.started.index("pkg")


def test_actions_run_on_at_most_jobs_threads_which_are_reused_and_end() -> None:
    """The slots are threads of their own (the trace's lanes): at most -j of them, each
    taking action after action, all ended when the build is."""
    from epbuild.engine.scheduler import schedule

    names: set[str] = set()
    runner = GraphRunner(2, keep_going=False, failing=set())
    run = runner.run_one

    def noting(plan: Any) -> Any:
        names.add(threading.current_thread().name)
        return run(plan)

    runner.run_one = noting  # type: ignore[method-assign]
    before = set(threading.enumerate())
    results = schedule(runner, [_node(f"a{i}") for i in range(8)])  # type: ignore[arg-type]
    assert {r.outcome for r in results.values()} == {Outcome.COMPILED} and len(results) == 8
    assert 1 <= len(names) <= 2 and all(n.startswith("epbuild-slot") for n in names)
    assert set(threading.enumerate()) <= before


def test_an_interrupt_just_after_an_action_finished_still_ends_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C landing between the scheduler taking a finished action's result and counting
    it: the build still stops (Interrupted), its threads ended, nothing waits forever."""
    from epbuild.engine import scheduler

    taken = scheduler._Slots.next_done

    def interrupted(self: Any) -> Any:
        taken(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(scheduler._Slots, "next_done", interrupted)
    runner = GraphRunner(2, keep_going=False, failing=set())
    before = set(threading.enumerate())
    with pytest.raises(Interrupted):
        scheduler.schedule(runner, [_node(f"a{i}") for i in range(4)])  # type: ignore[arg-type]
    assert set(threading.enumerate()) <= before


def test_a_failed_action_skips_its_dependents_naming_it_and_k_builds_the_rest() -> None:
    from epbuild.engine.scheduler import schedule

    runner = GraphRunner(1, keep_going=True, failing={"c1"})
    results = schedule(runner, _graph())  # type: ignore[arg-type]
    assert results["c1"].outcome is Outcome.FAILED
    assert results["c2"].outcome is Outcome.COMPILED and results["x"].outcome is Outcome.COMPILED
    assert results["pkg"].outcome is Outcome.SKIPPED
    assert results["pkg"].error == "not started because c1, which it depends on, failed"
    assert "pkg" not in runner.started


def test_a_skip_reaches_every_action_downstream() -> None:
    from epbuild.engine.scheduler import schedule

    runner = GraphRunner(2, keep_going=True, failing={"prep"})
    results = schedule(runner, _graph())  # type: ignore[arg-type]
    assert runner.started == ["x", "prep"] or sorted(runner.started) == ["prep", "x"]
    assert results["c1"].error == "not started because prep, which it depends on, failed"
    assert results["pkg"].outcome is Outcome.SKIPPED
    assert "which it depends on, was not built" in (results["pkg"].error or "")


def test_an_up_to_date_dependency_is_not_waited_for() -> None:
    from epbuild.engine.scheduler import schedule

    runner = GraphRunner(1, keep_going=False, failing=set())
    results = schedule(runner, [_node("c1", "prep")])  # type: ignore[arg-type]
    assert results["c1"].outcome is Outcome.COMPILED


def test_without_k_a_failure_stops_what_has_not_started() -> None:
    from epbuild.engine.scheduler import schedule

    runner = GraphRunner(1, keep_going=False, failing={"prep"})
    results = schedule(runner, [_node("prep"), _node("x"), _node("c1", "prep")])  # type: ignore[arg-type]
    assert runner.started == ["prep"]
    assert results["x"].outcome is Outcome.SKIPPED
    assert "earlier action failed" in (results["x"].error or "")
    assert results["c1"].error == "not started because prep, which it depends on, failed"


def test_status_shows_kinds_and_deps_and_draws_the_graph(
    simple_ws: Callable[..., Workspace],
) -> None:
    ws = simple_ws()
    doc = ws.main_json("status")
    assert [(a["id"], a["kind"], a["deps"]) for a in doc["actions"]] == [
        ("pair/htp", "compile", []),
        ("single/htp/c", "compile", []),
    ]
    mermaid = ws.main("status", "--graph", "mermaid", check=True).stdout
    assert mermaid.startswith("flowchart LR\n") and '["pair/htp<br/>compile, stale"]' in mermaid
    dot = ws.main("status", "--graph", "dot", check=True).stdout
    assert dot.startswith("digraph epbuild {") and dot.rstrip().endswith("}")
    assert 'label="single/htp/c\\ncompile, stale"' in dot
    refused = ws.main("status", "--graph", "dot", "--json")
    assert refused.returncode == 2 and "--graph" in refused.stdout


def test_graph_text_draws_an_edge_per_dependency() -> None:
    from epbuild.frontends.render import graph_text
    from epbuild.results import ActionStatus, StatusResult

    result = StatusResult(
        [
            ActionStatus("llm/prepare", "llm", "", False, [], "k1", "prepare"),
            ActionStatus("llm/htp", "llm", "htp", True, ["x"], "k2", "compile", ("llm/prepare",)),
        ]
    )
    assert "  a0 --> a1" in graph_text(result, "mermaid").splitlines()
    assert "  a0 -> a1;" in graph_text(result, "dot").splitlines()


HOSTILE = ('a"b', "end\\", "<b>x</b> & #quot; `md`", "back\\nslash")


def _dot_labels(dot: str) -> list[list[str]]:
    """Each node's label read back as DOT reads a double-quoted string (``\\"`` a quote,
    ``\\\\`` a backslash, ``\\n`` the break between lines), its lines."""
    labels = []
    for body in re.findall(r'label="((?:[^"\\]|\\.)*)", shape=box', dot):
        lines, text, chars = [], "", iter(body)
        for c in chars:
            if c == "\\":
                c = next(chars)
                if c == "n":
                    lines.append(text)
                    text = ""
                    continue
            text += c
        labels.append([*lines, text])
    return labels


def _mermaid_labels(mermaid: str) -> list[list[str]]:
    """Each node's label with Mermaid's entity codes read back, its lines."""
    codes = {"quot": '"', "lt": "<", "gt": ">", "amp": "&"}

    def decode(text: str) -> str:
        return re.sub(r"#(\w+);", lambda m: codes.get(m[1]) or chr(int(m[1])), text)

    found = re.findall(r'^  a\d+\["([^"]*)"\]$', mermaid, re.M)
    return [[decode(part) for part in label.split("<br/>")] for label in found]


def test_graph_text_writes_any_name_as_itself() -> None:
    from epbuild.frontends.render import graph_text
    from epbuild.results import ActionStatus, StatusResult

    result = StatusResult(
        [ActionStatus(name, "g", "", True, [], "k", "compile") for name in HOSTILE]
    )
    expected = [[name, "compile, stale"] for name in HOSTILE]
    dot = graph_text(result, "dot")
    assert _dot_labels(dot) == expected, dot
    assert len(dot.splitlines()) == 3 + len(HOSTILE)  # no label swallowed a line break
    mermaid = graph_text(result, "mermaid")
    assert _mermaid_labels(mermaid) == expected, mermaid
    assert "<b>" not in mermaid and "`" not in mermaid


def test_status_graph_of_a_hostile_model_name(workspace: Workspace) -> None:
    workspace.model('models/a"b<i>&.onnx')  # found by the glob: the id is the file's stem
    workspace.manifest(
        {
            "providers": {"htp": HTP73},
            "groups": {"g": {"models": ["models/*.onnx"], "providers": ["htp"]}},
        }
    )
    dot = workspace.main("status", "--graph", "dot", check=True).stdout
    assert _dot_labels(dot) == [['g/htp/a"b<i>&', "compile, stale"]], dot
    mermaid = workspace.main("status", "--graph", "mermaid", check=True).stdout
    assert _mermaid_labels(mermaid) == [['g/htp/a"b<i>&', "compile, stale"]], mermaid


def test_inline_jobs_take_no_worker_from_the_count(workspace: Workspace) -> None:
    """An LLM's first build: preparation and two compiles run in workers, the package
    inline: three workers are expected, not four (a spare nobody takes costs CPU)."""
    from epbuild.engine.scheduler import executor_for
    from epbuild.executors.local import LocalExecutor
    from epbuild.planning.staleness import make_plan
    from epbuild.planning.workspace import open_workspace

    workspace.llm()
    ws = open_workspace(workspace.root)
    stale = [p for p in make_plan(ws.graph, ws.state, ws.keys, ws.stats, ws.root) if p.stale]
    assert [p.action.kind for p in stale] == ["prepare", "compile", "compile", "package"]
    run = executor_for(ws, stale, None, None, None, None)
    try:
        assert isinstance(run.executor, LocalExecutor) and run.executor._upcoming == 3
    finally:
        run.executor.close()


def test_a_lone_action_that_starts_no_worker_runs_in_the_coordinators_thread() -> None:
    """A restore-only build of one action: no slot thread; of two, or one that may compile:
    slot threads, as always."""
    from epbuild.engine.scheduler import schedule

    here = threading.current_thread()
    lone = GraphRunner(4, keep_going=False, failing=set())
    lone.restores_only = True
    results = schedule(lone, [_node("a")])  # type: ignore[arg-type]
    assert results["a"].outcome is Outcome.COMPILED
    assert lone.inline == [here] and lone.threads == [here]
    for restores_only, nodes in ((True, [_node("a"), _node("b")]), (False, [_node("a")])):
        runner = GraphRunner(4, keep_going=False, failing=set())
        runner.restores_only = restores_only
        assert len(schedule(runner, nodes)) == len(nodes)  # type: ignore[arg-type]
        assert runner.inline == [] and here not in runner.threads


def test_an_interrupt_in_a_lone_inline_action_stops_the_build() -> None:
    from epbuild.engine.scheduler import schedule

    class Interrupting(GraphRunner):
        def run_one(self, plan: Any) -> Any:
            raise KeyboardInterrupt

    runner = Interrupting(1, keep_going=False, failing=set())
    runner.restores_only = True
    with pytest.raises(Interrupted):
        schedule(runner, [_node("a")])  # type: ignore[arg-type]
