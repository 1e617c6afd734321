"""The LLM calibrate and quantize kinds: an ``[llms]`` entry with ``quantize = "<name>"``
gets, after its static preparation, one calibration of both graphs and one quantization
per graph, whose QDQ graphs its compile actions take instead of the float ones. A decoder
in ``parts`` gets one calibration of the chain of its parts (the CPU embeddings stage, then
each part's graphs on what the parts before it give them) writing one ranges file per part
graph, and one quantization per part graph: an edit in the last part changes no earlier
part's graph or ranges, so their quantizations and compiles are cut off early.

- ``llm-calibrate`` runs the text prompts of ``[quantization.<name>].calibration``, tokenized
  by the source's tokenizer, through the float static graphs on the CPU as genai runs them
  (``epbuild.llm.calibrate``), and writes each graph's ranges
  (``<state_dir>/llm/<name>/calibrated/<graph>.ranges.json``). Its key holds the prepared
  graphs' digests, each prompts file's, the source's config and tokenizer files', the
  method and the tool versions: an edit of types, exclusions or overrides keys nothing
  here.
- ``llm-quantize`` makes one graph's QDQ graph (``<state_dir>/llm/<name>/quantized/
  <graph>.onnx``: ``epbuild.llm.quantize``). Its key holds the prepared graph's digests, its
  ranges' digest and the recipe's settings: prompts that give the same ranges (the same
  ranges file) quantize nothing, and a QDQ graph that comes out byte-identical leaves the
  compiles up to date (early cutoff).
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import ModelError, UserError, VerificationError
from epbuild.fs import sha256_hex
from epbuild.kinds.calibrate import check_ranges
from epbuild.kinds.contract import Checked, Reported, RunContext, Wording
from epbuild.kinds.prepare import LlmStep, LlmStepKind, PrepareAction, graph_stages
from epbuild.kinds.quantize import check_qdq, recipe_settings
from epbuild.llm.calibmemo import MEMO, Keep, runs_name
from epbuild.llm.calibrate import GENERATED, StaticIo, static_io, tokenize
from epbuild.llm.calibrate import calibrate as run_calibration
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.llm.package import source_files
from epbuild.llm.parts import EMBEDDING_FILES, part_name
from epbuild.llm.prompts import PromptError, read_prompts
from epbuild.manifest.model import Llm, Quantization
from epbuild.onnx.staged import staged_names
from epbuild.planning.keys import ActionKey, KeyComputer
from epbuild.providers.distributions import dist_version
from epbuild.quant.work import _method, progress, quantizer_errors, scratch, versions

if TYPE_CHECKING:
    from epbuild.executors.job import Job

LLM_CALIBRATE_FORMAT = 1
"""Bump when the same inputs make other ranges."""
LLM_QUANTIZE_FORMAT = 1
"""Bump when the same inputs make another QDQ graph."""
CALIBRATED = "calibrated"
QUANTIZED = "quantized"
"""The folders of the ranges and of the QDQ graphs inside ``<state_dir>/llm/<name>/``."""
_VERSIONS = ("onnxruntime", "onnx")
GENAI_HINT = (
    'install onnxruntime-genai (its tokenizer reads the prompts): pip install "epbuild[genai]"'
)


def ranges_name(stage: str) -> str:
    """The file a graph's ranges are written to."""
    return f"{stage}.ranges.json"


@dataclass(frozen=True)
class LlmCalibrateAction(LlmStep):
    """The calibration of one LLM's static graphs."""

    KIND = "llm-calibrate"
    recipe: Quantization
    prepare: PrepareAction
    out_dir: str
    """``<state_dir>/llm/<name>/calibrated``."""

    @property
    def deps(self) -> tuple[str, ...]:
        return (self.prepare.id,)

    @property
    def graphs(self) -> dict[str, str]:
        """Graph name → workspace-relative prepared float graph, in session order (each
        part's, for a decoder in parts)."""
        stages = graph_stages(self.llm.parts)
        return dict(zip(stages, self.prepare.graphs, strict=True))

    @property
    def embeddings(self) -> str | None:
        """Workspace-relative CPU embeddings stage that feeds the parts (None: one part)."""
        if self.llm.parts == 1:
            return None
        return posixpath.join(self.prepare.out_dir, EMBEDDING_FILES[0])

    @property
    def ranges(self) -> dict[str, str]:
        """Graph name → workspace-relative ranges it writes."""
        stages = graph_stages(self.llm.parts)
        return {stage: posixpath.join(self.out_dir, ranges_name(stage)) for stage in stages}

    @property
    def label(self) -> str:
        """How messages name the prompts."""
        return f"quantization.{self.recipe.name}.calibration"


@dataclass(frozen=True)
class LlmQuantizeAction(LlmStep):
    """One static graph's quantization."""

    KIND = "llm-quantize"
    recipe: Quantization
    stage: str
    calibration: LlmCalibrateAction
    out_dir: str
    """``<state_dir>/llm/<name>/quantized``."""

    @property
    def deps(self) -> tuple[str, ...]:
        return (self.calibration.id, self.calibration.prepare.id)

    @property
    def graph(self) -> str:
        """Workspace-relative prepared float graph."""
        return self.calibration.graphs[self.stage]

    @property
    def output(self) -> str:
        """Workspace-relative QDQ graph."""
        return posixpath.join(self.out_dir, f"{self.stage}.onnx")

    @property
    def label(self) -> str:
        return f"llms.{self.llm.name} {self.stage} graph (quantization.{self.recipe.name})"


def llm_quant_actions(
    llm: Llm, recipe: Quantization, prepare: PrepareAction, state_dir: str
) -> tuple[LlmCalibrateAction, tuple[LlmQuantizeAction, ...]]:
    """A quantized LLM's calibration and its graphs' quantizations, in session order."""
    folder = posixpath.join(state_dir, "llm", llm.name)
    calibrate = LlmCalibrateAction(
        f"{llm.name}/calibrate", llm, recipe, prepare, posixpath.join(folder, CALIBRATED)
    )
    quantize = tuple(
        LlmQuantizeAction(
            f"{llm.name}/{stage}/quantize",
            llm,
            recipe,
            stage,
            calibrate,
            posixpath.join(folder, QUANTIZED),
        )
        for stage in graph_stages(llm.parts)
    )
    return calibrate, quantize


class LlmCalibrateKind(LlmStepKind):
    """``Kind`` of the LLM calibrations (``LlmCalibrateAction``); its job's user errors (a
    prompts file that cannot be read, a prompt longer than the KV cache) are bad input."""

    name = "llm-calibrate"
    runner = "epbuild.kinds.llmquant:calibrate"
    format = LLM_CALIBRATE_FORMAT
    words = Wording(
        "calibrated",
        "calibrating",
        "llms.{a.llm.name}: its static graphs are not calibrated yet for their current "
        "prompts ({a.id} runs first)",
    )
    checks_input = True

    def key(self, action: LlmCalibrateAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        inputs: dict[str, str] = {}
        for graph in action.graphs.values():
            inputs.update(keys.model_digests(graph, fresh=fresh))
        if action.embeddings is not None:
            inputs.update(keys.model_digests(action.embeddings, fresh=fresh))
        for rel in action.recipe.calibration:
            inputs[rel] = keys.input_digest(
                rel, f"prompts file of {action.label}", "restore it, or fix the calibration entry"
            )
        for rel in source_files(keys.root, action.llm):
            hint = f"restore it: {action.llm.source} is the source of llms.{action.llm.name}"
            inputs[rel] = keys.input_digest(rel, "the source's tokenizer or config", hint)
        return self.keyed(
            inputs,
            prompts=list(action.recipe.calibration),
            method=action.recipe.method,
            generated=GENERATED,
            window_size=action.llm.window_size,
            context_length=action.llm.context_length,
            versions={d: dist_version(d) for d in (*_VERSIONS, "onnxruntime-genai")},
        )

    def payload(
        self, action: LlmCalibrateAction, key: ActionKey, ctx: RunContext
    ) -> dict[str, Any]:
        more: dict[str, Any] = {}
        if action.embeddings is not None:
            more["embeddings"] = action.embeddings
            more["memo"] = {"previous": action.out_dir, "parts": _part_digests(action, ctx)}
            more["memo"]["settings"] = {
                k: v for k, v in key.components.items() if k not in ("inputs", "prompts")
            }
        return {
            **more,
            "graphs": action.graphs,
            "source": action.llm.source,
            "prompts": list(action.recipe.calibration),
            "method": action.recipe.method,
            "window": action.llm.window_size,
            "context": action.llm.context_length,
            "label": action.label,
        }

    def check(
        self, action: LlmCalibrateAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """Each graph's readable, non-empty ranges, nothing else (but the memo of a
        decoder in parts: its runs and ``memo.json``)."""
        names = staged_names(ctx.root, staging)
        wanted = [posixpath.basename(r) for r in action.ranges.values()]
        if action.embeddings is not None:
            parts = dict.fromkeys(part_name(k) for k in range(1, action.llm.parts + 1))
            for name in (MEMO, *(runs_name(p) for p in parts)):
                if name not in names:
                    raise VerificationError(f"expected output {name} was not written")
            memo = {MEMO, *(runs_name(p) for p in parts)}
            names = [n for n in names if n not in memo]
        for name in wanted:
            if name not in names:
                raise VerificationError(f"expected output {name} was not written")
            check_ranges(os.path.join(ctx.root, staging, name), name)
        extra = sorted(set(names) - set(wanted))
        if extra:
            raise VerificationError(f"unexpected output {extra[0]} staged by the calibration")
        return staged_names(ctx.root, staging), []


def _part_digests(action: LlmCalibrateAction, ctx: RunContext) -> dict[str, str]:
    """Each part's digest: of its graphs and their weights (the first part's with the
    embeddings stage's), in session order."""
    digests: dict[str, str] = {}
    found: dict[str, dict[str, str]] = {}
    if action.embeddings is not None:
        found[part_name(1)] = dict(ctx.keys.model_digests(action.embeddings))
    for stage, graph in action.graphs.items():
        part = stage.rsplit("_", 1)[0]
        found.setdefault(part, {}).update(ctx.keys.model_digests(graph))
    for part, inputs in found.items():
        digests[part] = sha256_hex(json.dumps(inputs, sort_keys=True).encode())
    return digests


def _settings(action: LlmQuantizeAction) -> dict[str, Any]:
    """What makes the QDQ graph besides its inputs: in its key, and given to its job."""
    return recipe_settings(action.recipe)


class LlmQuantizeKind(LlmStepKind):
    """``Kind`` of the LLM graphs' quantizations (``LlmQuantizeAction``); its job's user
    errors (a name the graph lacks) are bad input."""

    name = "llm-quantize"
    runner = "epbuild.kinds.llmquant:quantize"
    format = LLM_QUANTIZE_FORMAT
    words = Wording(
        "quantized",
        waits="llms.{a.llm.name}: its {a.stage} graph is not quantized yet for its current "
        "ranges ({a.id} runs first)",
    )
    checks_input = True

    def key(self, action: LlmQuantizeAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        inputs = keys.model_digests(action.graph, fresh=fresh)
        ranges = action.calibration.ranges[action.stage]
        calibrate = f"run 'epbuild build {action.calibration.id}'"
        inputs[ranges] = keys.input_digest(ranges, "calibration ranges", calibrate)
        return self.keyed(
            inputs,
            **_settings(action),
            output=posixpath.basename(action.output),
            versions={d: dist_version(d) for d in _VERSIONS},
        )

    def payload(self, action: LlmQuantizeAction, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        graphs = action.calibration.graphs if action.llm.parts > 1 else {}
        return {
            "graph": action.graph,
            "siblings": [g for stage, g in graphs.items() if stage != action.stage],
            "ranges": action.calibration.ranges[action.stage],
            "output": posixpath.basename(action.output),
            "label": action.label,
            "settings": _settings(action),
        }

    def check(
        self, action: LlmQuantizeAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """The QDQ graph (and its external data), readable, nothing else."""
        return check_qdq(ctx.root, staging, posixpath.basename(action.output), "QDQ graph"), []


LLM_CALIBRATE = LlmCalibrateKind()
LLM_QUANTIZE = LlmQuantizeKind()


def _require_genai() -> None:
    """A ``UserError`` unless onnxruntime-genai imports here (the tokenizer needs it): one
    that is missing, or installed but broken, each said as such."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as exc:
        if exc.name == "onnxruntime_genai":
            raise UserError("calibrating an LLM needs onnxruntime-genai", hint=GENAI_HINT) from None
        raise UserError(
            f"onnxruntime-genai is installed but does not import: {type(exc).__name__}: {exc}",
            hint='reinstall it (pip install --force-reinstall "epbuild[genai]"), or install '
            "what its error names",
        ) from None


def calibrate(job: Job, root: str) -> dict[str, Any]:
    """In the worker: read and tokenize the prompts, check each gives tokens that fit the
    KV cache, and calibrate both graphs on them."""
    _require_genai()
    t0 = time.perf_counter()
    args = job.payload
    label = str(args["label"])
    source = os.path.join(root, str(args["source"]))
    with open(os.path.join(source, GENAI_CONFIG), encoding="utf-8") as f:
        io = static_io(json.load(f), int(args["window"]), int(args["context"]))
    prompts: list[list[int]] = []
    for rel in args["prompts"]:
        try:
            texts = read_prompts(os.path.join(root, str(rel)), str(rel))
        except PromptError as exc:
            raise ModelError(f"{label}: {exc.message}", hint=_PROMPTS_HINT) from exc
        for line, tokens in enumerate(tokenize(source, texts), 1):
            if not tokens:  # genai refuses it ("input_ids is empty"); the graphs would not
                raise ModelError(
                    f"{label}: prompt {line} of {rel} gives no tokens: the source's "
                    "tokenizer reads nothing in it",
                    hint="give each line some text, or remove it",
                )
            if io.fits(len(tokens)) < 1:
                raise ModelError(
                    f"{label}: prompt {line} of {rel} is {len(tokens)} tokens: read in windows "
                    f"of {io.window}, it leaves no room in the KV cache of {io.context_length}",
                    hint="shorten the prompt, or raise context_length",
                )
            prompts.append(tokens)
    staging = os.path.join(root, job.staging)
    graphs = {stage: os.path.join(root, str(p)) for stage, p in dict(args["graphs"]).items()}
    ranges = {stage: os.path.join(staging, ranges_name(stage)) for stage in graphs}
    embeddings = args.get("embeddings")
    keep = _keep(root, staging, args.get("memo"), io)
    with progress(staging, "prompts") as report, scratch(staging):  # never /tmp
        counts = run_calibration(
            graphs,
            prompts,
            io,
            _method(str(args["method"])),
            ranges,
            report,
            None if embeddings is None else os.path.join(root, str(embeddings)),
            keep,
        )
    detail: dict[str, Any] = {"prompts": len(prompts), "tensors": counts}
    if keep is not None:
        detail["kept"] = keep.reused
    return {
        "seconds": time.perf_counter() - t0,
        "detail": detail,
        "versions": {**versions(), "onnxruntime-genai": dist_version("onnxruntime-genai")},
    }


_PROMPTS_HINT = "give .txt files of prompts, one a line, in UTF-8"


def _keep(root: str, staging: str, memo: Any, io: StaticIo) -> Keep | None:
    """The calibration's memo (``epbuild.llm.calibmemo``) of a decoder in parts; its
    settings hold what the source's config decides of the runs (``io``: the pad token
    that fills each prompt's last window, the names), which the key holds as a file's
    digest only."""
    if memo is None:
        return None
    previous = os.path.join(root, str(memo["previous"]))
    settings = {**memo["settings"], "io": [io.pad_token, io.kv, io.input_ids, io.logits]}
    settings = json.loads(json.dumps(settings, sort_keys=True))  # as the memo holds it
    return Keep(previous, staging, dict(memo["parts"]), settings)


def quantize(job: Job, root: str) -> dict[str, Any]:
    """In the worker: write one graph's QDQ graph from its ranges."""
    from epbuild.llm.quantize import quantize_graph  # imports onnx: the worker's only

    t0 = time.perf_counter()
    args = job.payload
    label = str(args["label"])
    output = os.path.join(root, job.staging, str(args["output"]))
    with scratch(os.path.join(root, job.staging)), quantizer_errors(label):  # not in /tmp
        qdq = quantize_graph(
            os.path.join(root, str(args["graph"])),
            os.path.join(root, str(args["ranges"])),
            output,
            dict(args["settings"]),
            label,
            [os.path.join(root, str(g)) for g in args.get("siblings", ())],
        )
    return {
        "seconds": time.perf_counter() - t0,
        "detail": {"qdq_nodes": qdq},
        "versions": versions(),
    }
