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
import tempfile
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
    genai's ``decoder-pipeline`` feeds them. The feed each stage named in ``recorded``
    runs on is kept in ``runs`` (the calibration takes them)."""

    def __init__(self, stages: Sequence[tuple[str, Any]], recorded: Sequence[str]) -> None:
        self.stages = list(stages)
        self.recorded = set(recorded)
        self.runs: list[tuple[str, dict[str, np.ndarray]]] = []

    def get_inputs(self) -> list[Any]:
        """Every stage's inputs (a later stage's repeat an earlier one's)."""
        return [i for _, session in self.stages for i in session.get_inputs()]

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[Any]:
        store = dict(feed)
        for stage, session in self.stages:
            inputs = {i.name: store[i.name] for i in session.get_inputs()}
            if stage in self.recorded:
                self.runs.append((stage, inputs))
            outputs = session.run(None, inputs)
            store.update(zip([o.name for o in session.get_outputs()], outputs, strict=True))
        return [store[n] for n in names or ()]

    def drain(self) -> list[tuple[str, dict[str, np.ndarray]]]:
        """The runs recorded since the last drain."""
        runs, self.runs = self.runs, []
        return runs


def chains(graphs: Mapping[str, str], embeddings: str | None) -> tuple[Chain, Chain]:
    """The CPU chains genai runs for a prompt window and for a token: the whole ``context``
    and ``iterator`` graphs, or (``embeddings``: the CPU stage of a decoder in parts) the
    embeddings stage then each part's ``partK_context`` (``partK_iterator``) graph, in
    ``graphs``' order. Every graph of ``graphs`` is recorded, the embeddings stage not."""
    sessions = {graph: cpu_session(path) for graph, path in graphs.items()}
    first = [] if embeddings is None else [(EMBEDDINGS, cpu_session(embeddings))]
    found = []
    for suffix in (CONTEXT, ITERATOR):
        mine = [(g, s) for g, s in sessions.items() if g == suffix or g.endswith("_" + suffix)]
        found.append(Chain([*first, *mine], [g for g, _ in mine]))
    return found[0], found[1]


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
    runs it (``run_prompt`` through ``chains``) and continued by up to ``GENERATED``
    tokens; write each graph's ranges (ORT's calibration cache, tensors in name order) at
    ``ranges[graph]``; returns each graph's count of calibrated tensors. A part's ranges
    depend on the parts before it and the tokens the whole chain chooses only.
    ``method``: ORT's ``CalibrationMethod``."""
    from onnxruntime.quantization import CalibrationDataReader, save_tensors_data

    class Chunk(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
            self.feeds = iter(feeds)

        def get_next(self) -> Any:
            return next(self.feeds, None)

    with tempfile.TemporaryDirectory(prefix="epbuild-llmcalib-") as tmp:
        calibrators = _calibrators(graphs, method, tmp)
        context, iterator = chains(graphs, embeddings)
        pending: dict[str, list[dict[str, np.ndarray]]] = {g: [] for g in graphs}
        for done, tokens in enumerate(prompts, 1):
            for _ in run_prompt(context, iterator, tokens, io, io.fits(len(tokens))):
                for graph, feed in (*context.drain(), *iterator.drain()):
                    pending[graph].append(feed)
                    if len(pending[graph]) >= CHUNK:
                        calibrators[graph].collect_data(Chunk(pending[graph]))
                        pending[graph] = []
            if progress is not None:
                progress(done, len(prompts))
        counts = {}
        for graph, calibrator in calibrators.items():
            if pending[graph]:
                calibrator.collect_data(Chunk(pending[graph]))
            found = calibrator.compute_data()
            save_tensors_data(found, ranges[graph])
            _canonical(ranges[graph])
            counts[graph] = len(found.data)
    return counts


def _calibrators(graphs: Mapping[str, str], method: Any, tmp: str) -> dict[str, Any]:
    """An ORT calibrator per graph, of every op type but ``EXCLUDED_OPS``, on its graph with
    the shapes inferred (written into ``tmp``, with the augmented graph)."""
    import onnx
    from onnxruntime.quantization.calibrate import create_calibrator

    from epbuild.llm.quantize import infer_shapes, save_graph

    calibrators = {}
    for graph, path in graphs.items():
        model = infer_shapes(onnx.load(path))
        ops = sorted({n.op_type for n in model.graph.node} - set(EXCLUDED_OPS))
        inferred = os.path.join(tmp, f"{graph}.onnx")
        save_graph(model, inferred)
        del model
        calibrators[graph] = create_calibrator(
            inferred,
            ops,
            augmented_model_path=os.path.join(tmp, f"{graph}.augmented.onnx"),
            calibrate_method=method,
            use_external_data_format=True,
            providers=["CPUExecutionProvider"],
        )
    return calibrators
