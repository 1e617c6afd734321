"""The ``genai_config.json`` of a built LLM package: the source's config turned into the
``decoder-pipeline`` form onnxruntime-genai runs static context/iterator graphs with.

Pure JSON, standard library only. Fields of the source that do not describe a graph
(``search`` options, token ids, ...) are kept; ``search.max_length`` is capped at
``context_length`` (genai refuses a larger one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PAST_SEQ_LEN = "past_seq_len"
"""The static graphs' int32 ``[1, 1]`` input genai's pipeline feeds (GroupQueryAttention's
``seqlens_k``)."""
TOTAL_SEQ_LEN = "total_seq_len"
"""The static graphs' int32 ``[1]`` input (genai sets it to ``max_length``)."""
CONTEXT = "context"
ITERATOR = "iterator"
EMBEDDINGS = "embeddings"
"""The CPU stage of a decoder in parts (``llm.parts``)."""


def json_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of a parsed JSON object (what ``copy.deepcopy`` gives for one, without
    importing ``copy``: the manifest reads this module on every load)."""
    return {k: _copied(v) for k, v in data.items()}


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    return value


def io_names(decoder: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Input and output names of both static graphs, in the source's naming: inputs
    ``input_ids``, ``past_seq_len``, ``total_seq_len``, then each layer's past key and
    value; outputs ``logits``, then each layer's present key and value."""
    layers = int(decoder["num_hidden_layers"])
    ins = decoder.get("inputs", {})
    outs = decoder.get("outputs", {})
    past = [
        ins.get(f"past_{kind}_names", f"past_key_values.%d.{kind}") % i
        for i in range(layers)
        for kind in ("key", "value")
    ]
    present = [
        outs.get(f"present_{kind}_names", f"present.%d.{kind}") % i
        for i in range(layers)
        for kind in ("key", "value")
    ]
    inputs = [ins.get("input_ids", "input_ids"), PAST_SEQ_LEN, TOTAL_SEQ_LEN, *past]
    return inputs, [outs.get("logits", "logits"), *present]


def pipeline_config(
    source: Mapping[str, Any],
    *,
    files: Mapping[str, str],
    provider_options: Mapping[str, Mapping[str, Any]],
    context_length: int,
    window_size: int,
    parts: Mapping[str, StageIO] | None = None,
) -> dict[str, Any]:
    """The package's config. ``files`` maps ``context``/``iterator`` to their ctx model
    file names (relative to the config); ``provider_options`` is genai's form, e.g.
    ``{"qnn": {"htp_arch": "73", ...}}``. With ``parts`` (the inputs and outputs of the
    ``embeddings`` stage and of each part, ``llm.parts``), ``files`` maps every stage
    (``embeddings``, ``part1_context``, ...) and the pipeline is the CPU embeddings stage,
    then each part's prompt and token graphs."""
    config = json_copy(source)
    model = config["model"]
    decoder = model["decoder"]
    inputs, outputs = io_names(decoder)
    session = {
        **{k: v for k, v in decoder.get("session_options", {}).items() if k != "provider_options"},
        "provider_options": [{name: dict(opts)} for name, opts in provider_options.items()],
    }
    decoder_inputs = {k: v for k, v in decoder.get("inputs", {}).items() if k != "attention_mask"}
    decoder_inputs["past_sequence_length"] = PAST_SEQ_LEN
    decoder_inputs["total_sequence_length"] = TOTAL_SEQ_LEN
    stages = []
    for stage, flag in ((CONTEXT, "run_on_token_gen"), (ITERATOR, "run_on_prompt")):
        if parts is None:
            stages.append(_stage(stage, files[stage], session, (inputs, outputs), flag))
    if parts is not None:
        stages = _part_stages(files, session, parts)
    new_decoder = {k: v for k, v in decoder.items() if k not in ("filename", "inputs")}
    new_decoder.update(
        session_options=session,
        inputs=decoder_inputs,
        sliding_window={
            "window_size": window_size,
            "pad_value": 0,
            "alignment": "left",
            "slide_key_value_cache": False,
        },
        pipeline=stages,
    )
    model.update(type="decoder-pipeline", context_length=context_length, decoder=new_decoder)
    search = config.setdefault("search", {})
    search["max_length"] = min(int(search.get("max_length", context_length)), context_length)
    search["past_present_share_buffer"] = True
    return config


StageIO = tuple[Sequence[str], Sequence[str]]
"""A pipeline stage's input and output names."""


def _stage(
    name: str, filename: str, session: Mapping[str, Any], io: StageIO, flag: str | None
) -> dict[str, Any]:
    """One ``pipeline`` entry (``flag``: ``run_on_token_gen`` or ``run_on_prompt``, set
    false; None: it runs on both)."""
    stage: dict[str, Any] = {
        "filename": filename,
        "session_options": session,
        "inputs": list(io[0]),
        "outputs": list(io[1]),
    }
    if flag is not None:
        stage[flag] = False
    return {name: stage}


def _part_stages(
    files: Mapping[str, str], session: Mapping[str, Any], parts: Mapping[str, StageIO]
) -> list[dict[str, Any]]:
    """The pipeline of a decoder in parts: ``embeddings`` on the CPU, then each part's
    ``context`` (prompt) and ``iterator`` (token) graphs."""
    cpu = {**{k: v for k, v in session.items() if k != "provider_options"}, "provider_options": []}
    stages = [_stage(EMBEDDINGS, files[EMBEDDINGS], cpu, parts[EMBEDDINGS], None)]
    for part, io in parts.items():
        if part == EMBEDDINGS:
            continue
        for graph, flag in ((CONTEXT, "run_on_token_gen"), (ITERATOR, "run_on_prompt")):
            name = f"{part}_{graph}"
            stages.append(_stage(name, files[name], session, io, flag))
    return stages


def stages_config(
    source: Mapping[str, Any],
    *,
    compiled: Mapping[str, str],
    provider_options: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The package's config of a ``decoder-pipeline`` source: ``compiled`` maps the stages
    compiled for the provider to their ctx model file names, which run with
    ``provider_options``; every other stage (one meant for the CPU) is kept as it is."""
    config = json_copy(source)
    model = config["model"]
    for entry in model["decoder"]["pipeline"]:
        for name, stage in entry.items():
            if name not in compiled:
                continue
            options = stage.get("session_options", {})
            stage["filename"] = compiled[name]
            stage["session_options"] = {
                **{k: v for k, v in options.items() if k != "provider_options"},
                "provider_options": [{n: dict(o)} for n, o in provider_options.items()],
            }
    search = config.setdefault("search", {})
    limit = int(model["context_length"])
    search["max_length"] = min(int(search.get("max_length", limit)), limit)
    return config
