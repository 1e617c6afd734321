"""The no-op fast path with [llms]: a build after an all-up-to-date one answers from stats
alone (no onnx, no onnxruntime), and misses when an LLM's source files, prepared graphs or
package files changed or are gone."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import pytest
import waits
from conftest import Workspace
from llmfixture import LLM_FIXTURES

from epbuild.planning.noop import fast_noop


@pytest.fixture
def llm_ws(llm_built: Workspace) -> Workspace:
    """A built LLM workspace whose next build is answered by the fast path."""
    ws = llm_built  # workspace.llm() built once per session (conftest), copied
    ws.main("build", check=True)  # all up to date: records the fingerprint
    assert fast_noop(str(ws.root), None, []) is not None
    return ws


def _compiled_or_written(ws: Workspace) -> None:
    """The next build is the full path; the one after it is answered again."""
    assert fast_noop(str(ws.root), None, []) is None
    ws.cli("build", check=True)
    ws.cli("build", check=True)
    assert fast_noop(str(ws.root), None, []) is not None


def test_second_build_imports_neither_onnx_nor_onnxruntime(llm_built: Workspace) -> None:
    """The build after the one that compiled plans without onnx or onnxruntime and records
    the fingerprint; the one after it answers from stats alone (epbuild.api not even
    imported)."""
    ws = llm_built
    code = (
        "import sys; from epbuild.frontends.cli import main; "
        "rc = main(['-C', sys.argv[1], 'build']); "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime')]; "
        "print('HEAVY', heavy, 'epbuild.api' in sys.modules); sys.exit(rc)"
    )
    second = waits.run([sys.executable, "-c", code, str(ws.root)], "the second build")
    assert second.returncode == 0, second.stderr
    assert "HEAVY [] True" in second.stdout and "4 up to date" in second.stdout  # 2 + prep, pkg
    assert fast_noop(str(ws.root), None, []) is not None  # recorded by it
    third = waits.run([sys.executable, "-c", code, str(ws.root)], "the no-op build")
    assert third.returncode == 0, third.stderr
    assert "HEAVY [] False" in third.stdout and "4 up to date" in third.stdout


def test_source_search_options_edit_misses_and_reaches_the_package(llm_ws: Workspace) -> None:
    path = llm_ws.root / "models" / "tiny" / "genai_config.json"
    config = json.loads(path.read_text())
    config["search"]["top_k"] = 7
    path.write_text(json.dumps(config))
    _compiled_or_written(llm_ws)
    package = llm_ws.root / "build" / "chat" / "htp-v73" / "genai_config.json"
    assert json.loads(package.read_text())["search"]["top_k"] == 7


def test_deleted_package_file_misses_and_is_written_again(llm_ws: Workspace) -> None:
    copied = llm_ws.root / "build" / "chat" / "htp-v73" / "tokenizer.json"
    copied.unlink()
    _compiled_or_written(llm_ws)
    assert copied.read_bytes() == (LLM_FIXTURES / "llama" / "tokenizer.json").read_bytes()


def test_touched_source_onnx_misses(llm_ws: Workspace) -> None:
    model = llm_ws.root / "models" / "tiny" / "model.onnx"
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns - 3_000_000_000))
    _compiled_or_written(llm_ws)


def test_new_source_file_and_deleted_prepared_graph_miss(llm_ws: Workspace) -> None:
    (llm_ws.root / "models" / "tiny" / "chat_template.jinja").write_text("{{ messages }}")
    _compiled_or_written(llm_ws)
    assert (llm_ws.root / "build" / "chat" / "htp-v73" / "chat_template.jinja").is_file()
    (prepared,) = [p for p in (llm_ws.root / ".epbuild" / "llm" / "chat").iterdir() if p.is_dir()]
    shutil.rmtree(prepared)
    _compiled_or_written(llm_ws)


def test_a_package_unlike_its_source_is_never_vouched_for(
    llm_ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package file not rewritten from the edited source (its write failed: a full disk)
    is a failed action, never vouched for by the no-op path."""
    from epbuild import api
    from epbuild.kinds import package

    path = llm_ws.root / "models" / "tiny" / "genai_config.json"
    config = json.loads(path.read_text())
    config["search"]["top_k"] = 9
    path.write_text(json.dumps(config))

    def full_disk(job: Any, root: str) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(package, "run", full_disk)
    result = api.build(llm_ws.root)
    (failed,) = [a for a in result.actions if a.outcome.value == "failed"]
    assert failed.id == "chat/htp-v73/package" and "No space left" in (failed.error or "")
    assert fast_noop(str(llm_ws.root), None, []) is None
