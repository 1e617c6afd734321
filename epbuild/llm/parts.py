"""Parts of a static decoder: which layers each part holds, and the names of its graphs and
files. Standard library only (and epbuild's own ONNX reader for the weights' sizes): the
manifest reads it on every load, the preparation (``llm.partgraphs``) cuts the graphs by it.

An ``[llms]`` entry with ``parts = N`` (or ``max_part_size``) is built as a pipeline:

- ``embeddings``: the token embedding, a graph of its own that runs on the CPU, so that the
  table is stored once (a tied ``lm_head`` is the only copy on the NPU);
- ``part1`` … ``partN``: consecutive layers, the last with the final norm and the
  ``lm_head``; each a prompt graph (``partK_context``, ``window_size`` tokens) and a token
  graph (``partK_iterator``, one token) sharing one external-data file ``partK.onnx.data``.

The layers are split so that the largest part holds as few weight bytes as it can; sizes
come from the source's external-data references (a tensor named after a layer,
``layers.<i>.``, counts for that layer, one named after the embedding for none, any other
for the last part), so that the planner and the preparation agree without reading weights.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence

from epbuild._dataclass import dataclass
from epbuild.llm.genai_config import CONTEXT, EMBEDDINGS, ITERATOR
from epbuild.onnx.proto import read_model

STAGE_SEQUENCES = ((CONTEXT, None), (ITERATOR, 1))
"""A part's graphs, in session order, and their sequence (None: ``window_size``)."""

_LAYER = re.compile(r"(?:^|[./])layers\.(\d+)[./]")
_EMBEDDING = re.compile(r"embed", re.IGNORECASE)
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


def part_name(index: int) -> str:
    """``part<index>`` (1-based)."""
    return f"part{index}"


def stage_name(index: int, graph: str) -> str:
    """The pipeline stage (and prepared graph stem) of a part's ``context`` or ``iterator``."""
    return f"{part_name(index)}_{graph}"


def part_stages(parts: int) -> tuple[tuple[str, int | None], ...]:
    """Every compiled stage of ``parts`` parts in session order, with its sequence (None:
    ``window_size``)."""
    return tuple(
        (stage_name(i, graph), sequence)
        for i in range(1, parts + 1)
        for graph, sequence in STAGE_SEQUENCES
    )


def data_name(index: int) -> str:
    """The external-data file both graphs of part ``index`` read."""
    return f"{part_name(index)}.onnx.data"


EMBEDDING_FILES = (f"{EMBEDDINGS}.onnx", f"{EMBEDDINGS}.onnx.data")
"""The CPU stage's graph and data, copied into the package as they are."""
PARTS_JSON = "parts.json"
"""What the preparation says about the parts: each stage's inputs and outputs, and each
part's layers (``{"embeddings": {"inputs": [...], "outputs": [...]}, "part1": {...,
"layers": [0, 1]}, ...}``)."""


def layer_of(tensor: str) -> int | None:
    """The layer a weight is named after (``model.layers.3.mlp…`` → 3), else None."""
    found = _LAYER.search(tensor)
    return int(found.group(1)) if found else None


def parse_size(text: str) -> int | None:
    """``"1 GiB"``, ``"512MB"``, ``"1.5G"``, ``"4096"`` → bytes (binary units: K = 1024);
    None when ``text`` is no positive size."""
    found = _SIZE.fullmatch(text)
    if not found:
        return None
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    size = int(float(found.group(1)) * scale[found.group(2).upper()])
    return size if size > 0 else None


@dataclass(frozen=True)
class WeightSizes:
    """Weight bytes of a decoder by where they go."""

    layers: tuple[int, ...]
    """Bytes of each layer's weights."""
    tail: int
    """Bytes after the last layer (final norm, ``lm_head``) and any other non-embedding
    weight: they go with the last part."""
    embedding: int
    """Bytes of the embedding (the CPU stage)."""


def weight_sizes(model: str | os.PathLike[str], layers: int) -> WeightSizes:
    """The sizes of ``model``'s external tensors (``OSError``/``ProtoError`` when it cannot
    be read); a layer index at or above ``layers`` (the builder's final norm is named
    ``layers.<layers>``) counts for the tail."""
    per_layer = [0] * layers
    tail = embedding = 0
    for ref in read_model(model).external_refs:
        size = ref.length or 0
        index = layer_of(ref.tensor)
        if index is not None and index < layers:
            per_layer[index] += size
        elif _EMBEDDING.search(ref.tensor):
            embedding += size
        else:
            tail += size
    return WeightSizes(tuple(per_layer), tail, embedding)


def split_layers(sizes: WeightSizes, parts: int) -> tuple[range, ...]:
    """The layers of each of ``parts`` parts: consecutive, none empty, the largest part (the
    tail counted in the last) as small as it can be; among equal splits, earlier parts hold
    more layers. ``ValueError`` when ``parts`` is not between 1 and the layer count."""
    count = len(sizes.layers)
    if not 1 <= parts <= count:
        raise ValueError(f"{parts} parts of {count} layers")
    weights = [*sizes.layers[:-1], sizes.layers[-1] + sizes.tail]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the smallest largest part splitting the first i layers into k parts.
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(parts + 1)]
    cut = [[0] * (count + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, count - (parts - k) + 1):
            for j in range(i - 1, k - 2, -1):  # the last part holds layers j .. i-1
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [count]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))


def part_bytes(sizes: WeightSizes, split: Sequence[range]) -> tuple[int, ...]:
    """The weight bytes of each part of ``split``."""
    found = [sum(sizes.layers[i] for i in layers) for layers in split]
    found[-1] += sizes.tail
    return tuple(found)


def parts_for_size(sizes: WeightSizes, limit: int) -> int:
    """The fewest parts none of which holds more than ``limit`` weight bytes (filled in
    order, which no other split beats); ``ValueError`` with the smallest workable limit
    when a layer (the last with the tail) alone is above it."""
    weights = [*sizes.layers[:-1], sizes.layers[-1] + sizes.tail]
    if max(weights) > limit:
        raise ValueError(max(weights))
    parts, held = 1, 0
    for w in weights:
        if held + w > limit:
            parts, held = parts + 1, 0
        held += w
    return parts
