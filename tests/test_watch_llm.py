"""``epbuild watch`` follows LLM sources: an edit of genai_config.json rewrites the package
(and compiles nothing), a new file in the source folder is copied into it, a changed source
decoder recompiles the LLM's graphs, and a broken genai_config.json is a manifest error."""

from __future__ import annotations

import json
from collections.abc import Iterator

import onnx
import pytest
from conftest import Workspace
from test_watch import Watcher, built


@pytest.fixture
def llm_watch(workspace: Workspace) -> Iterator[tuple[Workspace, Watcher]]:
    workspace.llm()
    w = Watcher(workspace.root)
    try:
        first = w.next()
        assert sorted(built(first)) == [
            "chat/htp-v73/context",
            "chat/htp-v73/iterator",
            "chat/htp-v73/package",
            "chat/prepare",
        ], first
        yield workspace, w
    finally:
        w.close()


def test_watch_follows_llm_sources(llm_watch: tuple[Workspace, Watcher]) -> None:
    ws, w = llm_watch
    source = ws.root / "models" / "tiny"
    package = ws.root / "build" / "chat" / "htp-v73"

    config = json.loads((source / "genai_config.json").read_text())
    config["search"]["top_k"] = 3
    (source / "genai_config.json").write_text(json.dumps(config))
    cycle = w.next()
    assert cycle["changed"] == ["models/tiny/genai_config.json"], cycle
    assert built(cycle) == {"chat/htp-v73/package": "compiled"}  # nothing compiled
    assert cycle["summary"]["up_to_date"] == 3 and cycle["summary"]["packaged"] == 1
    assert json.loads((package / "genai_config.json").read_text())["search"]["top_k"] == 3

    (source / "chat_template.jinja").write_text("{{ messages }}")
    cycle = w.next()
    assert cycle["changed"] == ["models/tiny/chat_template.jinja"], cycle
    assert (package / "chat_template.jinja").read_text() == "{{ messages }}"

    (source / "genai_config.json").write_text("{ not json")
    cycle = w.next()
    assert "genai_config.json is not valid JSON" in (cycle["manifest_error"] or ""), cycle
    (source / "genai_config.json").write_text(json.dumps(config))
    cycle = w.next()
    assert cycle["manifest_error"] is None and cycle["summary"] is not None, cycle

    model = onnx.load(source / "model.onnx", load_external_data=False)
    model.doc_string = "edited"
    onnx.save(model, source / "model.onnx")
    cycle = w.next()
    assert cycle["changed"] == ["models/tiny/model.onnx"], cycle
    assert sorted(built(cycle)) == [
        "chat/htp-v73/context",
        "chat/htp-v73/iterator",
        "chat/prepare",
    ], cycle
    w.quiet(1.0)
