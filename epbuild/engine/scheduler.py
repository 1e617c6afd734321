"""The one scheduling loop of a build, and the choice of executor, slots and memory plan."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

from epbuild._dataclass import dataclass
from epbuild.errors import Interrupted, UserError
from epbuild.results import ActionResult, Outcome, Reporter, action_result

if TYPE_CHECKING:
    from collections.abc import Callable

    from epbuild.engine.memory import MemoryPlan
    from epbuild.executors.job import Job
    from epbuild.executors.local import Executor, WorkerOutcome
    from epbuild.planning.staleness import ActionPlan
    from epbuild.planning.workspace import Workspace


class ActionRunner(Protocol):
    """What ``schedule`` drives: ``Builder``, or a fake in the scheduler's tests."""

    jobs: int
    keep_going: bool
    reporter: Reporter
    memory: MemoryPlan
    executor: Executor

    restores_only: bool
    """Its actions start no worker (``build --cache-only``: each is restored or fails)."""

    def run_one(self, plan: ActionPlan) -> ActionResult:
        """Bring one action up to date; failures come back as results, never raised."""
        ...

    def run_inline(self, plan: ActionPlan) -> ActionResult:
        """``run_one`` in the calling thread, recorded as a slot's (``_Inline``)."""
        ...


@dataclass(frozen=True)
class Execution:
    """Where and how wide a build runs."""

    executor: Executor
    jobs: int
    """Actions run at once."""
    memory: MemoryPlan
    owned: bool
    """The executor was made for this build (the build closes it), not passed in."""


def executor_for(
    ws: Workspace,
    stale: list[ActionPlan],
    executor: str | Executor | None,
    scheduler: str | None,
    jobs: int | None,
    memory_budget: int | None,
    *,
    restores_only: bool = False,
) -> Execution:
    """The executor, slot count and memory plan of a build. ``restores_only`` (``build
    --cache-only``): its actions start no worker, so the local executor is not made (nor
    its module imported: a restore's startup)."""
    from epbuild.engine.memory import MemoryPlan, default_budget, predict_peak, spare_cost
    from epbuild.kinds.contract import kind_of

    peaks = {p.action.id: predict_peak(p, ws.state, ws.stats, ws.root) for p in stale}
    kind = executor if executor is not None else ws.manifest.workspace.executor
    if kind == "dask":
        from epbuild.executors.dask import DaskExecutor

        address = scheduler or ws.manifest.workspace.scheduler
        if not address:
            raise UserError(
                "the dask executor needs a scheduler address",
                hint="pass --scheduler tcp://HOST:PORT or set scheduler in [workspace]",
            )
        dask = DaskExecutor(ws.root, address)
        # The farm's workers hold the memory: map predictions onto their resources instead.
        return Execution(dask, max(1, jobs or dask.slots()), MemoryPlan(None, peaks), owned=True)
    if isinstance(kind, str) and kind != "local":
        raise UserError(f"unknown executor {kind!r}", hint="use local or dask")
    budget = memory_budget or ws.manifest.workspace.memory_budget or default_budget()
    slots = max(1, jobs or ws.manifest.workspace.jobs)
    if kind == "local" and restores_only:
        return Execution(_NoWorkers(), slots, MemoryPlan(budget, peaks), owned=True)
    if isinstance(kind, str):
        from epbuild.executors.local import LocalExecutor

        # The warm spares (one per worker command: epbuild's own, or a toolchain's) hold
        # memory the compiles cannot have; inline jobs take no worker.
        workers = [p for p in stale if not kind_of(p.action).inline]
        budget = max(0, budget - spare_cost(repr(p.action.toolchain) for p in workers))
        local = LocalExecutor(ws.root, prewarm=True, jobs=len(workers))
        return Execution(local, slots, MemoryPlan(budget, peaks), owned=True)
    return Execution(kind, slots, MemoryPlan(budget, peaks), owned=False)


class _NoWorkers:
    """The executor of a build whose actions start no worker (``restores_only``)."""

    def run(self, job: Job) -> WorkerOutcome:
        raise AssertionError("a --cache-only build runs no job")

    def cancel(self) -> None:
        """Nothing runs."""

    def close(self) -> None:
        """Nothing was started."""


def schedule(runner: ActionRunner, stale: list[ActionPlan]) -> dict[str, ActionResult]:
    """One loop over the graph: start ready actions (every stale action they depend on
    done) up to -j while their predicted memory fits the budget, wait for the first to
    finish, repeat. A failed action skips the actions that depend on it, naming it; without
    -k it also stops the others from starting."""
    graph = _Ready(runner.reporter, stale)
    results = graph.results
    running = 0
    stop = False
    slots: _Slots | _Inline
    if len(stale) == 1 and runner.restores_only:
        slots = _Inline(runner.run_inline)
    else:
        slots = _Slots(runner.jobs, runner.run_one)
    try:
        graph.release()
        while graph.pending or running:
            while graph.pending and running < runner.jobs and not stop:
                taken = runner.memory.take(graph.pending, idle=not running)
                if taken is None:
                    break
                slots.submit(taken)
                running += 1
            if not running:
                break
            plan, outcome = slots.next_done()
            running -= 1
            if isinstance(outcome, BaseException):
                raise outcome  # what run_one raised (a KeyboardInterrupt in its thread)
            res = outcome
            runner.memory.release(plan)
            results[plan.action.id] = res
            runner.reporter.action_finished(res)
            if res.outcome is Outcome.FAILED and not runner.keep_going:
                stop = True
            graph.release()
    except KeyboardInterrupt:
        try:  # a second Ctrl-C while workers are stopped still ends the slot threads
            runner.executor.cancel()
        finally:
            slots.shutdown()  # the running actions end (cancelled), as a pool's would
        raise Interrupted("interrupted; workers stopped, nothing half-written was kept") from None
    except BaseException:
        slots.shutdown(join=False)  # the running actions finish; none starts
        raise
    slots.shutdown()
    for plan in [*graph.pending, *graph.waiting]:
        results[plan.action.id] = action_result(
            plan.action,
            Outcome.SKIPPED,
            reasons=plan.reasons,
            error="not started because an earlier action failed (use -k to keep going)",
        )
    return results


class _Slots:
    """The build's worker-slot threads (at most ``jobs``, started as needed and reused, like
    a thread pool's: each is a lane of the trace), running ``run`` on the plans submitted;
    ``next_done`` waits for the first to finish. ``concurrent.futures`` without its imports
    (``logging`` among them: a restore's startup)."""

    def __init__(self, jobs: int, run: Callable[[ActionPlan], ActionResult]) -> None:
        from _queue import SimpleQueue  # queue's, without the rest of queue (heapq, ...)

        self._run = run
        self._jobs = jobs
        self._todo: SimpleQueue[ActionPlan | None] = SimpleQueue()
        self._done: SimpleQueue[tuple[ActionPlan, ActionResult | BaseException]] = SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._busy = 0

    def submit(self, plan: ActionPlan) -> None:
        self._busy += 1
        if self._busy > len(self._threads) and len(self._threads) < self._jobs:
            name = f"epbuild-slot_{len(self._threads)}"
            thread = threading.Thread(target=self._work, name=name)
            thread.start()
            self._threads.append(thread)
        self._todo.put(plan)

    def _work(self) -> None:
        while (plan := self._todo.get()) is not None:
            try:
                self._done.put((plan, self._run(plan)))
            except BaseException as exc:  # handed to the scheduler, which raises it
                self._done.put((plan, exc))

    def next_done(self) -> tuple[ActionPlan, ActionResult | BaseException]:
        """The first plan to finish and its result, or what its run raised."""
        done = self._done.get()
        self._busy -= 1
        return done

    def shutdown(self, *, join: bool = True) -> None:
        """End the threads once each has finished the run it is on (``join``: wait for
        that). Waiting for the threads, not for their results: an interrupt may have come
        between taking a result and counting it."""
        for _ in self._threads:
            self._todo.put(None)
        if join:
            for thread in self._threads:
                thread.join()


class _Inline:
    """``_Slots`` for a build of one action that starts no worker (a restore): the action
    runs in the coordinator's thread as it is submitted, with no thread to start and hand
    it over to. Ctrl-C stops it where it is: the journal then says it was begun, not done,
    and the next build restores it again."""

    def __init__(self, run: Callable[[ActionPlan], ActionResult]) -> None:
        self._run = run
        self._done: list[tuple[ActionPlan, ActionResult]] = []

    def submit(self, plan: ActionPlan) -> None:
        self._done.append((plan, self._run(plan)))

    def next_done(self) -> tuple[ActionPlan, ActionResult]:
        return self._done.pop(0)

    def shutdown(self, *, join: bool = True) -> None:
        """Nothing runs on once ``submit`` has returned."""


class _Ready:
    """The ready set of one build: actions wait until every stale action they depend on has
    a result, then move to ``pending`` (a dependency that did not succeed skips them)."""

    def __init__(self, reporter: Reporter, stale: list[ActionPlan]) -> None:
        from collections import deque

        self.reporter = reporter
        self.results: dict[str, ActionResult] = {}
        self.pending: deque[ActionPlan] = deque()
        self.waiting = list(stale)
        self._deps = {p.action.id: _stale_deps(p, stale) for p in stale}

    def release(self) -> None:
        """Move what is ready to ``pending``; skip what a dependency left unbuilt (and, in
        turn, what depends on that)."""
        moved = True
        while moved:
            moved = False
            for plan in list(self.waiting):
                deps = self._deps[plan.action.id]
                broken = [d for d in deps if d in self.results and not _usable(self.results[d])]
                if broken:
                    res = _skipped(plan, broken[0], self.results[broken[0]])
                    self.results[plan.action.id] = res
                    self.reporter.action_finished(res)
                elif all(d in self.results for d in deps):
                    self.pending.append(plan)
                else:
                    continue
                self.waiting.remove(plan)
                moved = True


def _stale_deps(plan: ActionPlan, stale: list[ActionPlan]) -> tuple[str, ...]:
    """The actions ``plan`` waits for: those it depends on that run in this build (one that
    is up to date, or not selected, has its outputs already)."""
    ids = {p.action.id for p in stale}
    return tuple(d for d in getattr(plan.action, "deps", ()) if d in ids)


def _usable(result: ActionResult) -> bool:
    """Its outputs are there for the actions that depend on it."""
    return result.outcome in (Outcome.RAN, Outcome.RESTORED, Outcome.UP_TO_DATE)


def _skipped(plan: ActionPlan, dep: str, why: ActionResult) -> ActionResult:
    """The result of an action not started because ``dep``, which it depends on, did not
    finish."""
    what = "failed" if why.outcome is Outcome.FAILED else "was not built"
    return action_result(
        plan.action,
        Outcome.SKIPPED,
        reasons=plan.reasons,
        error=f"not started because {dep}, which it depends on, {what}",
    )
