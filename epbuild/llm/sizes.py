"""How many weight bytes each layer of a decoder holds, and how many parts (``llm.parts``)
that makes under a size limit: read from the source's external-data references (a tensor
named after a layer, ``layers.<i>.``, counts for that layer, one named after the embedding
for none, any other for the last part), never from the weights. The manifest asks it of an
``[llms]`` entry with ``max_part_size``, the preparation (``llm.partgraphs``) cuts the
graphs by it. Its patterns are compiled when first used (``re``'s cache), not when the
manifest's modules are imported."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence

from epbuild._dataclass import dataclass
from epbuild.onnx.proto import read_model

_LAYER = r"(?:^|[./])layers\.(\d+)[./]"
_EMBEDDING = r"(?i)embed"
_SIZE = r"(?i)\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])i?)?B?\s*"


def layer_of(tensor: str) -> int | None:
    """The layer a weight is named after (``model.layers.3.mlp…`` → 3), else None."""
    found = re.search(_LAYER, tensor)
    return int(found.group(1)) if found else None


def parse_size(text: str) -> int | None:
    """``"1 GiB"``, ``"512MB"``, ``"1.5G"``, ``"4096"`` → bytes (binary units: K = 1024);
    None when ``text`` is no positive size."""
    found = re.fullmatch(_SIZE, text)
    if not found:
        return None
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    size = int(float(found.group(1)) * scale[(found.group(2) or "").upper()])
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
        elif re.search(_EMBEDDING, ref.tensor):
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
