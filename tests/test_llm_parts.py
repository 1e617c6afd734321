"""[llms] parts: a decoder cut at layer boundaries (epbuild/llm/parts.py, partgraphs.py)
into a CPU embeddings stage and parts whose prompt and token graphs compile as actions of
their own. The chained parts compute exactly what the whole static graph does; a build in
3 parts generates the source's tokens through onnxruntime-genai + the emulated HTP; an edit
of the last layer recompiles the last part only; parts compile in parallel."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import Workspace
from llmfixture import LLM_FIXTURES, chat_manifest, deepen, save_decoder
from onnx import numpy_helper

from epbuild.llm.generate import DEFAULT_NEAR_TIE, Verdict, compare, genai_installed, generate
from epbuild.llm.partgraphs import PartShape, write_parts
from epbuild.llm.parts import (
    PARTS_JSON,
    WeightSizes,
    parse_size,
    part_bytes,
    parts_for_size,
    split_layers,
    weight_sizes,
)
from epbuild.llm.static import StaticShape, make_static
from epbuild.results import Outcome

WINDOW, CONTEXT, HEAD = 16, 64, 16


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 4 layers."""
    folder = tmp_path_factory.mktemp("deep") / "llama"
    shutil.copytree(LLM_FIXTURES / "llama", folder)
    return deepen(folder, 4)


def _workspace(ws: Workspace, deep: Path, *, share: bool, more: str = "parts = 3") -> Workspace:
    target = ws.root / "models" / "tiny"
    if not target.exists():
        shutil.copytree(deep, target)
    ws.manifest(chat_manifest(share=share) + more + "\n")
    return ws


def test_split_balances_the_largest_part() -> None:
    sizes = WeightSizes(layers=(10, 10, 10, 10), tail=6, embedding=50)
    assert split_layers(sizes, 1) == (range(4),)
    assert split_layers(sizes, 2) == (range(2), range(2, 4))
    three = split_layers(sizes, 3)
    assert three == (range(2), range(2, 3), range(3, 4))  # the tail weighs on the last
    assert part_bytes(sizes, three) == (20, 10, 16)
    assert split_layers(sizes, 4) == tuple(range(i, i + 1) for i in range(4))
    with pytest.raises(ValueError):
        split_layers(sizes, 5)
    assert parts_for_size(sizes, 40) == 2 and parts_for_size(sizes, 20) == 3
    with pytest.raises(ValueError) as info:
        parts_for_size(sizes, 15)
    assert info.value.args == (16,)  # the smallest workable limit


def test_sizes_parse() -> None:
    assert parse_size("1 GiB") == 1 << 30 and parse_size("512MB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29 and parse_size("4096") == 4096
    assert parse_size("lots") is None and parse_size("0 MiB") is None
    assert parse_size("1 iB") is None and parse_size("2 KiB") == 2048  # "i" only with a unit


def test_weight_sizes_follow_the_layer_names(deep: Path) -> None:
    sizes = weight_sizes(deep / "model.onnx", 4)
    layer = 4 * (64 * 128 * 3 + 64 * 64 + 128 * 64 + 2 * 64)
    assert sizes.layers == (layer,) * 4
    assert sizes.embedding == 4 * 384 * 64
    assert sizes.tail == 4 * (64 * 384 + 64 + 2 * 128 * 8)  # lm_head, final norm, rope caches


def _feeds(session: ort.InferenceSession, sequence: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sequence)
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(2, 384, (1, sequence)).astype(np.int64),
        "past_seq_len": np.array([[past + sequence - 1]], np.int32),
        "total_seq_len": np.array([CONTEXT], np.int32),
    }
    for value in session.get_inputs():
        if value.name.startswith("past_key_values."):
            feeds[value.name] = rng.normal(0, 1, (1, 2, CONTEXT, HEAD)).astype(np.float32)
    return feeds


@pytest.mark.parametrize(
    ("graph", "sequence", "past"), [("context", WINDOW, 0), ("iterator", 1, 20)]
)
def test_chained_parts_compute_the_whole_graph(
    deep: Path, tmp_path: Path, graph: str, sequence: int, past: int
) -> None:
    split = write_parts(
        str(deep / "model.onnx"), str(tmp_path), PartShape(WINDOW, CONTEXT, HEAD, 3)
    )
    assert split == (range(2), range(2, 3), range(3, 4))
    whole = ort.InferenceSession(
        make_static(
            onnx.load(deep / "model.onnx"), StaticShape(sequence, CONTEXT, HEAD)
        ).SerializeToString()
    )
    store = _feeds(whole, sequence, past)
    expected = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, store), strict=True))
    described = json.loads((tmp_path / PARTS_JSON).read_text())
    assert list(described) == ["embeddings", "part1", "part2", "part3"]
    assert [described[p]["layers"] for p in ("part1", "part2", "part3")] == [[0, 1], [2, 2], [3, 3]]
    for stage in ("embeddings", f"part1_{graph}", f"part2_{graph}", f"part3_{graph}"):
        session = ort.InferenceSession(str(tmp_path / f"{stage}.onnx"))
        names = [i.name for i in session.get_inputs()]
        assert names == described[stage.split("_")[0]]["inputs"]
        outputs = session.run(None, {n: store[n] for n in names})
        store.update(zip([o.name for o in session.get_outputs()], outputs, strict=True))
    for name, value in expected.items():
        assert np.array_equal(store[name], value), name
    # One tensor crosses each cut; the embedding table is only in the CPU stage's data.
    assert len(described["part2"]["inputs"]) == 1 + 2 + 2
    data = {p.name: p.stat().st_size for p in tmp_path.glob("*.data")}
    assert data["embeddings.onnx.data"] == 4 * 384 * 64
    sizes = weight_sizes(deep / "model.onnx", 4)
    assert data["part3.onnx.data"] == sizes.layers[3] + sizes.tail
    assert data["part1.onnx.data"] == sum(sizes.layers[:2]) + 4 * 2 * 128 * 8  # + rope caches


def test_cutting_is_deterministic(deep: Path, tmp_path: Path) -> None:
    shape = PartShape(WINDOW, CONTEXT, HEAD, 2)
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        write_parts(str(deep / "model.onnx"), str(tmp_path / name), shape)
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_a_preparation_keeps_the_data_files_an_edit_left_alone(deep: Path, tmp_path: Path) -> None:
    """Written beside the last preparation (``previous``), a data file that would hold the
    same bytes is that preparation's file (a hard link: compared, not written again); one
    whose weights changed, one changed since, or a link in its place, is written anew."""
    source = tmp_path / "source"
    shutil.copytree(deep, source)
    model, shape = str(source / "model.onnx"), PartShape(WINDOW, CONTEXT, HEAD, 3)
    folders = {name: tmp_path / name for name in ("first", "fresh", "kept", "tampered")}
    for folder in folders.values():
        folder.mkdir()
    write_parts(model, str(folders["first"]), shape)
    _edit_last_layer(source)
    write_parts(model, str(folders["fresh"]), shape)
    write_parts(model, str(folders["kept"]), shape, str(folders["first"]))

    def same(name: str, a: str = "first", b: str = "kept") -> bool:
        return os.path.samefile(folders[a] / name, folders[b] / name)

    for path in sorted(folders["fresh"].iterdir()):
        assert path.read_bytes() == (folders["kept"] / path.name).read_bytes(), path.name
    assert same("embeddings.onnx.data") and same("part1.onnx.data") and same("part2.onnx.data")
    assert not same("part3.onnx.data")  # the edited layer's part

    with open(folders["first"] / "part2.onnx.data", "r+b") as f:  # a byte changed since
        f.seek(100)
        flipped = bytes([f.read(1)[0] ^ 1])
        f.seek(100)
        f.write(flipped)
    elsewhere = tmp_path / "elsewhere.data"
    shutil.copyfile(folders["fresh"] / "part1.onnx.data", elsewhere)
    os.unlink(folders["first"] / "part1.onnx.data")
    os.symlink(elsewhere, folders["first"] / "part1.onnx.data")  # a link is never followed
    write_parts(model, str(folders["tampered"]), shape, str(folders["first"]))
    for path in sorted(folders["fresh"].iterdir()):
        assert path.read_bytes() == (folders["tampered"] / path.name).read_bytes(), path.name
    assert same("embeddings.onnx.data", b="tampered")
    assert not os.path.islink(folders["tampered"] / "part1.onnx.data")
    assert not os.path.samefile(elsewhere, folders["tampered"] / "part1.onnx.data")
    assert not same("part2.onnx.data", b="tampered")


def test_where_hard_links_fail_the_unchanged_data_files_are_copied(
    deep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without hard links (EPERM, another device): the preparation copies
    what it would have kept, the same bytes, and nothing of the last one is touched."""
    shape = PartShape(WINDOW, CONTEXT, HEAD, 3)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    write_parts(str(deep / "model.onnx"), str(first), shape)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in first.iterdir()}

    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    write_parts(str(deep / "model.onnx"), str(second), shape, str(first))
    for path in sorted(first.iterdir()):
        assert (second / path.name).read_bytes() == path.read_bytes(), path.name
        assert not os.path.samefile(second / path.name, path)
        assert (path.stat().st_ino, path.read_bytes()) == before[path.name]


@pytest.mark.slow
def test_two_rebuilds_at_once_after_an_edit_keep_the_untouched_parts(
    workspace: Workspace, deep: Path
) -> None:
    """Two builds at once after an edit of the last layer: both succeed, one prepares (the
    other waits for it and finds it done), the untouched parts' data files stay the ones
    in place, nothing staged is left, and a third build has nothing to do."""
    import subprocess
    import sys

    _workspace(workspace, deep, share=True)
    assert workspace.build().ok
    prepared = workspace.root / ".epbuild" / "llm" / "chat" / "prepared"
    kept = (prepared / "part1.onnx.data").stat().st_ino
    _edit_last_layer(workspace.root / "models" / "tiny")
    command = [sys.executable, "-m", "epbuild", "-C", str(workspace.root), "build"]
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out + err
    assert (prepared / "part1.onnx.data").stat().st_ino == kept
    assert not list((workspace.root / ".epbuild").rglob("*staging*"))
    again = workspace.build()
    assert {a.outcome for a in again.actions} == {Outcome.UP_TO_DATE}


@pytest.mark.parametrize(
    ("more", "key", "said"),
    [
        ("parts = 5", "parts", "5 is not between 1 and the model's 4 layers"),
        ("parts = 0", "parts", ""),
        ('parts = 2\nmax_part_size = "1 GiB"', "max_part_size", "together with parts"),
        ('max_part_size = "lots"', "max_part_size", "'lots' is not a size"),
        ('max_part_size = "100 KiB"', "max_part_size", "smaller than one layer's weights"),
    ],
)
def test_bad_parts_exit_2_naming_the_key(
    workspace: Workspace, deep: Path, more: str, key: str, said: str
) -> None:
    _workspace(workspace, deep, share=False, more=more)
    proc = workspace.cli("status")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert key in proc.stderr and said in proc.stderr, proc.stderr


def test_max_part_size_of_a_decoder_with_inline_weights_is_refused(
    workspace: Workspace, deep: Path
) -> None:
    """Its layers weigh nothing by their external data: no silent single part."""
    _workspace(workspace, deep, share=False, more='max_part_size = "100 KiB"')
    folder = workspace.root / "models" / "tiny"
    onnx.save(onnx.load(folder / "model.onnx"), folder / "model.onnx")  # weights inline
    (folder / "model.onnx.data").unlink()
    proc = workspace.main("status")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "llms.chat.max_part_size: models/tiny/model.onnx keeps the weights of layer 0 " in (
        proc.stderr
    )
    assert "parts = N" in proc.stderr, proc.stderr


def test_parts_on_a_pipeline_source_is_refused(workspace: Workspace) -> None:
    shutil.copytree(LLM_FIXTURES / "llama-pipeline", workspace.root / "models" / "tiny")
    workspace.manifest(chat_manifest(context=None, window=None) + "parts = 2\n")
    proc = workspace.main("status")
    assert proc.returncode == 2 and "is a decoder-pipeline already" in proc.stderr, proc.stderr


def test_max_part_size_chooses_the_parts(workspace: Workspace, deep: Path) -> None:
    _workspace(workspace, deep, share=True, more='max_part_size = "300 KiB"')
    ids = {a["id"] for a in workspace.main_json("status")["actions"]}
    parts = {i for i in ids if i.startswith("chat/htp-v73/part")}
    assert parts == {"chat/htp-v73/part1", "chat/htp-v73/part2", "chat/htp-v73/part3"}


def test_one_part_is_the_whole_decoder(workspace: Workspace, deep: Path) -> None:
    _workspace(workspace, deep, share=False, more="parts = 1")
    ids = {a["id"] for a in workspace.main_json("status")["actions"]}
    assert ids == {
        "chat/prepare",
        "chat/htp-v73/context",
        "chat/htp-v73/iterator",
        "chat/htp-v73/package",
    }


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(path, load_external_data=False).graph.node]


@pytest.mark.slow
@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_three_parts_generate_the_source_tokens(workspace: Workspace, deep: Path) -> None:
    _workspace(workspace, deep, share=False)
    result = workspace.build()
    compiled = [a for a in result.actions if a.kind == "compile" and a.outcome is Outcome.COMPILED]
    assert result.ok and len(compiled) == 6
    out = workspace.root / "build" / "chat" / "htp-v73"
    for k in (1, 2, 3):
        for graph in ("context", "iterator"):
            assert _ops(out / f"part{k}_{graph}_ctx.onnx") == ["EPContext"]
    config = json.loads((out / "genai_config.json").read_text())
    pipeline = [next(iter(s.items())) for s in config["model"]["decoder"]["pipeline"]]
    assert [name for name, _ in pipeline] == [
        "embeddings",
        *(f"part{k}_{g}" for k in (1, 2, 3) for g in ("context", "iterator")),
    ]
    embeddings = pipeline[0][1]
    assert embeddings["session_options"]["provider_options"] == []  # on the CPU
    assert _ops(out / "embeddings.onnx") == ["Gather"]
    assert "logits" in pipeline[-1][1]["outputs"]
    source = generate(deep, qnn=False, tokens=10, max_length=48)
    package = generate(out, qnn=True, tokens=10, max_length=48)
    verdict = compare(package, source, DEFAULT_NEAR_TIE)
    assert verdict.verdict in (Verdict.MATCH, Verdict.NEAR_TIE), verdict.describe()
    assert len(package.tokens) == 10


def _edit_last_layer(folder: Path) -> None:
    model = onnx.load(folder / "model.onnx")
    for tensor in model.graph.initializer:
        if tensor.name == "model.layers.3.mlp.down_proj.MatMul.weight":
            values = numpy_helper.to_array(tensor).copy()
            values[0, 0] += 0.5
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    save_decoder(model, folder)


@pytest.mark.slow
def test_an_edit_of_the_last_layer_recompiles_the_last_part_only(
    workspace: Workspace, deep: Path, tmp_path: Path
) -> None:
    _workspace(workspace, deep, share=True)
    trace = tmp_path / "trace.json"
    first = workspace.build(jobs=2, trace=trace)
    assert first.ok
    compiled = {a.id for a in first.actions if a.kind == "compile"}
    assert compiled == {f"chat/htp-v73/part{k}" for k in (1, 2, 3)}
    out = workspace.root / "build" / "chat" / "htp-v73"
    assert sorted(p.name for p in out.glob("*.bin")) == [
        f"part{k}_context_ctx_qnn.bin"
        for k in (1, 2, 3)  # one shared binary per part
    ]
    # -j 2: two parts compile at once.
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "compile" and e["args"]["action"] in compiled
    ]
    assert len(spans) == 3
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])

    prepared = workspace.root / ".epbuild" / "llm" / "chat" / "prepared"
    inodes = {p.name: p.stat().st_ino for p in prepared.iterdir()}
    _edit_last_layer(workspace.root / "models" / "tiny")
    again = workspace.build()
    # the preparation kept the parts that came out the same: they stayed in place
    assert (prepared / "part1.onnx.data").stat().st_ino == inodes["part1.onnx.data"]
    assert (prepared / "part3.onnx.data").stat().st_ino != inodes["part3.onnx.data"]
    outcomes = {a.id: a.outcome for a in again.actions}
    last_part_only = {
        "chat/prepare": Outcome.COMPILED,  # (the kind says "prepared")
        "chat/htp-v73/part1": Outcome.UP_TO_DATE,
        "chat/htp-v73/part2": Outcome.UP_TO_DATE,
        "chat/htp-v73/part3": Outcome.COMPILED,
        "chat/htp-v73/package": Outcome.UP_TO_DATE,
    }
    assert outcomes == last_part_only
    # Without the stat cache to vouch for them, the kept files are read and hashed: the
    # same verdicts, and the kept (linked) file is put in place as it was.
    (workspace.root / ".epbuild" / "statcache.json").unlink()
    _edit_last_layer(workspace.root / "models" / "tiny")
    third = workspace.build()
    assert {a.id: a.outcome for a in third.actions} == last_part_only
    assert (prepared / "part1.onnx.data").stat().st_ino == inodes["part1.onnx.data"]
    assert not list((workspace.root / ".epbuild").rglob("*staging*"))
