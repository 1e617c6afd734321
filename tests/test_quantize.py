"""Quantization on the build graph: a ``[quantization.<name>]`` recipe makes a group's float
models QDQ models (one calibrate and one quantize action per model) that every provider of
the group compiles; edits run exactly the actions they concern; bad input ends in exit 2
naming the file. The float model is a real exporter's (``tests/corpus/cnn_torchscript.onnx``,
torch.onnx), compiled with the real QNN EP."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace, render_manifest
from test_two_at_once import together

CORPUS = Path(__file__).parent / "corpus"
HTP79 = {"ep": "qnn", "options": {"htp_arch": "79", "soc_model": "69"}}
QDQ = ("QuantizeLinear", "DequantizeLinear")
BuiltOnce = Callable[[str, Callable[[Workspace], None], Workspace], Workspace]


def samples(ws: Workspace, folder: str = "calib", n: int = 6, seed: int = 0, **feed: Any) -> None:
    """``n`` random .npz samples of the corpus CNN's input (``feed`` replaces arrays)."""
    rng = np.random.default_rng(seed)
    (ws.root / folder).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        arrays = {"image": rng.standard_normal((1, 3, 32, 32), dtype=np.float32)}
        arrays.update(feed)
        np.savez(ws.root / folder / f"s{i:02d}.npz", **arrays)


def manifest(ws: Workspace, recipe: dict[str, Any] | None = None, **group: Any) -> None:
    recipe = {"calibration": "calib/*.npz", "activations": "uint16", "weights": "uint8",
              **(recipe or {})}  # fmt: skip
    text = render_manifest(
        {
            "providers": {"htp-v73": HTP73, "htp-v79": HTP79},
            "groups": {
                "vision": {"models": ["models/*.onnx"], "providers": ["htp-v73", "htp-v79"],
                           "quantize": "w8a16", **group},
            },
        }
    )  # fmt: skip
    lines = [f"{k} = {json.dumps(v)}" for k, v in recipe.items() if not isinstance(v, dict)]
    lines += [
        f"{k} = {{ {', '.join(f'{json.dumps(a)} = {json.dumps(b)}' for a, b in v.items())} }}"
        for k, v in recipe.items()
        if isinstance(v, dict)
    ]
    (ws.root / "epbuild.toml").write_text(
        text + "\n[quantization.w8a16]\n" + "\n".join(lines) + "\n"
    )


@pytest.fixture
def qws(workspace: Workspace) -> Workspace:
    """The corpus CNN in a quantized group for HTP v73 and v79, with six samples."""
    return _write_qws(workspace)


def _write_qws(workspace: Workspace) -> Workspace:
    (workspace.root / "models").mkdir(parents=True)
    shutil.copy(CORPUS / "cnn_torchscript.onnx", workspace.root / "models" / "cnn.onnx")
    samples(workspace)
    manifest(workspace)
    return workspace


def _build_qws(ws: Workspace) -> None:
    counts(_write_qws(ws))


@pytest.fixture
def qws_built(built_once: BuiltOnce, workspace: Workspace) -> Workspace:
    """``qws`` built (one calibrate, one quantize, two compiles): the test's own copy of a
    build made once per session."""
    return built_once("quantize", _build_qws, workspace)


def counts(ws: Workspace) -> dict[str, int]:
    doc = ws.main_json("build")
    assert doc["ok"], doc
    found: dict[str, int] = {}
    for action in doc["actions"]:
        outcome = action["outcome"]
        word = {"calibrate": "calibrated", "quantize": "quantized"}.get(action["kind"], outcome)
        key = word if outcome == "compiled" else outcome
        found[key] = found.get(key, 0) + 1
    return found


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in ("build", ".epbuild/quant")
        for p in sorted((root / folder).rglob("*"))
        if p.is_file() and ".staging" not in p.parts
    }


def test_one_calibrate_one_quantize_two_compiles(qws: Workspace) -> None:
    assert counts(qws) == {"calibrated": 1, "quantized": 1, "compiled": 2}
    qdq = onnx.load(qws.root / "build/vision/quantized/cnn.onnx")
    assert {n.op_type for n in qdq.graph.node} >= set(QDQ)
    for target in ("htp-v73", "htp-v79"):
        ctx = onnx.load(qws.root / f"build/vision/{target}/cnn_ctx.onnx")
        assert [n.op_type for n in ctx.graph.node] == ["EPContext"]  # no Q/DQ outside it
    doc = qws.main_json("status")
    kinds = {a["id"]: (a["kind"], a["deps"]) for a in doc["actions"]}
    assert kinds == {
        "vision/cnn/calibrate": ("calibrate", []),
        "vision/cnn/quantize": ("quantize", ["vision/cnn/calibrate"]),
        "vision/htp-v73/cnn": ("compile", ["vision/cnn/quantize"]),
        "vision/htp-v79/cnn": ("compile", ["vision/cnn/quantize"]),
    }
    assert counts(qws) == {"up_to_date": 4}


def test_edits_run_exactly_the_actions_they_concern(qws_built: Workspace) -> None:
    qws = qws_built  # built once per session (calibrated, quantized, compiled), copied
    manifest(qws, {"exclude": ["/8/Gemm"]})  # the head stays float: no calibration
    assert counts(qws) == {"quantized": 1, "compiled": 2, "up_to_date": 1}
    manifest(qws, {"exclude": ["/8/Gemm"], "weights": "int8"})
    assert counts(qws) == {"quantized": 1, "compiled": 2, "up_to_date": 1}
    manifest(qws, {"exclude": ["/8/Gemm"], "weights": "int8", "method": "entropy"})
    found = counts(qws)  # the compiles: only if the entropy ranges make another QDQ model
    assert found["calibrated"] == found["quantized"] == 1, found
    samples(qws, seed=1)  # every sample changes: calibrate again
    assert counts(qws)["calibrated"] == 1
    data = (qws.root / "epbuild.toml").read_text()  # a third target compiles one action
    data = data.replace('"htp-v79"]', '"htp-v79", "htp-v75"]')
    data += '\n[providers.htp-v75]\nep = "qnn"\noptions = { htp_arch = "75", soc_model = "57" }\n'
    (qws.root / "epbuild.toml").write_text(data)
    assert counts(qws) == {"compiled": 1, "up_to_date": 4}


# A whole pipeline from scratch, twice. Fast: early cutoff below a rerun whose outputs are
# the same bytes (test_graph's test_early_cutoff_an_upstream_rerun_with_the_same_bytes_...),
# and a changed calibration that runs only its own actions
# (test_edits_run_exactly_the_actions_they_concern).
@pytest.mark.slow
def test_a_sample_that_changes_nothing_calibrates_and_stops_there(qws: Workspace) -> None:
    samples(qws, n=40)  # more than one chunk of 16: every sample counts
    counts(qws)
    ranges = json.loads((qws.root / ".epbuild/quant/vision/cnn/ranges.json").read_text())
    image = ranges["data"]["image"]
    seen = np.concatenate([np.load(p)["image"].ravel() for p in (qws.root / "calib").glob("*")])
    assert image["lowest"]["data"] == [float(seen.min())]
    assert image["highest"]["data"] == [float(seen.max())]
    shutil.copy(qws.root / "calib/s00.npz", qws.root / "calib/s99.npz")  # same ranges
    assert counts(qws) == {"calibrated": 1, "up_to_date": 3}  # early cutoff


def test_a_clean_rebuild_gives_the_same_bytes(qws_built: Workspace) -> None:
    qws = qws_built  # built once per session (calibrated, quantized, compiled), copied
    first = digests(qws.root)
    shutil.rmtree(qws.root / "build")
    shutil.rmtree(qws.root / ".epbuild")
    assert counts(qws) == {"calibrated": 1, "quantized": 1, "compiled": 2}
    assert digests(qws.root) == first


def test_a_fresh_checkout_restores_every_action(qws_built: Workspace, tmp_path: Path) -> None:
    qws, cache = qws_built, tmp_path / "cache"  # built once per session, copied
    qws.main("build", "--cache", str(cache), check=True)  # stores the up-to-date actions
    clone = Workspace(tmp_path / "clone")
    shutil.copytree(qws.root, clone.root, ignore=shutil.ignore_patterns("build", ".epbuild"))
    doc = clone.main_json("build", "--cache-only", "--cache", str(cache))
    assert doc["ok"] and {a["outcome"] for a in doc["actions"]} == {"restored"}, doc
    assert digests(clone.root) == digests(qws.root)


# A whole pipeline in two processes at once. Fast: two builds at once run each action once
# (test_workspace_moves' test_two_builds_at_once_after_a_move; test_two_at_once.py), whatever
# the kind: the lock and the journal are the engine's, not a kind's.
@pytest.mark.slow
def test_two_builds_at_once_run_each_action_once(qws: Workspace) -> None:
    first, second = together(qws.root, ("build", "--json"), ("build", "--json"))
    assert first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    ran: dict[str, int] = {}
    for proc in (first, second):
        for action in json.loads(proc.stdout)["actions"]:
            if action["outcome"] == "compiled":
                ran[action["id"]] = ran.get(action["id"], 0) + 1
    assert ran == dict.fromkeys(
        ["vision/cnn/calibrate", "vision/cnn/quantize", "vision/htp-v73/cnn", "vision/htp-v79/cnn"],
        1,
    )


def _bad_sample(name: str) -> Callable[[Workspace], None]:
    def write(ws: Workspace) -> None:
        image = np.zeros((1, 3, 32, 32), dtype=np.float32)
        path = ws.root / "calib" / "s03.npz"
        if name == "missing input":
            np.savez(path, other=image)
        elif name == "extra input":
            np.savez(path, image=image, mask=image)
        elif name == "wrong shape":
            np.savez(path, image=np.zeros((1, 3, 16, 16), dtype=np.float32))
        elif name == "wrong dtype":
            np.savez(path, image=image.astype(np.float64))
        elif name == "unreadable":
            path.write_bytes(b"not a zip file at all")
        elif name == "not arrays":
            np.savez(path, image=np.array([{"a": 1}], dtype=object))

    return write


BAD_SAMPLES = [
    ("missing input", "misses input 'image'"),
    ("extra input", "has 'mask', which the model does not take"),
    ("wrong shape", "has shape [1, 3, 16, 16]"),
    ("wrong dtype", "is float64, the model takes float32"),
    ("unreadable", "not a readable .npz file of arrays (not a zip archive)"),
    ("not arrays", "holds object arrays (pickled data)"),
]
"""Each bad sample and what its message says."""
END_TO_END = ("wrong shape", "unreadable")
"""The bad samples the inner loop builds: one the arrays' headers refuse, one the archive's;
the others' messages are checked fast by test_the_reader_names_each_bad_sample."""


@pytest.mark.parametrize(
    ("name", "said"),
    [
        pytest.param(name, said, marks=() if name in END_TO_END else pytest.mark.slow)
        for name, said in BAD_SAMPLES
    ],
)
def test_a_bad_sample_is_named_and_nothing_is_committed(
    qws: Workspace, name: str, said: str
) -> None:
    _bad_sample(name)(qws)
    proc = qws.cli("build")
    assert proc.returncode == 2, proc.stderr
    assert "calib/s03.npz" in proc.stderr and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (qws.root / ".epbuild/quant/vision/cnn").exists()  # nothing half-written
    assert not (qws.root / "build/vision/quantized").exists()


@pytest.mark.parametrize(("name", "said"), BAD_SAMPLES)
def test_the_reader_names_each_bad_sample(qws: Workspace, name: str, said: str) -> None:
    """What the calibration's reader says of each bad sample (the build says it, naming the
    file: test_a_bad_sample_is_named_and_nothing_is_committed)."""
    from epbuild.errors import ModelError
    from epbuild.quant.samples import InputSpec, read_sample

    _bad_sample(name)(qws)
    specs = [InputSpec("image", np.dtype("float32"), (1, 3, 32, 32))]
    with pytest.raises(ModelError) as info:
        read_sample(str(qws.root), "calib/s03.npz", specs)
    assert "calib/s03.npz" in info.value.message and said in info.value.message, info.value


def test_a_wrong_sample_after_a_good_build_keeps_the_good_outputs(qws_built: Workspace) -> None:
    qws = qws_built  # built once per session (calibrated, quantized, compiled), copied
    before = digests(qws.root)
    _bad_sample("wrong shape")(qws)
    assert qws.main("build").returncode == 2
    assert digests(qws.root) == before


@pytest.mark.parametrize(
    ("recipe", "key", "said"),
    [
        ({"calibration": "nothing/*.npz"}, "quantization.w8a16.calibration", "names no samples"),
        ({"calibration": "calib/s00.txt"}, "quantization.w8a16.calibration", "names no samples"),
        ({"activations": "int16"}, "quantization.w8a16.activations", "int16 is not a type"),
        ({"weights": "int4"}, "quantization.w8a16.weights", "need per_channel = true"),
        ({"weights": "uint4", "per_channel": True}, "quantization.w8a16.weights", "uint4 weights"),
        ({"overrides": {"x": "int16"}}, "quantization.w8a16.overrides", "int16 is not a type"),
    ],
)
def test_a_recipe_the_manifest_cannot_take(
    qws: Workspace, recipe: dict[str, Any], key: str, said: str
) -> None:
    (qws.root / "calib/s00.txt").write_text("x")
    manifest(qws, recipe)
    proc = qws.main("status")
    assert proc.returncode == 2
    assert key in proc.stderr and said in proc.stderr, proc.stderr


def test_an_unknown_recipe_is_named(qws: Workspace) -> None:
    manifest(qws, quantize="w4a8")
    proc = qws.main("status")
    assert proc.returncode == 2
    assert "groups.vision.quantize" in proc.stderr and "[quantization.w4a8]" in proc.stderr


@pytest.mark.parametrize(
    ("recipe", "said"),
    [
        ({"exclude": ["/8/Gemmm"]}, "exclude names node '/8/Gemmm'"),
        ({"overrides": {"/8/Gemm_output_1": "uint8"}}, "overrides names tensor"),
    ],
)
def test_a_name_the_model_does_not_have(qws: Workspace, recipe: dict[str, Any], said: str) -> None:
    manifest(qws, recipe)
    proc = qws.main("build")
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and "models/cnn.onnx" in proc.stderr, proc.stderr
    assert "did you mean" in proc.stderr or "names the model has" in proc.stderr


def test_an_already_quantized_model_is_refused(qws: Workspace) -> None:
    shutil.copy(CORPUS / "cnn_qdq.onnx", qws.root / "models" / "cnn.onnx")  # a quantizer's
    proc = qws.main("build")
    assert proc.returncode == 2, proc.stderr
    assert "models/cnn.onnx: already quantized" in proc.stderr, proc.stderr


def test_an_old_opset_model_is_explained(workspace: Workspace) -> None:
    """The onnx package's squeezenet (opset 9, weights as graph inputs): ONNX's version
    converter cannot raise it to the opset 16-bit types need."""
    root = Path(__file__).parents[1]
    (workspace.root / "models").mkdir(parents=True)
    shutil.copy(root / "examples/multi-vendor/models/squeezenet.onnx", workspace.root / "models")
    model = onnx.load(workspace.root / "models/squeezenet.onnx")
    inits = {i.name for i in model.graph.initializer}
    (name,) = [i.name for i in model.graph.input if i.name not in inits]
    (workspace.root / "calib").mkdir()
    image = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    np.savez(workspace.root / "calib/s0.npz", **{name: image})
    manifest(workspace)
    proc = workspace.cli("build")
    assert proc.returncode == 2, proc.stderr
    assert "models/squeezenet.onnx" in proc.stderr and "opset" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def numerics(ws: Workspace) -> tuple[int, list[dict[str, Any]]]:
    proc = ws.cli("verify", "--numerics", "--json")
    return proc.returncode, json.loads(proc.stdout)["numerics"]


def test_numerics_compare_with_the_float_source(qws_built: Workspace) -> None:
    qws = qws_built  # built once per session, copied: the build below only re-hashes
    samples(qws, "val", n=4, seed=9)
    manifest(qws, {"validation": "val/*.npz", "check": {"min_sqnr_db": 20, "top1": 0.75}})
    counts(qws)
    code, checks = numerics(qws)
    assert code == 0, checks
    assert {c["model"] for c in checks} == {
        "build/vision/htp-v73/cnn_ctx.onnx",
        "build/vision/htp-v79/cnn_ctx.onnx",
    }
    for check in checks:
        assert check["status"] == "ok", check
        (out,) = check["outputs"]
        assert out["sqnr_db"] >= 20 and out["top1"] >= 0.75, out
        assert out["qdq_sqnr_db"] >= 20  # the QDQ model on the CPU, beside it
        assert check["tolerance"] == {"min_sqnr_db": 20, "top1": 0.75}
    # A stricter limit re-judges the recorded figures: nothing runs again.
    manifest(qws, {"validation": "val/*.npz", "check": {"min_sqnr_db": 200}})
    code, checks = numerics(qws)
    assert code == 1 and all(c["cached"] and c["status"] == "failed" for c in checks)
    assert "SQNR" in checks[0]["reason"] and "allowed ≥ 200 dB" in checks[0]["reason"]


def test_numerics_fail_on_all_zero_calibration_naming_layers(qws: Workspace) -> None:
    samples(qws, "zero", n=3, image=np.zeros((1, 3, 32, 32), dtype=np.float32))
    samples(qws, "val", n=4, seed=9)
    manifest(qws, {"calibration": "zero/*.npz", "validation": "val/*.npz"})
    counts(qws)
    code, checks = numerics(qws)
    assert code == 1
    for check in checks:
        assert check["status"] == "failed"
        assert "so it is the quantization" in check["reason"], check["reason"]
        assert "the layers with the worst SQNR: " in check["reason"]
        assert check["layers"] and all(db < 20 for _, db in check["layers"][:3])


def test_add_quantization_and_add_model_quantize(workspace: Workspace) -> None:
    (workspace.root / "models").mkdir(parents=True)
    shutil.copy(CORPUS / "cnn_torchscript.onnx", workspace.root / "models" / "cnn.onnx")
    samples(workspace)
    workspace.manifest({"providers": {"htp-v73": HTP73}})
    before = (workspace.root / "epbuild.toml").read_bytes()
    proc = workspace.main("add", "model", "models/cnn.onnx", "-g", "vision", "--quantize", "w8a16")
    assert proc.returncode == 2 and "[quantization.w8a16]" in proc.stderr, proc.stderr
    assert (workspace.root / "epbuild.toml").read_bytes() == before  # refused: untouched
    proc = workspace.main("add", "quantization", "w8a16")
    assert proc.returncode == 2 and "--calibration" in proc.stderr
    workspace.main("add", "quantization", "w8a16", "--calibration", "calib/*.npz",
                  "--activations", "uint16", check=True)  # fmt: skip
    workspace.main("add", "model", "models/cnn.onnx", "-g", "vision", "--quantize", "w8a16",
                  check=True)  # fmt: skip
    proc = workspace.main("add", "quantization", "w8a16", "--exclude", "/8/Gemm", check=True)
    assert "keeps /8/Gemm in float" in proc.stdout
    proc = workspace.main("add", "quantization", "w8a16", "--activations", "int16")
    assert proc.returncode == 2 and "int16 is not a type" in proc.stderr  # htp-v73 can't
    assert counts(workspace) == {"calibrated": 1, "quantized": 1, "compiled": 1}
    detail = workspace.main("status", "--detail", check=True).stdout
    assert "build/vision/quantized/cnn.onnx: 1 EPContext node(s)" in detail
    assert "(the QDQ model of models/cnn.onnx)" in detail


def test_the_report_plots_sqnr_per_layer(qws_built: Workspace, tmp_path: Path) -> None:
    qws = qws_built  # built once per session (calibrated, quantized, compiled), copied
    assert numerics(qws)[0] == 0
    page = tmp_path / "report.html"
    qws.main("report", "-o", str(page), check=True)
    text = page.read_text()
    assert text.count("SQNR per layer against the float model") == 2
    assert 'class="layers"' in text and " dB</text>" in text


def test_progress_a_job_writes_reaches_the_reporter(tmp_path: Path) -> None:
    import io
    import threading

    import waits

    from epbuild.engine.progress import watching
    from epbuild.frontends.progress import ConsoleReporter

    path = tmp_path / ".progress"
    heard: list[str] = []
    seen = threading.Event()

    def said(text: str) -> None:
        heard.append(text)
        seen.set()

    with watching(str(path), said):
        path.write_text("3/8 samples")
        waits.wait_for(seen.is_set, "the progress to be read")
    assert heard == ["3/8 samples"]
    out = io.StringIO()  # not a terminal: a line at each quarter of the way, no more
    reporter = ConsoleReporter(out)
    for done in range(1, 9):
        reporter.action_progress("g/m/calibrate", f"calibrating g/m/calibrate: {done}/8 samples")
    assert out.getvalue().splitlines() == [
        f"calibrating g/m/calibrate: {n}/8 samples" for n in (2, 4, 6, 8)
    ]


# A whole pipeline (1,500 samples, then a full build). Fast: nothing of a calibration that
# fails is committed (test_a_bad_sample_is_named_and_nothing_is_committed), Ctrl-C during a
# compile cleans up (test_crash.py), a job's progress reaches the reporter (above).
@pytest.mark.slow
def test_ctrl_c_during_calibration_leaves_nothing_half_written(qws: Workspace) -> None:
    import signal
    import subprocess
    import sys

    import waits

    samples(qws, n=1500)  # long enough to be interrupted once it says how far it is
    proc = subprocess.Popen(
        [sys.executable, "-m", "epbuild", "-C", str(qws.root), "build"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    waits.wait_for(
        lambda: list((qws.root / "build" / ".staging").glob("*/.progress")),
        "the calibration to report progress",
        proc=proc,
    )
    proc.send_signal(signal.SIGINT)
    _, err = waits.communicate(proc, "the build to exit after SIGINT")
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert not (qws.root / ".epbuild/quant/vision/cnn").exists()
    assert not list((qws.root / "build" / ".staging").glob("*"))
    doc = qws.cli_json("status")
    assert all(a["stale"] for a in doc["actions"])
    assert counts(qws) == {"calibrated": 1, "quantized": 1, "compiled": 2}


def test_a_shared_group_is_keyed_alike_before_and_after_a_build(
    qws: Workspace, tmp_path: Path
) -> None:
    """``cache key`` keys each compile by the keys of the quantizations it reads while
    their QDQ models are not there: a fresh checkout and a built workspace agree."""
    shutil.copy(qws.root / "models/cnn.onnx", qws.root / "models/cnn2.onnx")
    manifest(qws, share_weights=True)
    fresh = qws.main("cache", "key", check=True).stdout
    counts(qws)
    assert qws.main("cache", "key", check=True).stdout == fresh
    (qws.root / "calib/s00.npz").unlink()  # another calibration: every key changes
    assert qws.main("cache", "key", check=True).stdout != fresh


def test_npy_samples_and_onnx_test_data_folders(qws_built: Workspace) -> None:
    """The other sample forms: ``.npy`` for a single-input model, and the ONNX model zoo's
    test-data folders (``test_data_set_N/input_0.pb``), named by their folder; the same
    arrays calibrate to the same ranges whatever form they come in."""
    from onnx import numpy_helper

    qws = qws_built  # built once per session (calibrated, quantized, compiled), copied
    ranges = (qws.root / ".epbuild/quant/vision/cnn/ranges.json").read_bytes()
    arrays = [np.load(p)["image"] for p in sorted((qws.root / "calib").glob("*.npz"))]
    (qws.root / "npy").mkdir()
    for i, a in enumerate(arrays):
        np.save(qws.root / "npy" / f"s{i:02d}.npy", a)
        folder = qws.root / "zoo" / f"test_data_set_{i}"
        folder.mkdir(parents=True)
        tensor = numpy_helper.from_array(a, "image")
        (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
    for calibration in ("npy/*.npy", "zoo"):
        manifest(qws, {"calibration": calibration})
        assert counts(qws) == {"calibrated": 1, "up_to_date": 3}, calibration
        assert (qws.root / ".epbuild/quant/vision/cnn/ranges.json").read_bytes() == ranges
    (qws.root / "zoo/test_data_set_0/input_0.pb").write_bytes(b"\x08garbage")
    proc = qws.main("build")
    assert proc.returncode == 2 and "zoo/test_data_set_0/input_0.pb" in proc.stderr, proc.stderr


def test_status_detail_calls_a_compile_stale_while_its_quantization_is(
    qws_built: Workspace,
) -> None:
    qws = qws_built  # built once per session (calibrated, quantized, compiled), copied
    manifest(qws, {"exclude": ["/8/Gemm"]})  # not built: the QDQ model is the old one
    detail = qws.main("status", "--detail", check=True).stdout
    assert "vision/htp-v73/cnn  (stale;" in detail, detail
    ranges = qws.root / ".epbuild/quant/vision/cnn/ranges.json"
    assert ranges.stat().st_mode & 0o044 == 0o044  # readable like every output


def said_and_done(ws: Workspace, cache: Path) -> tuple[dict[str, str], dict[str, str]]:
    """What ``status`` says the build will do with each stale action (restore it from
    ``cache``, run it, find it up to date, or not known yet), and what the build then did."""
    said: dict[str, str] = {}
    for action in ws.main_json("status", "--cache", str(cache))["actions"]:
        last = action["reasons"][-1] if action["stale"] else "up to date"
        for start, word in (
            ("in the cache (", "restored"),
            ("not in the cache", "compiled"),
            ("up to date", "up_to_date"),
            ("whether the cache", "unknown"),
        ):
            if last.startswith(start):
                said[action["id"]] = word
                break
        else:
            raise AssertionError(f"status says nothing of the cache for {action}")
    doc = ws.main_json("build", "--cache", str(cache))
    assert doc["ok"], doc
    return said, {a["id"]: a["outcome"] for a in doc["actions"]}


def test_status_says_what_the_build_does_with_quantize_actions(
    qws_built: Workspace, tmp_path: Path
) -> None:
    qws, cache = qws_built, tmp_path / "cache"  # built once per session (seed 0), copied
    qws.main("build", "--cache", str(cache), check=True)  # seed 0, stored in the cache
    samples(qws, seed=1)  # calibrates again: its ranges, and so the QDQ model's key, unknown
    said, done = said_and_done(qws, cache)
    assert said["vision/cnn/calibrate"] == done["vision/cnn/calibrate"] == "compiled"
    for quantized in ("vision/cnn/quantize", "vision/htp-v73/cnn"):
        assert said[quantized] == "unknown" and done[quantized] == "compiled", (said, done)
    samples(qws, seed=2)
    qws.main("build", check=True)  # seed 2 is here, not in the cache (EPBUILD_CACHE=off)
    samples(qws, seed=0)  # back: every action restores, keyed by what the cache restores
    said, done = said_and_done(qws, cache)
    assert said == done and set(done.values()) == {"restored"}, (said, done)
    clone = Workspace(tmp_path / "clone")  # a fresh checkout: nothing built yet
    shutil.copytree(qws.root, clone.root, ignore=shutil.ignore_patterns("build", ".epbuild"))
    said, done = said_and_done(clone, cache)
    assert said == done and set(done.values()) == {"restored"}, (said, done)
    (qws.root / ".epbuild/quant/vision/cnn/ranges.json").unlink()  # the same ranges come back
    said, done = said_and_done(qws, cache)
    assert said == done, (said, done)
    assert done == {
        "vision/cnn/calibrate": "restored",
        "vision/cnn/quantize": "up_to_date",
        "vision/htp-v73/cnn": "up_to_date",
        "vision/htp-v79/cnn": "up_to_date",
    }


def test_every_manifest_type_and_method_names_an_ort_member() -> None:
    """The manifest spells ONNX Runtime's names lower-case (``QuantType``'s without the Q)."""
    from onnxruntime.quantization import CalibrationMethod

    from epbuild._names import ACTIVATION_TYPES, CALIBRATION_METHODS, WEIGHT_TYPES
    from epbuild.quant.work import _method, _qtype

    assert [_method(m) for m in CALIBRATION_METHODS] == list(CalibrationMethod)
    assert {_qtype(t).name for t in ACTIVATION_TYPES + WEIGHT_TYPES} == {
        "QUInt8", "QInt8", "QUInt16", "QInt16", "QUInt4", "QInt4"
    }  # fmt: skip


def test_a_restored_calibration_with_external_data_quantizes_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A calibrated model of a GiB or more keeps its weights in external data, and a
    restore makes that file a hard link to the cache's object, which ONNX's loader refuses
    ("potential hardlink attack"): the quantization hands ONNX Runtime's quantizer a copy."""
    import os

    from epbuild.executors.job import Job
    from epbuild.quant import work

    root = tmp_path
    shutil.copy(CORPUS / "cnn_torchscript.onnx", root / "cnn.onnx")
    rng = np.random.default_rng(0)
    for i in range(2):
        np.savez(root / f"s{i}.npz", image=rng.standard_normal((1, 3, 32, 32), dtype=np.float32))
    monkeypatch.setattr(work, "_LARGE", 0)  # its weights in external data, as a large model's
    calibrate = {"model": "cnn.onnx", "samples": ["s0.npz", "s1.npz"], "method": "minmax",
                 "flavour": "qnn"}  # fmt: skip
    (root / "cal").mkdir()
    work.calibrate(Job("v/cnn/calibrate", "", "cal", calibrate), str(root))
    data = root / "cal" / (work.MODEL + ".data")
    assert data.is_file()
    os.link(data, root / "object")  # as a restore leaves it: linked to the cache's object
    settings = {"method": "minmax", "activations": "uint16", "weights": "uint8",
                "per_channel": False, "exclude": [], "overrides": {}}  # fmt: skip
    payload = {"calibrated": f"cal/{work.MODEL}", "label": "vision/cnn (w8a16)",
               "flavour": "qnn", **settings, "output": "cnn.qdq.onnx"}  # fmt: skip
    (root / "q").mkdir()
    result = work.quantize(Job("v/cnn/quantize", "", "q", payload), str(root))
    assert result["detail"]["qdq_nodes"] > 0
    assert sorted(p.name for p in (root / "q").iterdir()) == ["cnn.qdq.onnx", "cnn.qdq.onnx.data"]
    # and verify --numerics compares the two, restored as they are, layer by layer
    from epbuild.inspection.quantcheck import LayerErrors

    os.link(root / "q" / "cnn.qdq.onnx.data", root / "object2")
    layers = LayerErrors(
        str(root / "cal" / work.MODEL), str(root / "q" / "cnn.qdq.onnx"), str(root)
    )
    layers.add(dict(np.load(root / "s0.npz")))
    assert layers.worst()


def test_a_source_whose_data_file_is_a_hard_link_calibrates(workspace: Workspace) -> None:
    """A model kept in a hard-linking store (DVC's ``hardlink`` cache), its weights in
    external data: ONNX's own loader refuses the data file, ONNX Runtime does not; the
    calibration reads it as ONNX Runtime does and preprocesses a kernel copy."""
    import os

    ws = _write_qws(workspace)
    model = ws.root / "models" / "cnn.onnx"
    onnx.save(onnx.load(model), model, save_as_external_data=True, location="cnn.onnx.data",
              size_threshold=0)  # fmt: skip
    os.link(ws.root / "models" / "cnn.onnx.data", ws.root / "store-object")
    proc = ws.main("build", "--json", "vision/cnn/calibrate", "vision/cnn/quantize")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert summary["calibrated"] == 1 and summary["quantized"] == 1
