"""``epbuild package``: built outputs as an ONNX Runtime model package, opened by ONNX Runtime's
own ``ModelPackageContext`` (in a subprocess: a QNN session or selection can crash the process
that holds it), written atomically and incrementally, byte-reproducible across paths."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import waits
from conftest import HTP73, HTP75, Workspace, render_manifest
from modelgen import matmul_model

from epbuild.errors import OutOfDateError, StorageError, UnsafePathError, VerificationError
from epbuild.shipping.contents import DEPLOY_NAME
from epbuild.shipping.opening import open_package
from epbuild.shipping.package import package

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Runs in a fresh process: select components with ONNX Runtime's ModelPackageContext, the
# QNN EP attached with the options given; run those given an input; print one JSON line.
# One ModelPackageOptions per process: with onnxruntime 1.32 and the QNN plugin EP, a second
# one makes select_component crash (SIGSEGV), as does a selection after a QNN session existed.
PROBE = r"""
import json, os, sys
import numpy as np, onnxruntime as ort, onnxruntime_qnn
root, options, requests = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
ort.register_execution_provider_library("qnn", onnxruntime_qnn.get_library_path())
so = ort.SessionOptions()
so.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "qnn"], options)
mpo = ort.ModelPackageOptions(so)
ctx = ort.ModelPackageContext(root)
out = {"components": ctx.get_component_names(), "selected": {}, "outputs": {}}
chosen = {}
for component in requests:
    chosen[component] = ctx.select_component(component, mpo)
    folder = os.path.relpath(chosen[component].get_selected_variant_folder_path(), root)
    out["selected"][component] = [chosen[component].get_selected_variant_name(), folder]
for component, x in requests.items():
    if x is not None:
        sess = chosen[component].create_session()
        y = sess.run(None, {"x": np.asarray(x, dtype=np.float32)})[0]
        out["outputs"][component] = [y.tolist(), sess.get_providers()]
print(json.dumps(out), flush=True)
os._exit(0)
"""

QNN73 = {"backend_type": "htp", **HTP73["options"]}


def probe(root: Path, options: dict[str, str], requests: dict[str, Any]) -> dict[str, Any]:
    """Ask ONNX Runtime, in a subprocess, to select components of a package (and run those
    whose input is given)."""
    args = [sys.executable, "-c", PROBE, str(root), json.dumps(options), json.dumps(requests)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=waits.scaled(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def cpu(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]  # type: ignore[no-any-return]


def rel_error(got: Any, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative POSIX path → bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def built(simple_ws: Any) -> Workspace:
    """The sharing pair + single model, built."""
    ws: Workspace = simple_ws()
    assert ws.build().ok
    return ws


def test_quickstart_package_opens_and_runs_in_onnxruntime(tmp_path: Path) -> None:
    root = tmp_path / "quickstart"
    shutil.copytree(EXAMPLES / "quickstart", root,
                    ignore=shutil.ignore_patterns("build", ".epbuild", "dist"))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(root), "package", "-o", "dist/", "--build"],
        capture_output=True, text=True, timeout=waits.scaled(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    dist = root / "dist"
    x = np.random.default_rng(3).standard_normal((1, 32), dtype=np.float32)
    got = probe(dist, QNN73, {"vision/classifier": x.tolist(), "llm/prefill": None,
                              "llm/decode": None})  # fmt: skip
    assert got["components"] == ["llm/prefill", "llm/decode", "vision/classifier"]
    assert got["selected"]["llm/decode"] == ["htp-v73", "llm/htp-v73"]
    y, providers = got["outputs"]["vision/classifier"]
    assert providers[0] == "qnn"
    assert rel_error(y, cpu(root / "models" / "classifier.onnx", x)) < 2e-2
    example = EXAMPLES / "shipping" / "run_package.py"
    ran = subprocess.run([sys.executable, str(example), str(dist)], capture_output=True,
                         text=True, timeout=waits.scaled(300))  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "vision/classifier: variant htp-v73" in ran.stdout and "output [1, 10]" in ran.stdout
    # The sharing group's members name one directory: its shared binary is stored once.
    assert sorted(p.name for p in (dist / "llm" / "htp-v73").iterdir()) == [
        "decode_ctx.onnx", "prefill_ctx.onnx", "prefill_ctx_qnn.bin"]  # fmt: skip


def test_onnxruntime_strict_parser_accepts_the_manifest(built: Workspace) -> None:
    import onnxruntime as ort

    package(built.root, out="dist")
    info = ort.ModelPackage.open(str(built.root / "dist"), strict_unknown_fields=True).get_info()
    variants = {c["name"]: [v["name"] for v in c["variants"]] for c in info["components"]}
    assert variants == {"pair/a": ["htp"], "pair/b": ["htp"], "single/c": ["htp"]}
    assert info["layout"] == "portable"


def test_stale_action_exits_1_naming_it_and_build_fixes_it(built: Workspace) -> None:
    built.model("models/c.onnx", matmul_model(99))
    proc = built.cli("package", "-o", "dist")
    assert proc.returncode == 1, proc.stderr
    assert "single/htp/c (model models/c.onnx changed)" in proc.stderr
    assert "epbuild package --build" in proc.stderr and "Traceback" not in proc.stderr
    assert not (built.root / "dist").exists()
    with pytest.raises(OutOfDateError, match="single/htp/c"):
        package(built.root, out="dist")
    proc = built.cli("package", "-o", "dist", "--build")
    assert proc.returncode == 0, proc.stderr
    assert "packaged 3 component(s)" in proc.stdout
    assert (built.root / "dist" / "single" / "htp" / "c_ctx.onnx").is_file()


def test_unchanged_files_keep_their_inodes(built: Workspace) -> None:
    first = package(built.root, out="dist")
    dist = built.root / "dist"
    inodes = {p: (dist / p).stat().st_ino for p in first.deployment["files"]}
    out = built.root / "build" / "pair" / "htp" / "a_ctx.onnx"
    assert os.path.samefile(dist / "pair" / "htp" / "a_ctx.onnx", out)  # linked from outputs
    again = package(built.root, out="dist")
    assert again.stats.unchanged
    assert {p: (dist / p).stat().st_ino for p in inodes} == inodes
    built.model("models/c.onnx", matmul_model(99))  # one action changes
    third = package(built.root, out="dist", build=True)
    assert not third.stats.unchanged
    now = {p: (dist / p).stat().st_ino for p in third.deployment["files"]}
    same = {p for p, e in third.deployment["files"].items()
            if first.deployment["files"][p] == e and p != "manifest.json"}  # fmt: skip
    assert {"pair/htp/a_ctx.onnx", "pair/htp/b_ctx.onnx", "pair/htp/a_ctx_qnn.bin"} <= same
    assert "single/htp/c_ctx_qnn.bin" not in same  # new weights, new context binary
    assert {p for p in same if now[p] == inodes[p]} == same  # every unchanged file kept
    assert sorted(third.stats.kept) == sorted(same)
    assert third.stats.linked == ["single/htp/c_ctx_qnn.bin"]
    assert now["single/htp/c_ctx_qnn.bin"] != inodes["single/htp/c_ctx_qnn.bin"]


def test_deployment_manifest_lists_every_file_and_action(built: Workspace) -> None:
    doc = built.cli_json("package", "-o", "dist")
    dist = built.root / "dist"
    deploy = json.loads((dist / DEPLOY_NAME).read_text())
    assert doc["deployment"] == deploy
    on_disk = {k for k in tree(dist) if k != DEPLOY_NAME}
    assert set(deploy["files"]) == on_disk
    for rel, entry in deploy["files"].items():
        data = (dist / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    status = {a["id"]: a["key"] for a in built.cli_json("status")["actions"]}
    actions = {a["id"]: a for a in deploy["actions"]}
    assert {i: a["key"] for i, a in actions.items()} == status
    pair = actions["pair/htp"]
    assert pair["versions"]["onnxruntime"] and pair["versions"]["qnn-sdk"]
    assert pair["target"].startswith("v2:") and pair["provider_options"]["soc_model"] == "60"
    assert pair["compiler"] in ("compile_api", "session") and pair["ep_name"] == "qnn"
    a = pair["models"][0]
    source = (built.root / "models" / "a.onnx").read_bytes()
    assert (
        a["source"] == "models/a.onnx" and a["source_sha256"] == hashlib.sha256(source).hexdigest()
    )
    assert a["context_nodes"] >= 1 and a["cpu_nodes"] == 0 and a["ctx"] == "pair/htp/a_ctx.onnx"
    assert str(built.root).encode() not in b"".join(tree(dist).values())


def test_reproducible_across_workspace_paths(simple_ws: Any, tmp_path: Path) -> None:
    ws: Workspace = simple_ws()
    other = tmp_path / "elsewhere" / "deeper" / "ws2"
    shutil.copytree(ws.root, other)
    for root in (ws.root, other):
        proc = subprocess.run([sys.executable, "-m", "epbuild", "-C", str(root), "package",
                               "-o", "dist", "--build"], capture_output=True, text=True,
                              timeout=waits.scaled(300))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    assert tree(ws.root / "dist") == tree(other / "dist")


def test_refuses_unsafe_destinations(built: Workspace, tmp_path: Path) -> None:
    mine = built.root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = built.cli("package", "-o", "mine")
    assert proc.returncode == 2 and "is not an epbuild package" in proc.stderr, proc.stderr
    assert (mine / "notes.txt").read_text() == "keep me"
    (mine / DEPLOY_NAME).write_text("not json")
    with pytest.raises(UnsafePathError, match="not an epbuild package"):
        package(built.root, out="mine")
    assert (mine / "notes.txt").read_text() == "keep me"
    for out, message in (("build/pkg", "inside the output directory"),
                         (".epbuild/pkg", "inside the state directory"),
                         ("..", "holds the workspace")):  # fmt: skip
        with pytest.raises(UnsafePathError, match=message):
            package(built.root, out=out)
    (built.root / "afile").write_text("x")
    with pytest.raises(UnsafePathError, match="not a directory"):
        package(built.root, out="afile")
    (tmp_path / "elsewhere").mkdir()
    (built.root / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePathError, match="symlink"):
        package(built.root, out="link")
    (built.root / "empty").mkdir()
    assert package(built.root, out="empty").stats.linked  # an empty directory is fine


def test_failed_swap_leaves_the_old_package(built: Workspace, monkeypatch: Any) -> None:
    from epbuild.shipping import writer

    package(built.root, out="dist")
    before = tree(built.root / "dist")
    built.model("models/c.onnx", matmul_model(99))
    assert built.build().ok

    def broken(new: str, dest: str) -> None:
        raise OSError(28, "No space left on device", dest)

    monkeypatch.setattr(writer, "_swap", broken)
    with pytest.raises(StorageError, match="the old package is unchanged"):
        package(built.root, out="dist")
    assert tree(built.root / "dist") == before
    assert not [p.name for p in built.root.iterdir() if ".dist.epbuild-" in p.name]


def test_package_table_sets_directory_and_labels(built: Workspace) -> None:
    text = (built.root / "epbuild.toml").read_text()
    built.manifest(text + '\n[package]\nout_dir = "ship"\nname = "demo"\nversion = "1.2"\n')
    proc = built.cli("package")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((built.root / "ship" / "manifest.json").read_text())
    assert (manifest["package_name"], manifest["package_version"]) == ("demo", "1.2")
    built.manifest(text + '\n[package]\ndevices = { nope = "npu" }\n')
    proc = built.cli("package", "-o", "dist")
    assert proc.returncode == 2
    assert "epbuild.toml:" in proc.stderr and "package.devices.nope" in proc.stderr
    assert "no provider named 'nope'" in proc.stderr


def test_open_package_runs_and_checks_digests(built: Workspace, tmp_path: Path) -> None:
    package(built.root, out="dist")
    shipped = tmp_path / "device" / "pkg"  # as a deployment would: a copy, elsewhere
    shutil.copytree(built.root / "dist", shipped)
    x = np.random.default_rng(9).standard_normal((1, 32), dtype=np.float32)
    with open_package(shipped, "single", check="hash") as opened:
        assert opened.names == ["c"]
        assert rel_error(opened.run("c", {"x": x})[0], cpu(built.root / "models/c.onnx", x)) < 2e-2
    binary = shipped / "single" / "htp" / "c_ctx_qnn.bin"
    data = bytearray(binary.read_bytes())
    data[len(data) // 2] ^= 0x01
    binary.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match=r"single/htp/c_ctx_qnn.bin is damaged \(sha256"):
        open_package(shipped, "single", check="hash")
    binary.write_bytes(bytes(data[:-1]))
    with pytest.raises(VerificationError, match=r"is damaged \(size"):
        open_package(shipped, "single")  # sizes are checked on every open


def test_two_providers_onnxruntime_selects_the_right_variant(workspace: Workspace) -> None:
    workspace.model("m/c.onnx", matmul_model(4))

    def make(order: list[str], devices: str = "") -> dict[str, Any]:
        text = render_manifest(
            {
                "providers": {"v73": HTP73, "v75": HTP75},
                "groups": {"g": {"models": ["m/c.onnx"], "providers": order}},
            }
        )
        # compatibility_strings: the QNN EP crashes judging them on x86_64 (see the docs)
        workspace.manifest(text + f"[package]\ncompatibility_strings = false\n{devices}")
        assert package(workspace.root, out="dist", build=True)
        return probe(workspace.root / "dist", QNN73, {"g/c": None})  # fmt: skip

    # The QNN EP does not judge compatibility on x86_64, so both variants tie and ONNX
    # Runtime takes the first declared: the group's provider order is the preference order.
    assert make(["v73", "v75"])["selected"]["g/c"] == ["v73", "g/v73"]
    assert make(["v75", "v73"])["selected"]["g/c"] == ["v75", "g/v75"]
    # A device constraint ONNX Runtime checks against the EP's devices: the QNN EP lists a
    # CPU-typed device here (no NPU), so a variant that requires an NPU is passed over.
    assert make(["v75", "v73"], 'devices = { v75 = "npu" }\n')["selected"]["g/c"] == [
        "v73", "g/v73"]  # fmt: skip
    manifest = json.loads((workspace.root / "dist" / "manifest.json").read_text())
    assert manifest["components"]["g/c"]["variants"]["v75"]["device"] == "npu"
    assert "device" not in manifest["components"]["g/c"]["variants"]["v73"]
    assert "compatibility_string" not in manifest["components"]["g/c"]["variants"]["v73"]


def test_variants_carry_compatibility_strings_by_default(built: Workspace) -> None:
    package(built.root, out="dist")
    manifest = json.loads((built.root / "dist" / "manifest.json").read_text())
    variant = manifest["components"]["pair/b"]["variants"]["htp"]
    assert variant["compatibility_string"].startswith("v2:") and variant["ep"] == "qnn"
    assert variant["variant_directory"] == "pair/htp"
    assert variant["executor_info"]["ort"] == {
        "model_file": "b_ctx.onnx",
        "session_options": {"ep.share_ep_contexts": "1"},
        "provider_options": {"backend_type": "htp", "htp_arch": "73", "soc_model": "60"},
    }


def test_package_command_imports_no_onnxruntime(built: Workspace) -> None:
    code = (
        "import sys; from epbuild.frontends.cli import main\n"
        f"rc = main(['-C', {str(built.root)!r}, 'package', '-o', 'dist'])\n"
        "print(rc, 'onnxruntime' in sys.modules, 'onnx' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=waits.scaled(120))  # fmt: skip
    assert proc.stdout.split()[-3:] == ["0", "False", "False"], proc.stderr


OPEN = r"""
import json, os, sys
import numpy as np
from epbuild.shipping.opening import open_package, read_deployment, select_variant
root, group = sys.argv[1], sys.argv[2]
if sys.argv[3] == "select":
    actions = [a for a in read_deployment(root)["actions"] if a["group"] == group]
    print(json.dumps(select_variant(root, actions)), flush=True)
else:
    with open_package(root, group) as opened:
        y = opened.run(opened.names[0], {"x": np.ones((1, 32), np.float32)})[0]
    print(json.dumps(y.shape), flush=True)
os._exit(0)
"""


def test_open_package_lets_onnxruntime_choose_the_provider(workspace: Workspace) -> None:
    workspace.model("m/c.onnx", matmul_model(4))
    text = render_manifest(
        {
            "providers": {"v73": HTP73, "v75": HTP75},
            "groups": {"g": {"models": ["m/c.onnx"], "providers": ["v75", "v73"]}},
        }
    )
    workspace.manifest(text + "[package]\ncompatibility_strings = false\n")  # fmt: skip
    package(workspace.root, out="dist", build=True)

    def run(mode: str) -> Any:
        args = [sys.executable, "-c", OPEN, str(workspace.root / "dist"), "g", mode]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=waits.scaled(300))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert run("select") == "v75"  # the group's first provider, as ONNX Runtime selects it
    assert run("open") == [1, 32]


def test_open_package_refuses_a_sharing_group_here(built: Workspace) -> None:
    from epbuild.errors import CompatibilityError

    package(built.root, out="dist")
    with pytest.raises(CompatibilityError, match="weight-shared QNN contexts cannot be loaded"):
        open_package(built.root / "dist", "pair")
    with pytest.raises(Exception, match="no group 'nope'"):
        open_package(built.root / "dist", "nope")


def test_output_replaced_while_packaging_keeps_the_old_package(
    built: Workspace, monkeypatch: Any
) -> None:
    from epbuild.shipping import writer

    package(built.root, out="dist")
    before = tree(built.root / "dist")
    built.model("models/c.onnx", matmul_model(99))
    assert built.build().ok
    assemble = writer._assemble

    def then_a_build_commits(*args: Any) -> Any:
        stats = assemble(*args)
        out = built.root / "build" / "single" / "htp" / "c_ctx_qnn.bin"
        shutil.copyfile(out, out.with_suffix(".new"))
        os.replace(out.with_suffix(".new"), out)  # a commit renames new files into place
        return stats

    monkeypatch.setattr(writer, "_assemble", then_a_build_commits)
    with pytest.raises(VerificationError, match=r"single/htp/c_ctx_qnn.bin was replaced"):
        package(built.root, out="dist")
    assert tree(built.root / "dist") == before


def test_adapters_declare_their_variants_ep_and_device() -> None:
    from epbuild.providers import get_provider
    from epbuild.providers.base import ProviderConfig

    def target(ep: str, options: dict[str, str], settings: Any = None) -> Any:
        config = ProviderConfig("p", ep, options, {}, settings or {})
        return get_provider(ep).package_target(config)  # type: ignore[attr-defined]

    assert target("qnn", QNN73) == ("qnn", None)
    assert target("openvino", {"device_type": "GPU.1"}) == ("OpenVINOExecutionProvider", "gpu")
    assert target("tensorrt", {}) == ("TensorrtExecutionProvider", "gpu")
    plugin = {"library": "libx.so", "ep_name": "MyEp", "device_type": "npu"}
    assert target("plugin", {}, plugin) == ("MyEp", "npu")
