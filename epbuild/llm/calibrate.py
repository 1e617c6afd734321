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

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.llm.genai_config import EMBEDDINGS, PAST_SEQ_LEN, TOTAL_SEQ_LEN, io_names
from epbuild.quant.work import _canonical

if TYPE_CHECKING:
    import numpy as np

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
    return {past: shapes[past] for past, _ in io.kv}


def _step(
    session: Any, feed: dict[str, np.ndarray], io: StaticIo
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    names = [io.logits, *(present for _, present in io.kv)]
    outputs = session.run(names, feed)
    return outputs[0], {past: out for (past, _), out in zip(io.kv, outputs[1:], strict=True)}


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
    genai's ``decoder-pipeline`` feeds them. ``collect(stage, outputs)`` is given each
    stage's outputs by name (the calibration's statistics among them)."""

    def __init__(
        self,
        stages: Sequence[tuple[str, Any]],
        collect: Callable[[str, dict[str, np.ndarray]], None],
    ) -> None:
        self.stages = list(stages)
        self.collect = collect

    def get_inputs(self) -> list[Any]:
        """Every stage's inputs (a later stage's repeat an earlier one's)."""
        return [i for _, session in self.stages for i in session.get_inputs()]

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[Any]:
        store = dict(feed)
        for stage, session in self.stages:
            inputs = {i.name: store[i.name] for i in session.get_inputs()}
            outputs = session.run(None, inputs)
            found = dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))
            self.collect(stage, found)
            store.update(found)
        return [store[n] for n in names or ()]


def graph_of(stage: str) -> str:
    """``context`` or ``iterator``: which of its part's graphs ``stage`` is."""
    return CONTEXT if stage == CONTEXT or stage.endswith("_" + CONTEXT) else ITERATOR


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
    held four."""
    from epbuild.llm.sessions import SharedWeights, structure

    weights = SharedWeights()
    sessions, stats = {}, {}
    for stage, path in graphs.items():
        sessions[stage], stats[stage] = _augmented(path, method, weights)
    first = []
    if embeddings is not None:
        folder = os.path.dirname(os.path.abspath(embeddings))
        first = [(EMBEDDINGS, weights.session(structure(embeddings), folder))]

    def collect(stage: str, outputs: dict[str, np.ndarray]) -> None:
        if stage in stats:
            stats[stage].add(outputs)

    context, iterator = (
        Chain([*first, *((s, sessions[s]) for s in graphs if graph_of(s) == graph)], collect)
        for graph in (CONTEXT, ITERATOR)
    )
    for done, tokens in enumerate(prompts, 1):
        for _ in run_prompt(context, iterator, tokens, io, io.fits(len(tokens))):
            pass
        if progress is not None:
            progress(done, len(prompts))
    del context, iterator, sessions
    counts = {}
    for stage, found in stats.items():
        data = found.data()
        _save(data, ranges[stage])
        counts[stage] = len(data.data)
    return counts


def _save(data: Any, path: str) -> None:
    """Write ranges as ORT's calibration cache, tensors in name order."""
    from onnxruntime.quantization import save_tensors_data

    save_tensors_data(data, path)
    _canonical(path)
