"""The prepare kind: an ``[llms]`` entry's single decoder made into its two static graphs
(``context``, ``iterator``) and the default ``op_affinity.json``, in a worker, as an action
of the graph like any other (keyed, cached, journaled, restorable, farmed out). With
``parts`` it writes the CPU ``embeddings`` stage, each part's two graphs and data file, and
``parts.json`` instead (``llm.partgraphs``; ``parts`` joins the key).

Its outputs go to ``<state_dir>/llm/<name>/prepared/``; the LLM's compile actions read them
and depend on it. Its key holds the source decoder's digests (and its external data's),
``window_size``, ``context_length``, ``head_size``, the preparation's format and the onnx
version that writes the graphs: an edit of the source's ``genai_config.json`` that does not
change ``head_size`` (search options, token ids) keys nothing, and a preparation that comes
out byte-identical leaves the compiles up to date (their keys hash the prepared bytes).
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import time
from collections.abc import Mapping
from typing import Any

from epbuild._dataclass import dataclass
from epbuild.errors import ModelError, VerificationError
from epbuild.executors.job import Job
from epbuild.kinds.contract import BaseKind, Checked, OwnStep, Reported, RunContext, Wording
from epbuild.llm.parts import EMBEDDING_FILES, PARTS_JSON, part_stages
from epbuild.llm.prepare import AFFINITY, AFFINITY_JSON, PREP_FORMAT, STAGES
from epbuild.manifest.model import Llm
from epbuild.planning.keys import ActionKey, KeyComputer

PREPARED = "prepared"
"""The folder of the prepared graphs inside ``<state_dir>/llm/<name>/``."""
GRAPHS = tuple(f"{stage}.onnx" for stage, _ in STAGES)
"""The graphs it writes, in session order (one part)."""


def graph_stages(parts: int) -> tuple[str, ...]:
    """The names of the compiled graphs of a preparation into ``parts`` parts, in session
    order (``context``, ``iterator``, or each part's)."""
    return tuple(stage for stage, _ in (STAGES if parts == 1 else part_stages(parts)))


def graph_files(parts: int) -> tuple[str, ...]:
    """The compiled graphs of a preparation into ``parts`` parts, in session order."""
    if parts == 1:
        return GRAPHS
    return tuple(f"{stage}.onnx" for stage in graph_stages(parts))


@dataclass(frozen=True)
class LlmStep(OwnStep):
    """What the actions an ``[llms]`` entry adds around its compiles have alike: an id and
    the entry (their first fields), they are named after the entry, run in epbuild's own
    environment, and their kind is ``KIND``."""

    id: str
    llm: Llm

    @property
    def group_name(self) -> str:
        return self.llm.name


@dataclass(frozen=True)
class PrepareAction(LlmStep):
    """One LLM's static preparation."""

    KIND = "prepare"
    model: str
    """Workspace-relative source decoder."""
    out_dir: str
    """``<state_dir>/llm/<name>/prepared``."""
    deps: tuple[str, ...] = ()

    @property
    def graphs(self) -> tuple[str, ...]:
        """Workspace-relative paths of the compiled graphs, in session order."""
        return tuple(posixpath.join(self.out_dir, g) for g in graph_files(self.llm.parts))

    @property
    def affinity(self) -> str:
        """Workspace-relative path of the prepared ``op_affinity.json``."""
        return posixpath.join(self.out_dir, AFFINITY)


def prepare_action(llm: Llm, state_dir: str) -> PrepareAction:
    """The preparation of a single-decoder LLM entry."""
    model = posixpath.join(llm.source, llm.files[0])
    out_dir = posixpath.join(state_dir, "llm", llm.name, PREPARED)
    return PrepareAction(f"{llm.name}/prepare", llm, model, out_dir)


class LlmStepKind(BaseKind):
    """What the kinds of an ``[llms]`` entry's steps (``LlmStep``: its preparation,
    calibration and quantizations) have alike: their outputs are graphs and ranges in the
    state directory that only ``llm.sessions`` (which maps the weights), copies and ONNX
    Runtime read, so the cache takes them by hard link (``BaseKind.stored_by_link``)."""

    stored_by_link = True


class PrepareKind(LlmStepKind):
    """``Kind`` of the LLM preparations (``PrepareAction``)."""

    name = "prepare"
    runner = "epbuild.kinds.prepare:run"
    format = PREP_FORMAT
    words = Wording(
        "prepared",
        waits="llms.{a.llm.name}: its static graphs are not prepared yet for its current "
        "source ({a.id} runs first)",
    )
    checks_input = True
    """A source whose config contradicts its graph, or whose decoder cannot be prepared, is
    a source mistake like any other: exit 2."""

    def key(self, action: PrepareAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        from epbuild.providers.distributions import dist_version

        inputs = keys.model_digests(action.model, fresh=fresh)
        refused = _config_against_graph(keys.root, action)
        if refused is not None:  # the package would name inputs the graphs do not have
            raise refused
        llm = action.llm
        more: dict[str, Any] = {"parts": llm.parts} if llm.parts > 1 else {}
        return self.keyed(
            inputs,
            window_size=llm.window_size,
            context_length=llm.context_length,
            head_size=llm.head_size,
            **more,
            versions={"onnx": dist_version("onnx")},
        )

    def payload(self, action: PrepareAction, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        llm = action.llm
        payload = {
            "model": action.model,
            "window": llm.window_size,
            "context": llm.context_length,
            "head_size": llm.head_size,
        }
        if llm.parts > 1:
            payload["parts"] = llm.parts
            payload["previous"] = action.out_dir  # its data files are kept where unchanged
        return payload

    def check(
        self, action: PrepareAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """The graphs and the affinity file were staged, each graph is readable and its
        external data are files staged beside it; nothing else was staged. Also removes
        what older epbuild versions left beside the prepared folder (a keyed folder per
        preparation, a killed preparation's temporary), under the action's lock."""
        from epbuild.fs import is_safe_reference
        from epbuild.onnx.proto import ProtoError, read_model
        from epbuild.onnx.staged import staged_names

        names = staged_names(ctx.root, staging)
        graphs = graph_files(action.llm.parts)
        more: tuple[str, ...] = ()
        if action.llm.parts > 1:
            graphs, more = (EMBEDDING_FILES[0], *graphs), (PARTS_JSON,)
        for required in (*graphs, *more, AFFINITY):
            if required not in names:
                raise VerificationError(f"expected output {required} was not written")
        data: set[str] = set()
        for graph in graphs:
            try:
                info = read_model(os.path.join(ctx.root, staging, graph))
            except ProtoError as exc:
                raise VerificationError(f"{graph}: unreadable prepared graph ({exc})") from exc
            for ref in info.external_refs:
                if not is_safe_reference(ref.location) or ref.location not in names:
                    raise VerificationError(
                        f"{graph}: external data {ref.location!r} was not written beside it"
                    )
                data.add(ref.location)
        extra = sorted(set(names) - {*graphs, *more, AFFINITY} - data)
        if extra:
            raise VerificationError(f"unexpected output {extra[0]} staged by the preparation")
        _remove_legacy(os.path.join(ctx.root, posixpath.dirname(action.out_dir)))
        return names, []


def _config_against_graph(root: str, action: PrepareAction) -> ModelError | None:
    """A config whose layers, KV heads or head size are not the graph's: the package
    would name inputs the graphs do not have, and its sizes would be wrong."""
    import json

    from epbuild.kinds.shapes import graph_inputs
    from epbuild.llm.genai_schema import GENAI_CONFIG

    inputs = graph_inputs(root, action.model)
    config_path = posixpath.join(action.llm.source, GENAI_CONFIG)
    try:
        with open(os.path.join(root, config_path), encoding="utf-8") as f:
            decoder = json.load(f)["model"]["decoder"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the manifest read it a moment ago: a racing edit, planned again
    if inputs is None:
        return None  # unreadable: the preparation says why
    template = decoder.get("inputs", {}).get("past_key_names", "past_key_values.%d.key")
    pattern = re.compile(re.escape(template).replace("%d", r"\d+"))
    shapes = {i.name: i.shape for i in inputs if pattern.fullmatch(i.name)}
    found: list[str] = []
    layers = decoder["num_hidden_layers"]
    if len(shapes) != layers:
        found.append(f"model.decoder.num_hidden_layers is {layers}, the graph has {len(shapes)}")
    head, hidden, heads = (
        decoder.get(k) for k in ("head_size", "hidden_size", "num_attention_heads")
    )
    if all(isinstance(v, int) for v in (head, hidden, heads)) and hidden != head * heads:
        found.append(
            f"model.decoder.head_size is {head}, hidden_size / num_attention_heads is "
            f"{hidden} / {heads}"
        )
    shape = shapes.get(template % 0) or ()
    if len(shape) == 4:
        for key, dim in (("num_key_value_heads", shape[1]), ("head_size", shape[3])):
            want = decoder.get(key)
            if isinstance(dim, int) and isinstance(want, int) and want != dim:
                found.append(f"model.decoder.{key} is {want}, the graph's is {dim}")
    if not found:
        return None
    return ModelError(
        f"{config_path}: {'; '.join(found)} ({action.model}: {template} inputs)",
        hint="use the genai_config.json written with this model",
    )


_LEGACY = re.compile(r"[0-9a-f]{24}(\.lock)?|\.prep-.*")
"""Names older epbuild versions used in ``<state_dir>/llm/<name>/``."""


def _remove_legacy(folder: str) -> None:
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if _LEGACY.fullmatch(name):
            path = os.path.join(folder, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def run(job: Job, root: str) -> dict[str, Any]:
    """In the worker: write the static graphs and ``op_affinity.json`` into the staging
    directory (``ModelError`` with the reason when the decoder cannot be prepared)."""
    import importlib.metadata
    import json

    t0 = time.perf_counter()
    args = job.payload
    if int(args.get("parts", 1)) > 1:
        detail = _run_parts(args, root, job.staging)
    else:
        _run_whole(args, root, job.staging)
        detail = {}
    with open(os.path.join(root, job.staging, AFFINITY), "w", encoding="utf-8") as f:
        json.dump(AFFINITY_JSON, f)
    return {
        "seconds": time.perf_counter() - t0,
        "detail": detail,
        "versions": {"onnx": importlib.metadata.version("onnx")},
    }


def _run_parts(args: Mapping[str, Any], root: str, staging: str) -> dict[str, Any]:
    """Write the CPU embeddings stage and each part's graphs (``llm.partgraphs``)."""
    from epbuild.llm.partgraphs import PartShape, write_parts
    from epbuild.llm.static import StaticPrepError

    shape = PartShape(
        int(args["window"]), int(args["context"]), int(args["head_size"]), int(args["parts"])
    )
    model = os.path.join(root, str(args["model"]))
    try:
        previous = args.get("previous")
        kept = os.path.join(root, str(previous)) if previous else None
        split = write_parts(model, os.path.join(root, staging), shape, kept)
    except StaticPrepError as exc:
        raise ModelError(
            f"{args['model']}: splitting into parts failed: {exc}",
            hint="epbuild splits decoders as genai's model builder writes them",
        ) from exc
    return {"layers": [[r.start, r.stop - 1] for r in split]}


def _run_whole(args: Mapping[str, Any], root: str, staging: str) -> None:
    """Write the two static graphs of one part."""
    import onnx

    from epbuild.llm.sessions import load_weights, structure
    from epbuild.llm.static import StaticPrepError, StaticShape, make_static

    path = os.path.join(root, str(args["model"]))  # its weights read as ONNX Runtime reads them
    model = load_weights(structure(path), os.path.dirname(path))  # (a hard-linked data file)
    for stage, sequence in STAGES:
        shape = StaticShape(sequence or int(args["window"]), int(args["context"]),
                            int(args["head_size"]))  # fmt: skip
        try:
            static = make_static(model, shape)
        except StaticPrepError as exc:
            raise ModelError(
                f"{args['model']}: static preparation failed: {exc}",
                hint="epbuild prepares decoders as genai's model builder writes them",
            ) from exc
        onnx.save(
            static,
            os.path.join(root, staging, f"{stage}.onnx"),
            save_as_external_data=True,
            location=f"{stage}.onnx.data",
        )


PREPARE = PrepareKind()
