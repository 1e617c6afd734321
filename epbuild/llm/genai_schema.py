"""The parts of a source ``genai_config.json`` epbuild reads or writes into a package,
checked by type and bound before anything uses them: a downloaded folder is untrusted
input. Every violation is one ``LlmSourceError`` naming the config's key (``model.decoder.
num_hidden_layers``) and what it must be; nothing downstream then meets a list where it
wants a table, a template without ``%d`` or an infinite ``max_length``. Keys epbuild does
not use are left to genai. Standard library only (the manifest reads it on every load)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

GENAI_CONFIG = "genai_config.json"
"""The file that makes a folder an onnxruntime-genai model."""


class LlmSourceError(Exception):
    """A folder epbuild cannot build an LLM package from; ``message`` says what was found,
    ``hint`` what to do."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


MAX_DEPTH = 32
"""Tables and lists nested deeper than this are refused (a genai config nests 6 deep)."""
MAX_LAYERS = 1024
"""No decoder has more layers; a larger count is a damaged or hostile config."""
MAX_SIZE = 1 << 24
"""Bound of head counts, sizes and vocabulary."""
MAX_CONTEXT = 1 << 30
"""Bound of context lengths (what fits memory is checked against the budget: the
manifest's ``llms`` tables)."""


def _where(path: tuple[str, ...]) -> str:
    return f"{GENAI_CONFIG}: {'.'.join(path)}"


def _fail(path: tuple[str, ...], what: str) -> LlmSourceError:
    return LlmSourceError(
        f"{_where(path)} {what}",
        "fix the source's genai_config.json (as genai's model builder or Olive writes it)",
    )


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep tables and lists nest in ``value`` (stops counting past ``limit``)."""
    todo = [(value, 1)]
    deepest = 0
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level > limit:
                return level
            children = item.values() if isinstance(item, dict) else item
            todo.extend((c, level + 1) for c in children)
    return deepest


def _int(lo: int, hi: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if not isinstance(v, int) or isinstance(v, bool):
            return f"must be a whole number, not {_show(v)}"
        return None if lo <= v <= hi else f"is {v}: it must be between {lo} and {hi}"

    return check


def _number(lo: float, hi: float) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return f"must be a finite number, not {_show(v)}"
        return None if lo <= v <= hi else f"is {v}: it must be between {lo:g} and {hi:g}"

    return check


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"must be true or false, not {_show(v)}"


def _str(v: Any) -> str | None:
    return None if isinstance(v, str) else f"must be a string, not {_show(v)}"


def _table(v: Any) -> str | None:
    return None if isinstance(v, dict) else f"must be a table, not {_show(v)}"


def _template(v: Any) -> str | None:
    """A per-layer name such as ``past_key_values.%d.key``: one ``%d``, no other ``%``."""
    if not isinstance(v, str):
        return f"must be a string, not {_show(v)}"
    if v.count("%d") != 1 or v.replace("%d", "").count("%"):
        return f"is {v!r}: it must hold one %d (the layer number) and no other %"
    return None


def _token_ids(v: Any) -> str | None:
    ids = v if isinstance(v, list) else [v]
    if not ids or any(_int(0, 1 << 31)(i) for i in ids):
        return f"must be a token id or a list of them, not {_show(v)}"
    return None


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


_POSITIVE = _int(1, MAX_SIZE)

_MODEL: dict[str, Callable[[Any], str | None]] = {
    "context_length": _int(1, MAX_CONTEXT),
    "vocab_size": _POSITIVE,
    "type": _str,
    "bos_token_id": _token_ids,
    "eos_token_id": _token_ids,
    "pad_token_id": _token_ids,
    "decoder": _table,
}
_DECODER: dict[str, Callable[[Any], str | None]] = {
    "filename": _str,
    "head_size": _POSITIVE,
    "hidden_size": _POSITIVE,
    "num_attention_heads": _POSITIVE,
    "num_key_value_heads": _POSITIVE,
    "num_hidden_layers": _int(1, MAX_LAYERS),
    "session_options": _table,
    "inputs": _table,
    "outputs": _table,
    "sliding_window": _table,
}
_NAMES: dict[str, Callable[[Any], str | None]] = {
    "past_key_names": _template,
    "past_value_names": _template,
    "present_key_names": _template,
    "present_value_names": _template,
}
_SEARCH: dict[str, Callable[[Any], str | None]] = {
    "max_length": _int(1, MAX_CONTEXT),
    "min_length": _int(0, MAX_SIZE),
    "num_beams": _int(1, 1024),
    "num_return_sequences": _int(1, 1024),
    "top_k": _int(0, MAX_SIZE),
    "top_p": _number(0.0, 1.0),
    "temperature": _number(0.0, 1e6),
    "repetition_penalty": _number(0.0, 1e6),
    "length_penalty": _number(-1e6, 1e6),
    "diversity_penalty": _number(-1e6, 1e6),
    "no_repeat_ngram_size": _int(0, MAX_SIZE),
    "do_sample": _bool,
    "early_stopping": _bool,
    "past_present_share_buffer": _bool,
}


def _check(
    table: dict[str, Any], rules: dict[str, Callable[[Any], str | None]], path: tuple[str, ...]
) -> None:
    for key, rule in rules.items():
        if key in table:
            problem = rule(table[key])
            if problem is not None:
                raise _fail((*path, key), problem)


def check_config(config: Any) -> None:
    """Refuse a config whose keys epbuild uses have the wrong type or bound, or that nests
    deeper than ``MAX_DEPTH`` (``LlmSourceError`` naming the key)."""
    if depth(config) > MAX_DEPTH:
        raise LlmSourceError(
            f"{GENAI_CONFIG} nests tables or lists more than {MAX_DEPTH} deep",
            "fix the source's genai_config.json (as genai's model builder or Olive writes it)",
        )
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise LlmSourceError(f"{GENAI_CONFIG} has no 'model' table")
    model = config["model"]
    _check(model, _MODEL, ("model",))
    if "search" in config:
        if _table(config["search"]) is not None:
            raise _fail(("search",), _table(config["search"]) or "")
        _check(config["search"], _SEARCH, ("search",))
    decoder = model.get("decoder")
    if not isinstance(decoder, dict):
        return  # read_source says what it is instead
    _check(decoder, _DECODER, ("model", "decoder"))
    for side in ("inputs", "outputs"):
        names = decoder.get(side, {})
        _check(names, _NAMES, ("model", "decoder", side))
        for key, value in names.items():
            if key not in _NAMES and _str(value) is not None:
                raise _fail(("model", "decoder", side, key), _str(value) or "")
    options = decoder.get("session_options", {})
    if "provider_options" in options and not isinstance(options["provider_options"], list):
        path = ("model", "decoder", "session_options", "provider_options")
        raise _fail(path, f"must be a list, not {_show(options['provider_options'])}")
