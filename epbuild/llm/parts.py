"""Parts of a static decoder: which layers each part holds, and the names of its graphs and
files. Standard library only; the preparation (``llm.partgraphs``) cuts the graphs by it.

An ``[llms]`` entry with ``parts = N`` (or ``max_part_size``) is built as a pipeline:

- ``embeddings``: the token embedding, a graph of its own that runs on the CPU, so that the
  table is stored once (a tied ``lm_head`` is the only copy on the NPU);
- ``part1`` … ``partN``: consecutive layers, the last with the final norm and the
  ``lm_head``; each a prompt graph (``partK_context``, ``window_size`` tokens) and a token
  graph (``partK_iterator``, one token) sharing one external-data file ``partK.onnx.data``.

The layers are split so that the largest part holds as few weight bytes as it can; the
sizes, and the split, are ``llm.sizes``'s (the manifest's, which has no use for the rest of
this module; its names are also found here), so that the planner and the preparation agree
without reading weights.
"""

from __future__ import annotations

from epbuild.llm.genai_config import CONTEXT, EMBEDDINGS, ITERATOR
from epbuild.llm.sizes import WeightSizes as WeightSizes
from epbuild.llm.sizes import parse_size as parse_size
from epbuild.llm.sizes import part_bytes as part_bytes
from epbuild.llm.sizes import parts_for_size as parts_for_size
from epbuild.llm.sizes import split_layers as split_layers
from epbuild.llm.sizes import weight_sizes as weight_sizes

STAGE_SEQUENCES = ((CONTEXT, None), (ITERATOR, 1))
"""A part's graphs, in session order, and their sequence (None: ``window_size``)."""


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
