"""Calibration and validation samples as hostile input: special files (a FIFO, a link to
``/dev/zero``) are refused before anything opens them, archives and arrays are checked from
their headers before their data is read (a crafted header claiming terabytes, a member that
is no array, a corrupt deflate stream), values that are not finite are refused naming the
file and the input, a link loop under ``**`` ends the walk, tens of thousands of samples
cost linear time, ``verify --numerics`` streams, and an interrupted calibration leaves no
temporary file behind. A tiny model (x[1, 8] @ W → Relu → @ V) in a quantized group for
HTP v73; only the validation test compiles (with the real QNN EP)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import psutil
import pytest
import waits
from conftest import HTP73, Workspace, render_manifest
from modelgen import matmul_model
from onnx import TensorProto, helper, numpy_helper

from epbuild.errors import ModelError
from epbuild.manifest.globwalk import glob_paths
from epbuild.quant.samples import InputSpec, read_sample

N = 8
SPECS = [InputSpec("x", np.dtype("float32"), (1, N))]


def manifest(
    ws: Workspace, calibration: str = "calib/*", models: str = "models/*.onnx", **recipe: str
) -> None:
    text = render_manifest(
        {
            "providers": {"htp": HTP73},
            "groups": {"g": {"models": [models], "providers": ["htp"], "quantize": "q"}},
        }
    )
    lines = [f'calibration = "{calibration}"'] + [f'{k} = "{v}"' for k, v in recipe.items()]
    (ws.root / "epbuild.toml").write_text(text + "\n[quantization.q]\n" + "\n".join(lines) + "\n")


def samples(ws: Workspace, folder: str = "calib", n: int = 6, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    (ws.root / folder).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        np.save(ws.root / folder / f"s{i:02d}.npy", rng.standard_normal((1, N), dtype=np.float32))


@pytest.fixture
def tws(workspace: Workspace) -> Workspace:
    """The tiny model in a quantized group, six .npy calibration samples."""
    workspace.model("models/tiny.onnx", matmul_model(n=N))
    samples(workspace)
    manifest(workspace)
    return workspace


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    """An .npy file's magic and header for ``shape``, without data."""
    from numpy.lib import format as npformat

    out = io.BytesIO()
    npformat.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def corrupt_deflate(path: Path) -> None:
    """An .npz whose one member's deflate stream is garbage (0xFF: a reserved block type)."""
    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.zeros((1, N), np.float32))
    data = bytearray(buf.getvalue())
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).infolist()[0]
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start : start + info.compress_size] = b"\xff" * info.compress_size
    path.write_bytes(bytes(data))


def hostile(name: str, path: Path) -> None:
    """Write the hostile sample ``name`` at ``path`` (an .npz or .npy)."""
    if name == "member not an array":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x", b"not an array")
    elif name == "corrupt deflate":
        corrupt_deflate(path)
    elif name == "huge header":  # 373 GiB claimed in a few bytes
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x.npy", npy_header((100_000_000_000, 1_000)) + b"\0" * 64)
    elif name == "npy wrong shape":  # 4 TiB claimed; the header alone is written
        path.write_bytes(npy_header((1, 1 << 40)) + b"\0" * 64)
    elif name in ("nan", "inf"):
        array = np.ones((1, N), np.float32)
        array[0, 5] = np.nan if name == "nan" else -np.inf
        np.save(path, array) if path.suffix == ".npy" else np.savez(path, x=array)


HOSTILE = [
    ("member not an array", "s03.npz", "member 'x' is not an array"),
    ("corrupt deflate", "s03.npz", "not a readable .npz file of arrays (Error -3"),
    ("huge header", "s03.npz", "has shape [100000000000, 1000], the model takes x [1, 8]"),
    ("npy wrong shape", "s03.npy", "has shape [1, 1099511627776], the model takes x [1, 8]"),
    ("nan", "s03.npy", "input 'x' holds NaN at [0, 5]"),
    ("inf", "s03.npz", "input 'x' holds an infinity at [0, 5]"),
]
"""Each hostile sample, the file it is written as, and what its message says."""
END_TO_END = ("huge header", "nan")
"""The hostile samples the inner loop builds: one refused from its header, one from its
values; the others' messages are checked fast by test_the_reader_names_each_hostile_sample."""


@pytest.mark.parametrize(
    ("name", "file", "said"),
    [
        pytest.param(*case, marks=() if case[0] in END_TO_END else pytest.mark.slow)
        for case in HOSTILE
    ],
)
def test_a_hostile_calibration_sample_is_exit_2_naming_it(
    tws: Workspace, name: str, file: str, said: str
) -> None:
    (tws.root / "calib" / "s03.npy").unlink()
    hostile(name, tws.root / "calib" / file)
    proc = tws.cli("build")
    assert proc.returncode == 2, proc.stderr
    assert f"calib/{file}" in proc.stderr and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tws.root / ".epbuild/quant/g/tiny").exists()  # nothing half-written


@pytest.mark.parametrize(("name", "file", "said"), HOSTILE)
def test_the_reader_names_each_hostile_sample(
    tmp_path: Path, name: str, file: str, said: str
) -> None:
    """What the calibration's reader says of each hostile sample (the build says it and
    commits nothing: test_a_hostile_calibration_sample_is_exit_2_naming_it)."""
    hostile(name, tmp_path / file)
    with pytest.raises(ModelError, match=re.escape(f"{file}: ")) as info:
        read_sample(str(tmp_path), file, SPECS)
    assert said in info.value.message, info.value.message


@pytest.mark.parametrize("special", ["fifo", "dev zero"])
@pytest.mark.parametrize("where", ["calib/s03.npy", "zoo/test_data_set_0/input_0.pb"])
def test_a_special_file_is_named_before_anything_opens_it(
    tws: Workspace, special: str, where: str
) -> None:
    """A FIFO would block ``status`` (hashing it) for ever, ``/dev/zero`` never end."""
    path = tws.root / where
    if where.endswith(".pb"):
        manifest(tws, "zoo")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if special == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    for command in ("status", "build"):
        proc = tws.cli(command)
        assert proc.returncode == 2, proc.stderr
        kind = "a FIFO (named pipe)" if special == "fifo" else "a character device (through a link)"
        assert f"'{where}' is {kind}, not a regular file" in proc.stderr, proc.stderr
        assert "quantization.q.calibration" in proc.stderr and "Traceback" not in proc.stderr


def test_the_reader_refuses_a_special_file_itself(tmp_path: Path) -> None:
    """One made after the manifest was loaded: the worker refuses it too, opening nothing
    that could block."""
    os.mkfifo(tmp_path / "s.npy")
    (tmp_path / "z.npz").symlink_to("/dev/zero")
    for name, kind in (("s.npy", "a FIFO"), ("z.npz", "a character device (through a link)")):
        with pytest.raises(ModelError, match=re.escape(f"{name}: {kind}")):
            read_sample(str(tmp_path), name, SPECS)


def test_a_header_claiming_more_than_its_file_holds_is_refused_before_reading(
    tmp_path: Path,
) -> None:
    """With a free dimension the shape alone cannot refuse a header: its size must match
    the bytes that follow it, and nothing is allocated before that is known."""
    free = [InputSpec("x", np.dtype("float32"), ("batch", N))]
    (tmp_path / "a.npy").write_bytes(npy_header((100_000_000_000, N)) + b"\0" * 64)
    with zipfile.ZipFile(tmp_path / "b.npz", "w") as z:
        z.writestr("x.npy", npy_header((100_000_000_000, N)) + b"\0" * 64)
    for name in ("a.npy", "b.npz"):
        with pytest.raises(ModelError, match=r"3200000000000 bytes\), but 64 bytes of data"):
            read_sample(str(tmp_path), name, free)
    np.save(tmp_path / "c.npy", np.ones((3, N), np.float32))
    assert read_sample(str(tmp_path), "c.npy", free)["x"].shape == (3, N)


def test_a_test_data_tensor_of_the_wrong_shape_is_refused_from_its_fields(
    tmp_path: Path,
) -> None:
    from onnx import numpy_helper

    folder = tmp_path / "test_data_set_0"
    folder.mkdir()
    tensor = numpy_helper.from_array(np.ones((3, N), np.float32), "x")
    (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
    with pytest.raises(ModelError, match=r"input 'x' has shape \[3, 8\]"):
        read_sample(str(tmp_path), "test_data_set_0", SPECS)
    tensor = numpy_helper.from_array(np.full((1, N), np.nan, np.float32), "x")
    (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
    with pytest.raises(ModelError, match=r"test_data_set_0: input 'x' holds NaN"):
        read_sample(str(tmp_path), "test_data_set_0", SPECS)


def loops(folder: Path) -> None:
    """Two link loops in ``folder/sub`` (``up -> ..``, ``self -> .``): Python's glob lists
    2^40 paths under them."""
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    (folder / "sub" / "up").symlink_to("..")
    (folder / "sub" / "self").symlink_to(".")


def test_globs_stop_at_link_loops(tmp_path: Path) -> None:
    loops(tmp_path / "d")
    (tmp_path / "d" / "a.npy").touch()
    (tmp_path / "d" / "sub" / "b.npy").touch()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "c.npy").touch()
    (tmp_path / "d" / "sub" / "out").symlink_to("../../other")  # a link, no loop: followed
    assert glob_paths(str(tmp_path), "d/**/*.npy") == [
        "d/a.npy",
        "d/sub/b.npy",
        "d/sub/out/c.npy",
    ]
    # the links themselves match, nothing under them
    folders = ["d", "d/sub", "d/sub/out", "d/sub/self", "d/sub/up", "other"]
    assert glob_paths(str(tmp_path), "**/") == folders


@pytest.mark.parametrize(
    "pattern",
    ["**/*.npy", "a/*", "*/*/*.npy", "a/.h/*", "a/.*", "**/.h/*", "a/**/y.npy", "[ab]/*", "**"],
)
def test_globs_match_as_python_globs_where_there_is_no_loop(tmp_path: Path, pattern: str) -> None:
    import glob

    for rel in ("a/x.npy", "a/b/y.npy", "a/b/.h/z.npy", "a/.w.npy", "t.npy", "a/.h/v.npy"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    (tmp_path / "a" / "lnk").symlink_to("b")
    (tmp_path / "dangling.npy").symlink_to("nothing")
    expected = sorted(
        {os.path.normpath(p) for p in glob.glob(pattern, root_dir=tmp_path, recursive=True)}
    )
    assert glob_paths(str(tmp_path), pattern) == expected


def test_link_loops_under_calibration_and_model_globs_end(tws: Workspace) -> None:
    loops(tws.root / "calib")
    loops(tws.root / "models")
    manifest(tws, "calib/**/*.npy", "models/**/*.onnx")
    proc = tws.main("status", "--json")
    assert proc.returncode in (0, 1), proc.stderr
    assert "g/tiny/calibrate" in proc.stdout


@pytest.mark.timeout(120)
def test_a_hundred_thousand_samples_named_twice_expand_in_linear_time(tmp_path: Path) -> None:
    """200,000 entries naming 100,000 samples twice (none of them written: a missing sample
    is its key's to report). A list's ``in`` made that some 10^10 string comparisons
    (minutes); dicts take seconds. No timing is asserted: the timeout (scaled on a slow
    machine) is far above the linear time and below the quadratic one."""
    from epbuild.manifest.locate import Where
    from epbuild.manifest.quantization import load_quantization

    names = [f"calib/s{i:06d}.npy" for i in range(100_000)]
    table = {"calibration": names + names[::-1]}
    where = Where(tmp_path / "epbuild.toml", "")
    found = load_quantization(where, tmp_path, {"q": table}, (".epbuild",))
    assert found["q"].calibration == tuple(names)


def test_nan_in_a_validation_sample_is_exit_2_naming_it(tws: Workspace) -> None:
    """Not "SQNR -inf dB … so it is the quantization": the sample is the user's to fix."""
    samples(tws, "valid", n=3)  # the first calibration samples again: within their ranges
    manifest(tws, validation="valid/*.npy")
    assert tws.main("build").returncode == 0
    good = tws.cli_json("verify", "--numerics")
    assert [c["status"] for c in good["numerics"]] == ["ok"], good
    hostile("nan", tws.root / "valid" / "s01.npy")
    proc = tws.cli("verify", "--numerics")
    assert proc.returncode == 2, proc.stderr
    assert "valid/s01.npy: input 'x' holds NaN at [0, 5]" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "SQNR" not in proc.stderr + proc.stdout


def embedding_model(vocab: int = 16, n: int = N) -> onnx.ModelProto:
    """ids[1, 4] (int64) → Gather of a [vocab, n] table → MatMul: a token id past ``vocab``
    fails in ONNX Runtime, whatever its sample's header says."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, n), dtype=np.float32)
    w = rng.standard_normal((n, n), dtype=np.float32) * 0.1
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["E", "ids"], ["e"]),
            helper.make_node("MatMul", ["e", "W"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, n])],
        [numpy_helper.from_array(table, "E"), numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def ids_samples(ws: Workspace, folder: str, n: int = 3, bad: int | None = None) -> None:
    """``n`` .npy samples of token ids below 16; sample ``bad`` holds id 99."""
    (ws.root / folder).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        ids = np.array([[i, 1, 2, 3]], dtype=np.int64) if i != bad else np.full((1, 4), 99)
        np.save(ws.root / folder / f"s{i:02d}.npy", ids.astype(np.int64))


def test_a_sample_the_float_model_fails_on_is_exit_2_naming_it(workspace: Workspace) -> None:
    """A token id past the vocabulary: ONNX Runtime's Gather fails in the calibration's (and
    ``verify --numerics``'s) run of the float model; the message names the sample and the
    model, exit 2, not ORT's error alone (exit 1, no file named)."""
    workspace.model("models/emb.onnx", embedding_model())
    ids_samples(workspace, "calib", bad=1)
    manifest(workspace)
    proc = workspace.main("build")
    assert proc.returncode == 2, proc.stderr
    said = "calib/s01.npy: models/emb.onnx fails on this sample in ONNX Runtime"
    assert said in proc.stderr and "idx=99" in proc.stderr, proc.stderr
    assert not (workspace.root / ".epbuild/quant/g/emb").exists()
    ids_samples(workspace, "calib")
    ids_samples(workspace, "valid", bad=2)
    manifest(workspace, validation="valid/*.npy")
    assert workspace.main("build").returncode == 0
    proc = workspace.cli("verify", "--numerics")
    assert proc.returncode == 2, proc.stderr
    assert "valid/s02.npy: models/emb.onnx fails on this sample" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "SQNR" not in proc.stderr + proc.stdout


def rmsnorm_model(n: int = N) -> onnx.ModelProto:
    """x[1, n] → MatMul → Pow(2) → ReduceMean → Mul: a decomposed RMSNorm, as torch's
    dynamo exporter writes one (ops no ORT quantization registry lists)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n), dtype=np.float32) * 0.1
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Pow", ["h", "two"], ["p"]),
            helper.make_node("ReduceMean", ["p", "axes"], ["m"]),
            helper.make_node("Mul", ["h", "m"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def test_ops_no_registry_lists_are_calibrated(workspace: Workspace) -> None:
    """The quantizer quantizes every op type a graph has: its calibration records them all
    (it recorded only the registries' ops, and the quantizer failed: "Quantization
    parameters are not specified for param p")."""
    workspace.model("models/rms.onnx", rmsnorm_model())
    samples(workspace)
    manifest(workspace)
    proc = workspace.main("build")
    assert proc.returncode == 0, proc.stderr
    ranges = json.loads((workspace.root / ".epbuild/quant/g/rms/ranges.json").read_text())
    assert {"p", "m"} <= set(ranges["data"])


def test_a_free_dimension_hint_names_the_model_the_manifest_lists(workspace: Workspace) -> None:
    """A quantized model with a symbolic batch: the hint's table entry is the float model's
    path, not the QDQ model's under the output directory (which the manifest cannot list)."""
    workspace.model("models/tiny.onnx", matmul_model(n=N, batch="batch"))
    samples(workspace)
    manifest(workspace)
    proc = workspace.main("build")
    assert proc.returncode != 0, proc.stderr
    assert "symbolic dimension 'batch'" in proc.stderr, proc.stderr
    assert '{ path = "models/tiny.onnx", free_dimensions = { batch = ... } }' in proc.stderr


def gelu_model(n: int = N) -> onnx.ModelProto:
    """x[1, n] → MatMul → the Erf form of GELU (Div, Erf, Add, Mul, Mul), which ONNX
    Runtime's QNN preprocessing fuses into one Gelu node."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n), dtype=np.float32) * 0.1
    consts = {"sqrt2": 1.4142135, "one": 1.0, "half": 0.5}
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
            helper.make_node("Div", ["h", "sqrt2"], ["d"], name="div"),
            helper.make_node("Erf", ["d"], ["e"], name="erf"),
            helper.make_node("Add", ["e", "one"], ["a"], name="add"),
            helper.make_node("Mul", ["h", "a"], ["m"], name="mul"),
            helper.make_node("Mul", ["m", "half"], ["y"], name="half_mul"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(w, "W")]
        + [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_a_node_the_preprocessing_fused_is_not_called_missing(workspace: Workspace) -> None:
    """``exclude`` naming a node the float model has (Netron shows it) but the QNN
    preprocessing fused away: the message says so and names the preprocessed model, not
    "which the model does not have" of a model that has it."""
    workspace.model("models/gelu.onnx", gelu_model())
    samples(workspace)
    manifest(workspace)
    text = (workspace.root / "epbuild.toml").read_text()
    (workspace.root / "epbuild.toml").write_text(text + 'exclude = ["erf"]\n')
    proc = workspace.main("build")
    assert proc.returncode == 2, proc.stderr
    said = "exclude names node 'erf', which ONNX Runtime's quantization preprocessing fused"
    assert said in proc.stderr and ".epbuild/quant/g/gelu/model.onnx" in proc.stderr, proc.stderr
    (workspace.root / "epbuild.toml").write_text(text + 'exclude = ["nothing"]\n')
    proc = workspace.main("build")
    assert proc.returncode == 2, proc.stderr
    assert "exclude names node 'nothing', which the model does not have" in proc.stderr


def test_layer_errors_hold_no_activations(tmp_path: Path) -> None:
    """The per-layer SQNR of ``verify --numerics`` keeps running sums: its memory after
    400 samples is what it was after 20 (ONNX Runtime's ``collect_activations`` holds
    every sample's activations of every layer)."""
    import tracemalloc

    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static

    from epbuild.inspection.quantcheck import LayerErrors

    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 64), dtype=np.float32)} for _ in range(8)]

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.left = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.left, None)

    float_model, qdq_model = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    onnx.save(matmul_model(n=64), float_model)
    quantize_static(float_model, qdq_model, Reader(), activation_type=QuantType.QUInt8)
    layers = LayerErrors(float_model, qdq_model, str(tmp_path))
    feed = {"x": rng.standard_normal((1, 64), dtype=np.float32)}

    def peak(count: int) -> int:
        tracemalloc.start()
        try:
            for _ in range(count):
                layers.add(feed)
            return tracemalloc.get_traced_memory()[0]  # what is still held
        finally:
            tracemalloc.stop()

    few, many = peak(20), peak(400)
    assert many < 1.5 * few + 64 * 1024, (few, many)
    worst = layers.worst()
    assert worst and all(isinstance(db, float) for _, db in worst), worst


ORT_SESSION_ID = ".ses"
"""What ``import onnxruntime`` itself writes into the temporary folder, once and for good
(its telemetry session id, a few bytes), interrupted or not: no temporary file."""


def left_in(folder: Path) -> list[str]:
    """The names in ``folder``, less ONNX Runtime's session id."""
    return sorted(p.name for p in folder.iterdir() if p.name != ORT_SESSION_ID)


def _interrupted_calibration(
    tws: Workspace, tmp_path: Path, sig: int
) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    """A build of many samples, given ``sig`` (to its process group, as a terminal's Ctrl-C)
    once its calibration reports progress; the build and its workers."""
    samples(tws, n=6000)
    temp = tmp_path / "tmpdir"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "epbuild", "-C", str(tws.root), "build"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    waits.wait_for(
        lambda: list((tws.root / "build" / ".staging").glob("*/.progress")),
        "the calibration to report progress",
        proc=proc,
    )
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, sig)
    return proc, workers


# Ctrl-C is the gentler end: the killed calibration below leaves no temporary file either
# (test_a_killed_calibration_leaves_nothing_the_next_build_keeps), and Ctrl-C during a
# compile exits 130 and cleans up (test_crash.py).
@pytest.mark.slow
def test_ctrl_c_during_calibration_leaves_nothing_in_tmpdir(tws: Workspace, tmp_path: Path) -> None:
    proc, _ = _interrupted_calibration(tws, tmp_path, signal.SIGINT)
    _, err = waits.communicate(proc, "the build to exit after SIGINT")
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert left_in(tmp_path / "tmpdir") == []
    assert list((tws.root / "build" / ".staging").glob("*")) == []


def test_a_killed_calibration_leaves_nothing_the_next_build_keeps(
    tws: Workspace, tmp_path: Path
) -> None:
    """The worker (its own session) exits when it sees the build gone, leaving its staging
    directory, temporary files included; the next build removes it."""
    proc, workers = _interrupted_calibration(tws, tmp_path, signal.SIGKILL)
    waits.communicate(proc, "the build to die of SIGKILL")
    waits.wait_for(
        lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers),
        "the killed build's worker to exit",
    )
    assert left_in(tmp_path / "tmpdir") == []
    manifest(tws, "calib/s0[0-5].npy")
    assert tws.main("build").returncode == 0
    assert list((tws.root / "build" / ".staging").glob("*")) == []
