"""``verify --numerics`` of a quantized LLM: each static graph's ctx model and its QDQ graph
(on the CPU EP) are compared with the *float* static graph on the feeds genai gives it for
the recipe's prompts (its ``validation`` prompts, else its ``calibration`` ones), so that the
EP's error and the quantization's can be told apart (SQNR per output, logits and KV cache
alike), and each activation of the QDQ graph with the float graph's (matched as ONNX
Runtime's ``qdq_loss_debug`` matches them, taken from the graphs' own sessions:
``inspection.llmlayers``): the worst layers named.

The feeds are the calibration's (``epbuild.llm.calibrate.run_prompt``: the float graphs run
the prompts as genai does), ``FEEDS`` of each graph from the first ``PROMPTS`` prompts, one
of a graph of ``LARGE`` bytes (a feed of a large graph costs the emulated HTP tens of
seconds; the verdict says so), so that a check takes seconds. The ctx model runs in the
loader process ``verify --load`` uses (``inspection.loading``, this module's ``main``), one
loader a graph, ``jobs`` at once within the memory budget; in a loader one large
session is alive at a time (the float graphs, then the QDQ graph, then the ctx model). Its
figures are judged by the recipe's ``[quantization.NAME.check] min_sqnr_db``
(``inspection.numerics``). Nothing is recorded: the check runs each time it is asked for.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from epbuild.engine.memory import default_budget
from epbuild.errors import EpbuildError, ProviderUnavailableError, ToolchainError
from epbuild.inspection.loadcheck import NO_COMPILE, Figures, _explain, answer
from epbuild.inspection.loading import load_spec, run_load
from epbuild.inspection.numerics import NumericsCheck, QuantTolerance, judge_figures
from epbuild.inspection.quantcheck import LayerSums, passed
from epbuild.kinds.llmquant import LlmCalibrateAction, LlmQuantizeAction
from epbuild.llm.calibrate import (
    ITERATOR,
    graph_of,
    run_prompt,
    static_io,
    tokenize,
)
from epbuild.llm.genai_config import TOTAL_SEQ_LEN
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.llm.prompts import PromptError, read_prompts
from epbuild.manifest.model import Llm
from epbuild.planning.actions import CompileAction
from epbuild.planning.llms import LlmGroup
from epbuild.planning.workspace import Workspace
from epbuild.providers.contract import ProviderConfig
from epbuild.results import CheckStatus
from epbuild.runtime import open_models
from epbuild.toolchains.env import Toolchain

if TYPE_CHECKING:
    from epbuild.inspection.llmlayers import Augmented

PROMPTS = 2
"""Prompts whose feeds a check runs."""
FEEDS = 4
"""Feeds of each graph a check compares on (the first ones of those prompts)."""
LARGE = 256 << 20
"""A graph this large (bytes, weights included) is compared on one feed (``feeds_of``)."""


def quantized_llm(ws: Workspace, action: CompileAction) -> Llm | None:
    """The quantized ``[llms]`` entry whose graph ``action`` compiles (None: another)."""
    group = action.group
    if isinstance(group, LlmGroup) and group.llm is not None and group.llm.quantize is not None:
        return group.llm
    return None


def check_llm_numerics(
    ws: Workspace, actions: list[CompileAction], jobs: int = 1
) -> list[NumericsCheck]:
    """One verdict per ctx model of ``actions`` (compiles of quantized LLM graphs), the
    graphs checked in up to ``jobs`` loader processes at once, as many as the memory budget
    holds (``loaders``): the emulated HTP runs a graph on one core."""
    out: list[NumericsCheck | Callable[[], NumericsCheck]] = []
    peaks: list[int] = []
    for action in actions:
        llm = quantized_llm(ws, action)
        assert llm is not None and llm.quantize is not None
        recipe = ws.manifest.quantization[llm.quantize]
        tol = QuantTolerance(recipe.check.min_sqnr_db, None)

        def verdict(ctx: str, status: CheckStatus, reason: str) -> NumericsCheck:
            return NumericsCheck(action.id, ctx, status, reason, tolerance=tol)  # noqa: B023

        try:
            toolchain = ws.keys.toolchains.get(action.provider)
        except ToolchainError as exc:
            why = f"its toolchain is not usable here: {exc.message}"
            out += [verdict(c, CheckStatus.NOT_CHECKABLE, why) for c in action.ctx_paths]
            continue
        try:
            prompts = _prompts(ws, recipe.feeds, f"quantization.{recipe.name}")
        except PromptError as exc:
            out += [verdict(c, CheckStatus.FAILED, exc.message) for c in action.ctx_paths]
            continue
        graphs = _graphs(ws, llm)
        python = toolchain.python if isinstance(toolchain, Toolchain) else None
        for index, ctx in enumerate(action.ctx_paths):
            stage = action.entries[index].name
            if stage not in graphs[1]:
                out.append(verdict(ctx, CheckStatus.FAILED, f"no QDQ graph of {stage}"))
                continue
            job = {
                "source": llm.source,
                "graphs": graphs[0],
                "embeddings": graphs[2],
                "qdq": graphs[1][stage],
                "stage": stage,
                "window": llm.window_size,
                "context": llm.context_length,
                "prompts": prompts,
            }
            spec = load_spec(action, index, {"llm": job})
            out.append(partial(_run, ws.root, spec, python, action.id, tol))
            folders = {os.path.dirname(os.path.join(ws.root, g)) for g in graphs[0].values()}
            held = [graphs[1][stage], ctx, os.path.splitext(ctx)[0] + "_qnn.bin"]
            peaks.append(
                sum(map(_folder_size, folders)) + sum(_size(os.path.join(ws.root, g)) for g in held)
            )
    pending = [o for o in out if callable(o)]
    with ThreadPoolExecutor(max_workers=loaders(jobs, peaks)) as pool:
        done = iter(list(pool.map(lambda run: run(), pending)))
    return [next(done) if callable(o) else o for o in out]


def loaders(jobs: int, peaks: list[int]) -> int:
    """How many loaders run at once: ``jobs`` (at least one), no more than the memory
    budget holds of the largest predicted peak (``peaks``: each loader's graphs' bytes:
    the float graphs it runs the prompts through (their folders), its QDQ graph and its
    ctx model and binary)."""
    most = max(1, jobs)
    if not peaks:
        return 1
    return max(1, min(most, len(peaks), default_budget() // max(1, max(peaks))))


def _run(
    root: str, spec: dict[str, Any], python: str | None, action: str, tol: QuantTolerance
) -> NumericsCheck:
    """One graph's check in its loader process, judged."""
    check = run_load(root, spec, python)
    recorded = {
        "outcome": check.outcome.value,
        "message": check.message,
        "outputs": check.outputs,
        **check.more,
    }
    return judge_figures(action, spec["job"]["ctx"], recorded, tol, cached=False)


def _folder_size(folder: str) -> int:
    """The bytes of the files in ``folder`` (0: none)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    return sum(_size(os.path.join(folder, n), "") for n in names)


def _size(path: str, data: str = ".data") -> int:
    """The bytes of a file and of its external data beside it (``<path>.data``; 0: none)."""
    size = 0
    for name in dict.fromkeys((path, path + data)):
        try:
            size += os.path.getsize(name)
        except OSError:
            pass
    return size


def _prompts(ws: Workspace, files: tuple[str, ...], label: str) -> list[str]:
    """The first ``PROMPTS`` prompts of the recipe's prompt files."""
    found: list[str] = []
    for rel in files:
        found += read_prompts(os.path.join(ws.root, rel), rel)
        if len(found) >= PROMPTS:
            break
    if not found:
        raise PromptError(f"{label}: no prompt to check on")
    return found[:PROMPTS]


def _graphs(ws: Workspace, llm: Llm) -> tuple[dict[str, str], dict[str, str], str | None]:
    """The LLM's float static graphs and its QDQ graphs (stage → workspace-relative), and
    the CPU embeddings stage of a decoder in parts (None: one part)."""
    floats: dict[str, str] = {}
    qdq: dict[str, str] = {}
    embeddings = None
    for action in ws.graph:
        if isinstance(action, LlmCalibrateAction) and action.llm.name == llm.name:
            floats, embeddings = dict(action.graphs), action.embeddings
        elif isinstance(action, LlmQuantizeAction) and action.llm.name == llm.name:
            qdq[action.stage] = action.output
    return floats, qdq, embeddings


def check(job: dict[str, Any]) -> dict[str, Any]:
    """In the loader: the ctx model's figures against the float graph on the prompts'
    feeds, ``qdq`` (the QDQ graph's on the CPU) and ``layers``. One large session is
    alive at a time: the float graphs run the prompts first (the checked graph's session
    giving its outputs and activations as it goes), then the QDQ graph, then the ctx
    model."""
    from epbuild.inspection.llmlayers import (
        Augmented,
        chains,
        float_graph,
        qdq_graph,
        weight_bytes,
    )

    spec = job["llm"]
    config = ProviderConfig.from_json(job["provider"])
    config = replace(config, session_options={**config.session_options, **NO_COMPILE})
    with open(os.path.join(spec["source"], GENAI_CONFIG), encoding="utf-8") as f:
        io = static_io(json.load(f), int(spec["window"]), int(spec["context"]))
    stage = spec["stage"]
    floats, tensors = float_graph(spec["graphs"][stage])
    checked = Augmented(floats, spec["graphs"][stage], tensors)
    names = list(checked.outputs)
    count = feeds_of(weight_bytes(floats))
    make = partial(chains, spec["graphs"], spec.get("embeddings"), stage, checked)
    runs = _feeds(tokenize(spec["source"], spec["prompts"]), io, stage, checked, count, make)
    del checked, make
    gc.collect()
    kv = {present for _, present in io.kv}
    ctx_figures, qdq_figures, layers = Figures(names), Figures(names), LayerSums()
    feeds, wants = [], []
    qdq = qdq_graph(spec["qdq"], floats, tensors)
    for feed, outputs, activations in runs:
        valid = partial(_valid, names, kv, int(feed[TOTAL_SEQ_LEN][0]))
        want = valid(outputs)
        got, found = qdq.run(feed, names)
        qdq_figures.add(valid(got), want)
        layers.fold(found, activations)
        feeds.append(feed)
        wants.append(want)
        del got, found, outputs, activations
    del qdq, runs
    gc.collect()
    try:
        with open_models([job["ctx"]], config) as built:
            for feed, want in zip(feeds, wants, strict=True):
                valid = partial(_valid, names, kv, int(feed[TOTAL_SEQ_LEN][0]))
                ctx_figures.add(valid(built.run(built.names[0], feed, names)), want)
    except ProviderUnavailableError as exc:
        return {"outcome": "not_loadable_here", "message": exc.message}
    except EpbuildError as exc:
        return {"outcome": "failed", "message": _explain(exc.message)}
    result = passed(ctx_figures, qdq_figures, layers)
    if count < FEEDS:  # a large graph: say on how little it was judged
        result["message"] = f"compared on {len(feeds)} feed(s) of this graph (a large graph)"
    return result


def _valid(names: list[str], kv: set[str], total: int, outputs: list[Any]) -> list[Any]:
    """The outputs as far as a later run reads them: each KV-cache output up to the
    feed's ``total_seq_len`` (the positions after it are masked out: what a graph leaves
    there, the HTP and the CPU differ on, and no token depends on)."""
    return [
        out[:, :, :total] if name in kv else out for name, out in zip(names, outputs, strict=True)
    ]


def feeds_of(weights: int) -> int:
    """How many feeds a graph of ``weights`` bytes of weights is compared on: ``FEEDS``,
    one of a graph of ``LARGE`` bytes or more (each feed of a large graph costs the
    emulated HTP tens of seconds)."""
    return 1 if weights >= LARGE else FEEDS


Run = tuple[dict[str, Any], list[Any], dict[str, list[Any]]]
"""One feed of the checked graph, its float outputs and its activations."""


def _feeds(
    prompts: list[list[int]],
    io: Any,
    stage: str,
    checked: Augmented,
    count: int,
    make_chains: Callable[[Callable[..., None]], tuple[Any, Any]],
) -> list[Run]:
    """The first ``count`` feeds of ``stage`` the float graphs (after the embeddings
    stage of a decoder in parts) give the prompts (a context graph's: their windows, no
    token generated), with ``stage``'s float outputs and activations (``checked``: its
    ``llmlayers.Augmented`` session, run in the chain in its place; ``make_chains``: the
    float chains given a ``collect``)."""
    found: list[Run] = []

    def collect(name: str, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        if name == stage and len(found) < count:
            acts = {a: [outputs[a]] for a in checked.activations}
            found.append((inputs, [outputs[n] for n in checked.outputs], acts))

    context, iterator = make_chains(collect)
    for tokens in prompts:
        generate = io.fits(len(tokens)) if graph_of(stage) == ITERATOR else 0
        for _ in run_prompt(context, iterator, tokens, io, generate):
            if len(found) >= count:
                return found
    return found


def main() -> None:
    """Entry point: the loader of a quantized LLM graph's numerics."""
    answer(check)


if __name__ == "__main__":
    main()
