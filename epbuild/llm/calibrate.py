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
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.llm.genai_config import PAST_SEQ_LEN, TOTAL_SEQ_LEN

if TYPE_CHECKING:
    import numpy as np

CONTEXT = "context"
ITERATOR = "iterator"
GENERATED = 16
"""Tokens each prompt is continued by (greedily, with the float graphs), whose iterator
runs are calibration feeds too (fewer where the KV cache ends first)."""
MAX_PROMPT_BYTES = 1 << 20
"""A prompts file larger than this is refused (prompts are sentences, not corpora)."""


class PromptError(Exception):
    """A prompts file that cannot calibrate: ``message`` says which file (and line) and
    why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def read_prompts(path: str, shown: str) -> list[str]:
    """The prompts of one text file (``shown``: how messages name it): one a line, blank
    lines skipped. A missing, unreadable, non-UTF-8, oversized or blank file is a
    ``PromptError``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
    except FileNotFoundError:
        raise PromptError(f"{shown} does not exist") from None
    except IsADirectoryError:
        raise PromptError(f"{shown} is a folder, not a text file of prompts") from None
    except OSError as exc:
        raise PromptError(f"{shown} cannot be read ({exc.strerror})") from exc
    if len(data) > MAX_PROMPT_BYTES:
        raise PromptError(f"{shown} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(
            f"{shown} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r})"
        ) from None
    prompts = [line.strip() for line in text.lstrip("\ufeff").splitlines()]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise PromptError(f"{shown} holds no prompt (one a line)")
    return prompts


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
    context: Any, iterator: Any, tokens: Sequence[int], io: StaticIo, generate: int
) -> Iterator[tuple[str, dict[str, np.ndarray], int]]:
    """Run one prompt as genai does: yields each run's graph name, feed and the token the
    run chose greedily (the context graph's last window chooses the first new token), then
    continues by ``generate`` tokens. ``context``/``iterator``: ORT sessions of the float
    graphs (``run(None, feed)``)."""
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
    for _ in range(generate):
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


def cpu_session(path: str) -> Any:
    """An ORT CPU session of one graph (what calibration runs)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
