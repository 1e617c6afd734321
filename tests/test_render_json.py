"""``--json`` documents are written by ``render.dumps_indented``: exactly the text of
``json.dumps(doc, indent=2)``, for any document (odd values go to ``json.dumps`` itself)."""

from __future__ import annotations

import enum
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epbuild.frontends.render import dumps_indented

_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
_docs = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_docs)
def test_the_text_of_json_dumps(doc: Any) -> None:
    assert dumps_indented(doc) == json.dumps(doc, indent=2)


class _Level(enum.IntEnum):
    HIGH = 3


class _Name(str):
    pass


@pytest.mark.parametrize(
    "doc",
    [
        {7: "int key", None: "none key", 2.5: "float key", False: "bool key"},
        {"level": _Level.HIGH, "name": _Name("x"), "big": 10**30, "neg": -0.0},
        {"nested": [[[]], [{}], {"a": [1, 2.0, "é\u2028\x00"]}]},
        [float("nan"), float("inf")],
        "just a string",
    ],
)
def test_odd_documents_too(doc: Any) -> None:
    assert dumps_indented(doc) == json.dumps(doc, indent=2)


def test_what_json_refuses_is_refused_alike() -> None:
    for bad in ({"set": {1}}, {"bytes": b"x"}, {(1, 2): "tuple key"}):
        with pytest.raises(TypeError):
            json.dumps(bad, indent=2)
        with pytest.raises(TypeError):
            dumps_indented(bad)
