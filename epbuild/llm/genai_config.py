"""The ``genai_config.json`` of a built LLM package: the source's config turned into the
``decoder-pipeline`` form onnxruntime-genai runs static context/iterator graphs with.

Pure JSON, standard library only. Fields of the source that do not describe a graph
(``search`` options, token ids, ...) are kept; ``search.max_length`` is capped at
``context_length`` (genai refuses a larger one).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

PAST_SEQ_LEN = "past_seq_len"
"""The static graphs' int32 ``[1, 1]`` input genai's pipeline feeds (GroupQueryAttention's
``seqlens_k``)."""
TOTAL_SEQ_LEN = "total_seq_len"
"""The static graphs' int32 ``[1]`` input (genai sets it to ``max_length``)."""
CONTEXT = "context"
ITERATOR = "iterator"


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
) -> dict[str, Any]:
    """The package's config. ``files`` maps ``context``/``iterator`` to their ctx model
    file names (relative to the config); ``provider_options`` is genai's form, e.g.
    ``{"qnn": {"htp_arch": "73", ...}}``."""
    config = copy.deepcopy(dict(source))
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
        stages.append(
            {
                stage: {
                    "filename": files[stage],
                    "session_options": session,
                    "inputs": inputs,
                    "outputs": outputs,
                    flag: False,
                }
            }
        )
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


def stages_config(
    source: Mapping[str, Any],
    *,
    compiled: Mapping[str, str],
    provider_options: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The package's config of a ``decoder-pipeline`` source: ``compiled`` maps the stages
    compiled for the provider to their ctx model file names, which run with
    ``provider_options``; every other stage (one meant for the CPU) is kept as it is."""
    config = copy.deepcopy(dict(source))
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
