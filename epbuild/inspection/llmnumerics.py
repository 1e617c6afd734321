"""``verify --numerics`` of a quantized LLM: each static graph's ctx model and its QDQ graph
(on the CPU EP) are compared with the *float* static graph on the feeds genai gives it for
the recipe's prompts (its ``validation`` prompts, else its ``calibration`` ones), so that the
EP's error and the quantization's can be told apart (SQNR per output, logits and KV cache
alike), and each activation of the QDQ graph with the float graph's (ONNX Runtime's
``qdq_loss_debug``, as ``inspection.quantcheck``): the worst layers named.

The feeds are the calibration's (``epbuild.llm.calibrate.run_prompt``: the float graphs run
the prompts as genai does), ``FEEDS`` of each graph from the first ``PROMPTS`` prompts, so
that a check takes seconds. The ctx model runs in the loader process ``verify --load`` uses
(``inspection.loading``, this module's ``main``); its figures are judged by the recipe's
``[quantization.NAME.check] min_sqnr_db`` (``inspection.numerics``). Nothing is recorded:
the check runs each time it is asked for.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from functools import partial
from typing import Any

from epbuild.errors import EpbuildError, ProviderUnavailableError, ToolchainError
from epbuild.inspection.loadcheck import NO_COMPILE, Figures, _explain, answer
from epbuild.inspection.loading import load_spec, run_load
from epbuild.inspection.numerics import NumericsCheck, QuantTolerance, judge_figures
from epbuild.inspection.quantcheck import LayerErrors, passed
from epbuild.kinds.llmquant import LlmCalibrateAction, LlmQuantizeAction
from epbuild.llm.calibrate import (
    ITERATOR,
    cpu_session,
    float_chains,
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

PROMPTS = 2
"""Prompts whose feeds a check runs."""
FEEDS = 4
"""Feeds of each graph a check compares on (the first ones of those prompts)."""


def quantized_llm(ws: Workspace, action: CompileAction) -> Llm | None:
    """The quantized ``[llms]`` entry whose graph ``action`` compiles (None: another)."""
    group = action.group
    if isinstance(group, LlmGroup) and group.llm is not None and group.llm.quantize is not None:
        return group.llm
    return None


def check_llm_numerics(ws: Workspace, actions: list[CompileAction]) -> list[NumericsCheck]:
    """One verdict per ctx model of ``actions`` (compiles of quantized LLM graphs)."""
    out: list[NumericsCheck] = []
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
            check = run_load(ws.root, load_spec(action, index, {"llm": job}), python)
            recorded = {
                "outcome": check.outcome.value,
                "message": check.message,
                "outputs": check.outputs,
                **check.more,
            }
            out.append(judge_figures(action.id, ctx, recorded, tol, cached=False))
    return out


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
    feeds, ``qdq`` (the QDQ graph's on the CPU) and ``layers``."""
    spec = job["llm"]
    config = ProviderConfig.from_json(job["provider"])
    config = replace(config, session_options={**config.session_options, **NO_COMPILE})
    with open(os.path.join(spec["source"], GENAI_CONFIG), encoding="utf-8") as f:
        io = static_io(json.load(f), int(spec["window"]), int(spec["context"]))
    stage = spec["stage"]
    feeds = _feeds(spec, tokenize(spec["source"], spec["prompts"]), io, stage)
    reference = cpu_session(spec["graphs"][stage])
    names = [o.name for o in reference.get_outputs()]
    qdq = cpu_session(spec["qdq"])
    ctx_figures, qdq_figures = Figures(names), Figures(names)
    before = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="epbuild-llmlayers-", dir=job.get("scratch")) as tmp:
        tempfile.tempdir = os.path.abspath(tmp)  # qdq_loss_debug's own temporary folders
        try:
            with open_models([job["ctx"]], config) as built:
                layers = LayerErrors(
                    _copied(spec["graphs"][stage], tmp, "float"),
                    _copied(spec["qdq"], tmp, "qdq"),
                    tmp,
                )
                kv = {present for _, present in io.kv}
                for feed in feeds:
                    valid = partial(_valid, names, kv, int(feed[TOTAL_SEQ_LEN][0]))
                    want = valid(reference.run(names, feed))
                    ctx_figures.add(valid(built.run(built.names[0], feed, names)), want)
                    qdq_figures.add(valid(qdq.run(names, feed)), want)
                    layers.add(feed)
        except ProviderUnavailableError as exc:
            return {"outcome": "not_loadable_here", "message": exc.message}
        except EpbuildError as exc:
            return {"outcome": "failed", "message": _explain(exc.message)}
        finally:
            tempfile.tempdir = before
    return passed(ctx_figures, qdq_figures, layers)


def _valid(names: list[str], kv: set[str], total: int, outputs: list[Any]) -> list[Any]:
    """The outputs as far as a later run reads them: each KV-cache output up to the
    feed's ``total_seq_len`` (the positions after it are masked out: what a graph leaves
    there, the HTP and the CPU differ on, and no token depends on)."""
    return [
        out[:, :, :total] if name in kv else out for name, out in zip(names, outputs, strict=True)
    ]


def _copied(path: str, tmp: str, name: str) -> str:
    """A copy of the graph ``path`` and its external data in ``tmp/name``: onnx refuses to
    load external data with several hard links (the state directory's, linked from the
    cache), which ``qdq_loss_debug`` loads."""
    import onnx

    folder = os.path.join(tmp, name)
    os.makedirs(folder)
    model = onnx.load(path, load_external_data=False)
    locations = {
        entry.value
        for tensor in model.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    for location in locations:
        shutil.copyfile(
            os.path.join(os.path.dirname(path), location), os.path.join(folder, location)
        )
    copy = os.path.join(folder, os.path.basename(path))
    shutil.copyfile(path, copy)
    return copy


def _feeds(
    spec: dict[str, Any], prompts: list[list[int]], io: Any, stage: str
) -> list[dict[str, Any]]:
    """The first ``FEEDS`` feeds of ``stage`` the float graphs (after the embeddings
    stage of a decoder in parts) give the prompts (a context graph's: their windows, no
    token generated)."""
    found: list[dict[str, Any]] = []

    def collect(name: str, inputs: dict[str, Any], _: Any) -> None:
        if name == stage and len(found) < FEEDS:
            found.append(inputs)

    context, iterator = float_chains(spec["graphs"], spec.get("embeddings"), collect)
    for tokens in prompts:
        generate = io.fits(len(tokens)) if graph_of(stage) == ITERATOR else 0
        for _ in run_prompt(context, iterator, tokens, io, generate):
            if len(found) >= FEEDS:
                return found
    return found


def main() -> None:
    """Entry point: the loader of a quantized LLM graph's numerics."""
    answer(check)


if __name__ == "__main__":
    main()
