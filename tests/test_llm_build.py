"""Building [llms.NAME] entries: the static preparation is a planned step (keyed by the
source decoder's content, window_size, context_length), and its graphs compile through the
ordinary actions for QNN, separately or as one weight-sharing group (N+1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from conftest import Workspace
from llmfixture import LLM_FIXTURES

from epbuild.llm.generate import DEFAULT_NEAR_TIE, Verdict, compare, genai_installed, generate

FIXTURES = LLM_FIXTURES


def _ws(ws: Workspace, *, share: bool, context: int = 64, family: str = "llama") -> None:
    ws.llm(family, share=share, context=context)


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(path, load_external_data=False).graph.node]


def _compiled(proc_stdout: str) -> list[str]:
    return [ln.split()[2] for ln in proc_stdout.splitlines() if " compiled " in ln]


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_unshared_build_noop_and_rebuilds(workspace: Workspace, family: str) -> None:
    _ws(workspace, share=False, family=family)
    first = workspace.main("build", check=True)
    assert sorted(_compiled(first.stderr)) == ["chat/htp-v73/context", "chat/htp-v73/iterator"]
    out = workspace.root / "build" / "chat" / "htp-v73"
    for stage in ("context", "iterator"):
        assert _ops(out / f"{stage}_ctx.onnx") == ["EPContext"]  # attention on the HTP too
        assert (out / f"{stage}_ctx_qnn.bin").is_file()
    assert "4 up to date" in workspace.main("build", check=True).stdout

    # A config-only edit of the source (search options) compiles nothing.
    config_path = workspace.root / "models" / "tiny" / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["search"]["top_k"] = 5
    config_path.write_text(json.dumps(config))
    again = workspace.main("build", check=True)
    assert "3 up to date" in again.stdout and _compiled(again.stderr) == []  # + 1 packaged
    written = json.loads((out / "genai_config.json").read_text())
    assert written["search"]["top_k"] == 5  # the package's config follows the source's

    # context_length shapes both graphs: both recompile.
    _ws(workspace, share=False, context=96, family=family)
    second = workspace.main("build", check=True)
    assert sorted(_compiled(second.stderr)) == ["chat/htp-v73/context", "chat/htp-v73/iterator"]
    ctx = onnx.load(out / "iterator_ctx.onnx", load_external_data=False)
    cache = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in ctx.graph.input}
    assert cache["past_key_values.0.key"] == [1, 2, 96, 16]


def test_shared_build_is_one_action_n_plus_one(workspace: Workspace) -> None:
    _ws(workspace, share=True)
    first = workspace.main("build", check=True)
    assert _compiled(first.stderr) == ["chat/htp-v73"]
    out = workspace.root / "build" / "chat" / "htp-v73"
    assert sorted(p.name for p in out.iterdir()) == [
        "context_ctx.onnx",
        "context_ctx_qnn.bin",  # one binary, both graphs
        "genai_config.json",
        "iterator_ctx.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert "3 up to date" in workspace.main("build", check=True).stdout


@pytest.mark.slow
def test_source_model_edit_rebuilds_through_the_noop_path(workspace: Workspace) -> None:
    _ws(workspace, share=True)
    workspace.cli("build", check=True)
    workspace.cli("build", check=True)  # records the no-op fingerprint where it can
    source = workspace.root / "models" / "tiny" / "model.onnx"
    model = onnx.load(source, load_external_data=False)
    model.doc_string = "edited"
    onnx.save(model, source)
    again = workspace.cli("build", check=True)
    assert _compiled(again.stderr) == ["chat/htp-v73"]


def test_unpreparable_source_fails_its_action_with_the_reason(workspace: Workspace) -> None:
    _ws(workspace, share=False)
    (workspace.root / "models" / "tiny" / "model.onnx").write_bytes(b"not a model")
    proc = workspace.cli("build")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "models/tiny/model.onnx: not a valid ONNX model" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_package_generates_the_source_tokens_and_is_relocatable(
    workspace: Workspace, tmp_path: Path, family: str
) -> None:
    _ws(workspace, share=False, family=family)
    workspace.cli("build", check=True)
    out = workspace.root / "build" / "chat" / "htp-v73"
    config = json.loads((out / "genai_config.json").read_text())
    model = config["model"]
    assert model["type"] == "decoder-pipeline" and model["context_length"] == 64
    assert model["decoder"]["sliding_window"]["window_size"] == 16
    stages = [next(iter(s.values())) for s in model["decoder"]["pipeline"]]
    assert [s["filename"] for s in stages] == ["context_ctx.onnx", "iterator_ctx.onnx"]
    options = stages[0]["session_options"]["provider_options"]
    assert options == [{"qnn": {"backend_type": "htp", "htp_arch": "73", "soc_model": "60"}}]
    assert config["search"]["max_length"] == 64  # capped at context_length
    assert (out / "tokenizer.json").read_bytes() == (
        FIXTURES / family / "tokenizer.json"
    ).read_bytes()

    source = generate(FIXTURES / family, qnn=False, tokens=10, max_length=48)
    moved = tmp_path / "elsewhere"
    shutil.move(str(workspace.root / "build"), moved)  # relocatable: names are relative
    package = generate(moved / "chat" / "htp-v73", qnn=True, tokens=10, max_length=48)
    result = compare(package, source, DEFAULT_NEAR_TIE)
    assert result.verdict in (Verdict.MATCH, Verdict.NEAR_TIE), result.describe()
    assert len(package.tokens) == 10 and package.tokens_per_second > 0


@pytest.mark.slow
def test_status_and_clean(workspace: Workspace) -> None:
    _ws(workspace, share=False)
    before = workspace.cli("status").stdout
    assert "stale       chat/htp-v73/context" in before
    assert "llms.chat: its static graphs are not prepared yet" in before
    workspace.cli("build", check=True)
    after = workspace.cli("status").stdout
    assert "up to date  chat/htp-v73/iterator" in after and "orphaned" not in after
    workspace.cli("clean", check=True)
    out = workspace.root / "build" / "chat" / "htp-v73"
    assert not out.exists()  # ctx models, binaries, genai_config.json, tokenizer files
    assert (workspace.root / "models" / "tiny" / "tokenizer.json").is_file()  # sources kept


@pytest.mark.slow
@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_model_package_holds_the_genai_folder(workspace: Workspace) -> None:
    _ws(workspace, share=False)
    workspace.cli("build", check=True)
    workspace.cli("package", "-o", "dist", check=True)
    dist = workspace.root / "dist"
    deploy = json.loads((dist / "epbuild-package.json").read_text())
    assert deploy["llms"] == [
        {
            "name": "chat",
            "provider": "htp-v73",
            "folder": "chat/htp-v73",
            "genai_config": "chat/htp-v73/genai_config.json",
            "context_length": 64,
            "window_size": 16,
            "share_weights": False,
        }
    ]
    for name in ("genai_config.json", "tokenizer.json", "context_ctx.onnx", "iterator_ctx.onnx"):
        assert f"chat/htp-v73/{name}" in deploy["files"]
    package = generate(dist / "chat" / "htp-v73", qnn=True, tokens=4, max_length=48)
    source = generate(FIXTURES / "llama", qnn=False, tokens=4, max_length=48)
    assert compare(package, source, DEFAULT_NEAR_TIE).verdict in (Verdict.MATCH, Verdict.NEAR_TIE)


@pytest.mark.slow
def test_two_builds_at_once_prepare_once(workspace: Workspace) -> None:
    import subprocess
    import sys

    _ws(workspace, share=False)
    command = [sys.executable, "-m", "epbuild", "-C", str(workspace.root), "build"]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    procs.append(
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    )
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
    prepared = workspace.root / ".epbuild" / "llm" / "chat"
    folders = [p for p in prepared.iterdir() if p.is_dir()]
    assert len(folders) == 1 and not [p for p in folders if p.name.startswith(".prep-")]
    assert sorted(p.name for p in folders[0].iterdir()) == [
        "context.onnx",
        "context.onnx.data",
        "iterator.onnx",
        "iterator.onnx.data",
        "op_affinity.json",
    ]
    assert "4 up to date" in workspace.cli("build", check=True).stdout


def test_build_and_package_import_no_onnx_in_the_coordinator(workspace: Workspace) -> None:
    """Preparation runs in a child process; the coordinator stays free of onnx."""
    import subprocess
    import sys

    _ws(workspace, share=False)
    code = (
        "import sys; from epbuild.frontends.cli import main\n"
        f"a = main(['-C', {str(workspace.root)!r}, 'build'])\n"
        f"b = main(['-C', {str(workspace.root)!r}, 'package', '-o', 'dist'])\n"
        "print(a, b, sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split("\n")[-2] == "0 0 []", proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_killed_preparation_leaves_nothing_behind(workspace: Workspace) -> None:
    _ws(workspace, share=False)
    workspace.cli("build", check=True)
    prepared = workspace.root / ".epbuild" / "llm" / "chat"
    (folder,) = [p for p in prepared.iterdir() if p.is_dir()]
    shutil.rmtree(folder)
    dead = prepared / f".prep-{folder.name}-dead"  # what a killed preparation leaves
    dead.mkdir()
    (dead / "context.onnx").write_bytes(b"half written")
    workspace.cli("build", check=True)
    assert sorted(p.name for p in prepared.iterdir() if p.is_dir()) == [folder.name]


def test_a_source_whose_data_file_is_a_hard_link_prepares(workspace: Workspace) -> None:
    """A source kept in a hard-linking store (DVC's ``hardlink`` cache): ONNX's own loader
    refuses such a data file ("potential hardlink attack"); the preparation reads the
    weights as ONNX Runtime does."""
    import os

    _ws(workspace, share=False)
    data = workspace.root / "models" / "tiny" / "model.onnx.data"
    os.link(data, workspace.root / "store-object")
    workspace.main("build", "chat/prepare", check=True)
