"""Calibration feeds of an LLM's static graphs: text prompts, tokenized with the source's
own tokenizer (onnxruntime-genai's), run through the float ``context`` and ``iterator``
graphs on the CPU exactly as genai's ``decoder-pipeline`` runs them on the device, so that
the feeds a calibration sees are the graphs' real inputs, KV cache included.

The recipe genai follows (measured: the CPU tokens of the static graphs fed this way are
genai's CPU tokens of the source): the prompt left-aligned and padded with the pad token to
whole windows; each window run by the context graph with ``past_seq_len = [[end - 1]]`` and
``total_seq_len = [end]`` (``end``: the window's last position + 1); then each generated
token run by the iterator graph at its position ``pos`` with ``past_seq_len = [[pos]]`` and
``total_seq_len = [pos + 1]``; one fixed-size KV cache throughout, each graph's ``present``
outputs fed back as the next run's ``past`` inputs.

Imports numpy and onnxruntime (and onnxruntime-genai to tokenize): call it from a worker.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.llm.genai_config import EMBEDDINGS, PAST_SEQ_LEN, TOTAL_SEQ_LEN, io_names
from epbuild.quant.work import _canonical

if TYPE_CHECKING:
    import numpy as np

    from epbuild.llm.calibmemo import Keep

CONTEXT = "context"
ITERATOR = "iterator"
GENERATED = 16
"""Tokens each prompt is continued by (greedily, with the float graphs), whose iterator
runs are calibration feeds too (fewer where the KV cache ends first)."""
CHUNK = 16
"""Feeds of one graph whose activations a calibration holds at once (folded into the
ranges chunk by chunk, as ``quant.work`` does)."""
EXCLUDED_OPS = ("Cast",)
"""Op types ONNX Runtime's QNN config leaves unquantized (its ``OP_TYPES_TO_EXCLUDE``):
every other op's tensors are calibrated, ``GroupQueryAttention``'s KV cache included."""


def tokenize(folder: str, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt's token ids, by the tokenizer of the genai model ``folder`` (genai's
    own: the ids genai feeds the package)."""
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(og.Config(folder))
    return [[int(t) for t in tokenizer.encode(p)] for p in prompts]


@dataclass(frozen=True)
class StaticIo:
    """The static graphs' names and sizes a feed needs."""

    window: int
    """The context graph's tokens per run."""
    context_length: int
    """The KV cache's length."""
    pad_token: int
    """What pads a prompt to whole windows (genai pads with the config's ``pad_token_id``)."""
    kv: tuple[tuple[str, str], ...]
    """(past input, present output) of each KV-cache tensor."""
    input_ids: str = "input_ids"
    logits: str = "logits"

    def fits(self, tokens: int) -> int:
        """How many tokens a prompt of ``tokens`` may be continued by (<= 0: none: its
        padded windows fill the KV cache)."""
        padded = -(-tokens // self.window) * self.window
        return min(GENERATED, self.context_length - max(padded, tokens))


def _int32(value: int, shape: tuple[int, ...]) -> np.ndarray:
    import numpy as np

    return np.full(shape, value, dtype=np.int32)


def run_prompt(
    context: Any,
    iterator: Any,
    tokens: Sequence[int],
    io: StaticIo,
    generate: int,
    forced: Sequence[int] | None = None,
) -> Iterator[tuple[str, dict[str, np.ndarray], int]]:
    """Run one prompt as genai does: yields each run's graph name, feed and the token the
    run chose greedily (the context graph's last window chooses the first new token), then
    continues by ``generate`` tokens. ``context``/``iterator``: ORT sessions of the float
    graphs (``run(None, feed)``). ``forced``: the tokens to continue by instead of the
    chosen ones (teacher forcing: each run still yields its own choice)."""
    import numpy as np

    past = {
        name: np.zeros(tuple(shape), dtype=np.float32)
        for name, shape in _kv_shapes(context, io).items()
    }
    last = len(tokens) - 1
    chosen = 0
    for start in range(0, len(tokens), io.window):
        end = start + io.window
        chunk = list(tokens[start:end]) + [io.pad_token] * max(0, end - len(tokens))
        feed = {
            io.input_ids: np.asarray([chunk], dtype=np.int64),
            PAST_SEQ_LEN: _int32(end - 1, (1, 1)),
            TOTAL_SEQ_LEN: _int32(end, (1,)),
            **past,
        }
        logits, past = _step(context, feed, io)
        if start <= last < end:
            chosen = int(np.argmax(logits[0, last - start]))
        yield CONTEXT, feed, chosen
    pos = len(tokens)
    for step in range(generate):
        if forced is not None:
            chosen = forced[step]
        feed = {
            io.input_ids: np.asarray([[chosen]], dtype=np.int64),
            PAST_SEQ_LEN: _int32(pos, (1, 1)),
            TOTAL_SEQ_LEN: _int32(pos + 1, (1,)),
            **past,
        }
        logits, past = _step(iterator, feed, io)
        chosen = int(np.argmax(logits[0, -1]))
        yield ITERATOR, feed, chosen
        pos += 1


def _kv_shapes(session: Any, io: StaticIo) -> dict[str, list[int]]:
    shapes = {i.name: i.shape for i in session.get_inputs()}
    return {past: shapes[past] for past, _ in io.kv if past in shapes}


def _step(
    session: Any, feed: dict[str, np.ndarray], io: StaticIo
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    kv = [(past, present) for past, present in io.kv if past in feed]
    outputs = session.run([io.logits, *(present for _, present in kv)], feed)
    return outputs[0], {past: out for (past, _), out in zip(kv, outputs[1:], strict=True)}


def greedy(
    context: Any, iterator: Any, tokens: Sequence[int], io: StaticIo, generate: int
) -> list[int]:
    """The tokens the float static graphs generate from ``tokens`` (the first from the
    prompt's last window, then ``generate - 1`` by the iterator)."""
    chosen = [t for graph, _, t in run_prompt(context, iterator, tokens, io, generate - 1)]
    windows = -(-len(tokens) // io.window)
    return chosen[windows - 1 :]


def teacher_forced(
    context: Any, iterator: Any, tokens: Sequence[int], io: StaticIo, forced: Sequence[int]
) -> list[int]:
    """The static graphs' own greedy choice at each of ``len(forced)`` steps after the
    prompt ``tokens``, each step continuing from ``forced``'s token (as
    ``epbuild.llm.generate`` teacher-forces a package), up to where the KV cache ends."""
    room = io.context_length - len(tokens)
    steps = min(len(forced), room)
    if steps < 1:
        return []
    chosen = [t for _, _, t in run_prompt(context, iterator, tokens, io, steps - 1, forced)]
    windows = -(-len(tokens) // io.window)
    return chosen[windows - 1 :]


def cpu_session(path: str) -> Any:
    """An ORT CPU session of one graph (what calibration runs)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])


def static_io(config: Mapping[str, Any], window: int, context_length: int) -> StaticIo:
    """The static graphs' names and pad token, from the source's ``genai_config.json``."""
    model = config["model"]
    inputs, outputs = io_names(model["decoder"])
    pad = model.get("pad_token_id", 0)
    pad = pad[0] if isinstance(pad, list) and pad else pad
    past = inputs[3:]  # input_ids, past_seq_len, total_seq_len, then the KV cache
    return StaticIo(
        window,
        context_length,
        int(pad) if isinstance(pad, int) else 0,
        tuple(zip(past, outputs[1:], strict=True)),
        input_ids=inputs[0],
        logits=outputs[0],
    )


class Chain:
    """Stages run one after another as one graph (what ``run_prompt`` takes for a
    session): each stage reads what the feed and the stages before it give, by name, as
    genai's ``decoder-pipeline`` feeds them. ``collect(stage, inputs, outputs)`` is given
    each stage's run by name (the calibration's statistics among its outputs)."""

    def __init__(
        self,
        stages: Sequence[tuple[str, Any]],
        collect: Callable[[str, dict[str, np.ndarray], dict[str, np.ndarray]], None],
    ) -> None:
        self.stages = list(stages)
        self.collect = collect

    def get_inputs(self) -> list[Any]:
        """Every stage's inputs (a later stage's repeat an earlier one's)."""
        return [i for _, session in self.stages for i in session.get_inputs()]

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[Any]:
        store = self.store(feed)
        return [store[n] for n in names or ()]

    def store(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The feed and every stage's outputs by name, each stage run on what the feed and
        the stages before it give (and given to ``collect``)."""
        store = dict(feed)
        for stage, session in self.stages:
            inputs = {i.name: store[i.name] for i in session.get_inputs()}
            outputs = session.run(None, inputs)
            found = dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))
            self.collect(stage, inputs, found)
            store.update(found)
        return store


def graph_of(stage: str) -> str:
    """``context`` or ``iterator``: which of its part's graphs ``stage`` is."""
    return CONTEXT if stage == CONTEXT or stage.endswith("_" + CONTEXT) else ITERATOR


REPLAY = "replay"
"""The stage that stands for the parts a calibration kept (``calibmemo.Replay``)."""


def float_chains(
    graphs: Mapping[str, str], embeddings: str | None, collect: Any
) -> tuple[Chain, Chain]:
    """The float chains genai runs for a prompt window and for a token (``graphs``'
    context graphs, their iterator graphs, after the CPU ``embeddings`` stage of a decoder
    in parts), each weight held once (``SharedWeights``); ``collect`` as ``Chain``'s."""
    from epbuild.llm.sessions import SharedWeights, structure

    weights = SharedWeights()

    def session(path: str) -> Any:
        return weights.session(structure(path), os.path.dirname(os.path.abspath(path)))

    first = [] if embeddings is None else [(EMBEDDINGS, session(embeddings))]
    context, iterator = (
        Chain([*first, *((s, session(p)) for s, p in graphs.items() if graph_of(s) == g)], collect)
        for g in (CONTEXT, ITERATOR)
    )
    return context, iterator


def part_of(stage: str) -> str:
    """The part ``stage`` belongs to (``partK``; ``""`` for a decoder in one part)."""
    return stage[: -len(graph_of(stage))].rstrip("_")


def _parts(graphs: Mapping[str, str]) -> list[str]:
    """The parts of ``graphs``, in session order."""
    return list(dict.fromkeys(part_of(s) for s in graphs))


def _augmented(path: str, method: Any, weights: Any) -> tuple[Any, Any]:
    """A session of the float graph at ``path`` that also gives its tensors' statistics
    for ``method`` (``epbuild.llm.ranges``), its weights ``weights``' (``SharedWeights``),
    without graph optimizations (as ORT's calibrators run); and its ``Ranges``."""
    from epbuild.llm.quantize import infer_shapes
    from epbuild.llm.ranges import Ranges, augment, calibrated_tensors
    from epbuild.llm.sessions import structure

    model = infer_shapes(structure(path))
    ops = {n.op_type for n in model.graph.node} - {*EXCLUDED_OPS}
    tensors = calibrated_tensors(model, ops)
    model = augment(model, tensors, method.name == "MinMax")
    folder = os.path.dirname(os.path.abspath(path))
    return weights.session(model, folder, optimize=False), Ranges(tensors, method, CHUNK)


def calibrate(
    graphs: Mapping[str, str],
    prompts: Sequence[Sequence[int]],
    io: StaticIo,
    method: Any,
    ranges: Mapping[str, str],
    progress: Callable[[int, int], None] | None = None,
    embeddings: str | None = None,
    keep: Keep | None = None,
) -> dict[str, int]:
    """Calibrate the float static graphs (``graphs``: ``context``/``iterator`` → path, or
    each part's ``partK_context``/``partK_iterator`` in session order with the CPU
    ``embeddings`` stage that feeds them) on the tokenized ``prompts``, each run as genai
    runs it (``run_prompt`` through the chains of ``graphs``' context and iterator graphs)
    and continued by up to ``GENERATED`` tokens; write each graph's ranges (ORT's
    calibration cache, tensors in name order) at ``ranges[graph]``; returns each graph's
    count of calibrated tensors. A part's ranges depend on the parts before it and the
    tokens the whole chain chooses only. ``method``: ORT's ``CalibrationMethod``.

    Each graph runs once per step, as its own runner and calibrator at once (its
    statistics are outputs of the same session), and a part's two graphs share each
    weight, mapped from its data file (``SharedWeights``): the process holds one copy of
    the float weights, the page cache's, where a plain session and a calibrator per graph
    held four. ``keep`` (a decoder in parts): the memo of the last calibration is used
    and this one's written (``epbuild.llm.calibmemo``): after an edit of a late part,
    only that part and those after it run."""
    from epbuild.llm.calibmemo import Diverged, first_changed, own_files

    parts = _parts(graphs)
    stages = stages_of(parts, graphs, ranges)
    start, memo = (0, None) if keep is None else first_changed(keep, prompts, stages)
    if memo is not None and keep is not None:
        try:
            return _calibrate(
                graphs, prompts, io, method, ranges, progress, embeddings, keep, start, memo
            )
        except Diverged:
            for name in own_files(keep.out):  # what the replay wrote goes, not the job's
                os.unlink(os.path.join(keep.out, name))
    return _calibrate(graphs, prompts, io, method, ranges, progress, embeddings, keep, 0, None)


def _calibrate(
    graphs: Mapping[str, str],
    prompts: Sequence[Sequence[int]],
    io: StaticIo,
    method: Any,
    ranges: Mapping[str, str],
    progress: Callable[[int, int], None] | None,
    embeddings: str | None,
    keep: Keep | None,
    start: int,
    memo: Mapping[str, Any] | None,
) -> dict[str, int]:
    """``calibrate`` from part ``start`` on (``memo``: what the parts before it read and
    chose; ``Diverged`` when the chain chooses another token)."""
    from epbuild.llm.calibmemo import Replay, RunsWriter, chosen
    from epbuild.llm.sessions import SharedWeights

    parts = _parts(graphs)
    running = [s for s in graphs if parts.index(part_of(s)) >= start]
    weights = SharedWeights()
    sessions, stats = {}, {}
    for stage in running:
        sessions[stage], stats[stage] = _augmented(graphs[stage], method, weights)
    first = _first(parts[start] if memo is not None else None, memo, keep, embeddings, weights)
    writer = None
    if keep is not None:
        skip = parts[: start + 1] if memo is not None else []
        writer = RunsWriter(keep.out, [past for past, _ in io.kv], skip)

    def collect(stage: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        if stage in stats:
            stats[stage].add(outputs)
            if writer is not None:
                writer.write(part_of(stage), inputs)

    chains = [
        Chain([*first, *((s, sessions[s]) for s in running if graph_of(s) == graph)], collect)
        for graph in (CONTEXT, ITERATOR)
    ]
    expected = None if memo is None else list(chosen(memo))
    try:
        tokens = _run_prompts(chains, prompts, io, expected, progress)
    finally:
        if writer is not None:
            writer.close()
        for _, stage in first:
            if isinstance(stage, Replay):
                stage.close()
    del chains, sessions
    counts = {}
    for stage, found in stats.items():
        data = found.data()
        _save(data, ranges[stage])
        counts[stage] = len(data.data)
    if keep is not None:
        stages = stages_of(parts, graphs, ranges)
        _keep(keep, memo, start, stages, (prompts, tokens), writer.names if writer else {})
        if memo is not None:
            counts.update(_counted(keep.previous, graphs, ranges, running))
    return {stage: counts[stage] for stage in graphs}


def _first(
    part: str | None,
    memo: Mapping[str, Any] | None,
    keep: Keep | None,
    embeddings: str | None,
    weights: Any,
) -> list[tuple[str, Any]]:
    """The stage before the parts that run: the memo's runs of ``part`` (the first part
    that runs, after parts kept), else the embeddings stage of a decoder in parts."""
    from epbuild.llm.calibmemo import Replay, recorded, runs_name
    from epbuild.llm.sessions import structure

    if part is not None and memo is not None and keep is not None:
        path = os.path.join(keep.previous, runs_name(part))
        return [(REPLAY, Replay(path, recorded(memo, part)))]
    if embeddings is not None:
        folder = os.path.dirname(os.path.abspath(embeddings))
        return [(EMBEDDINGS, weights.session(structure(embeddings), folder))]
    return []


def _run_prompts(
    chains: Sequence[Chain],
    prompts: Sequence[Sequence[int]],
    io: StaticIo,
    expected: Sequence[Sequence[int]] | None,
    progress: Callable[[int, int], None] | None,
) -> list[list[int]]:
    """Each prompt run through the ``context`` and ``iterator`` chains; the tokens each
    run chose (``Diverged`` where they are not ``expected``'s)."""
    from epbuild.llm.calibmemo import Diverged

    tokens = []
    for done, prompt in enumerate(prompts, 1):
        runs = run_prompt(chains[0], chains[1], prompt, io, io.fits(len(prompt)))
        tokens.append([t for _, _, t in runs])
        if expected is not None and tokens[-1] != expected[done - 1]:
            raise Diverged(f"prompt {done} chose other tokens")
        if progress is not None:
            progress(done, len(prompts))
    return tokens


def _keep(
    keep: Keep,
    memo: Mapping[str, Any] | None,
    start: int,
    stages: Mapping[str, Sequence[str]],
    runs: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]],
    written: Mapping[str, Sequence[str]],
) -> None:
    """The memo's files of the parts that did not run copied, and the new memo written
    (``runs``: the prompts' tokens and the tokens chosen)."""
    from epbuild.llm.calibmemo import keep_files, write_memo

    inputs: dict[str, Sequence[str]] = {}
    if memo is not None:
        keep_files(keep, start, stages)
        inputs.update(memo["inputs"])
    inputs.update(written)
    write_memo(keep, runs[0], runs[1], inputs)


def stages_of(
    parts: Sequence[str], graphs: Mapping[str, str], ranges: Mapping[str, str]
) -> dict[str, list[str]]:
    """Part → the names of its graphs' ranges files."""
    return {p: [os.path.basename(ranges[s]) for s in graphs if part_of(s) == p] for p in parts}


def _counted(
    folder: str, graphs: Mapping[str, str], ranges: Mapping[str, str], running: Sequence[str]
) -> dict[str, int]:
    """The tensor counts of the kept ranges (the graphs not in ``running``)."""
    counts = {}
    for stage in graphs:
        if stage not in running:
            with open(os.path.join(folder, os.path.basename(ranges[stage])), encoding="utf-8") as f:
                counts[stage] = len(json.load(f)["data"])
    return counts


def _save(data: Any, path: str) -> None:
    """Write ranges as ORT's calibration cache, tensors in name order."""
    from onnxruntime.quantization import save_tensors_data

    save_tensors_data(data, path)
    _canonical(path)
