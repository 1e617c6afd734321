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
# QNN plugin registered as an app does (under the name given: onnxruntime-genai and Windows ML
# use QNNExecutionProvider) and attached with the options given; run those given an input;
# print one JSON line.
# One ModelPackageOptions per process: with onnxruntime 1.32 and the QNN plugin EP, a second
# one makes select_component crash (SIGSEGV), as does a selection after a QNN session existed.
PROBE = r"""
import json, os, sys
import numpy as np, onnxruntime as ort, onnxruntime_qnn
root, options, requests = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
ep = sys.argv[4]  # the name the app registers the plugin as
ort.register_execution_provider_library(ep, onnxruntime_qnn.get_library_path())
so = ort.SessionOptions()
so.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == ep], options)
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


def probe(
    root: Path, options: dict[str, str], requests: dict[str, Any], ep: str = "QNNExecutionProvider"
) -> dict[str, Any]:
    """Ask ONNX Runtime, in a subprocess, to select components of a package (and run those
    whose input is given), the plugin registered as ``ep``."""
    proc = run_probe(root, options, requests, ep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_probe(
    root: Path, options: dict[str, str], requests: dict[str, Any], ep: str
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-c", PROBE, str(root), json.dumps(options), json.dumps(requests), ep]
    return subprocess.run(args, capture_output=True, text=True, timeout=waits.scaled(300))


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
def built(simple_built: Workspace) -> Workspace:
    """The sharing pair + single model, built (a copy of one build per session)."""
    return simple_built


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
    assert providers[0] == "QNNExecutionProvider"
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
    proc = built.main("package", "-o", "dist")
    assert proc.returncode == 1, proc.stderr
    assert "single/htp/c (model models/c.onnx changed)" in proc.stderr
    assert "epbuild package --build" in proc.stderr and "Traceback" not in proc.stderr
    assert not (built.root / "dist").exists()
    with pytest.raises(OutOfDateError, match="single/htp/c"):
        package(built.root, out="dist")
    proc = built.main("package", "-o", "dist", "--build")
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
    doc = built.main_json("package", "-o", "dist")
    dist = built.root / "dist"
    deploy = json.loads((dist / DEPLOY_NAME).read_text())
    assert doc["deployment"] == deploy
    on_disk = {k for k in tree(dist) if k != DEPLOY_NAME}
    assert set(deploy["files"]) == on_disk
    for rel, entry in deploy["files"].items():
        data = (dist / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    status = {a["id"]: a["key"] for a in built.main_json("status")["actions"]}
    actions = {a["id"]: a for a in deploy["actions"]}
    assert {i: a["key"] for i, a in actions.items()} == status
    pair = actions["pair/htp"]
    assert pair["versions"]["onnxruntime"] and pair["versions"]["qnn-sdk"]
    assert pair["target"].startswith("v2:") and pair["provider_options"]["soc_model"] == "60"
    assert (
        pair["compiler"] in ("compile_api", "session") and pair["ep_name"] == "QNNExecutionProvider"
    )
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
        proc = Workspace(root).main("package", "-o", "dist", "--build")
        assert proc.returncode == 0, proc.stderr
    assert tree(ws.root / "dist") == tree(other / "dist")


def test_refuses_unsafe_destinations(built: Workspace, tmp_path: Path) -> None:
    mine = built.root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = built.main("package", "-o", "mine")
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


def test_refuses_a_package_directory_inside_a_cache(
    built: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache's prune deletes what it does not know there: a package inside the configured
    cache, or the per-user one every workspace shares, would lose its files."""
    from epbuild.userdirs import default_cache_dir

    monkeypatch.setenv("EPBUILD_CACHE", str(tmp_path / "shared-cache"))
    for out in (tmp_path / "shared-cache" / "pkg", os.path.join(default_cache_dir(), "pkg")):
        with pytest.raises(UnsafePathError, match="inside the cache directory"):
            package(built.root, out=out)
        assert not os.path.lexists(out)
    monkeypatch.setenv("EPBUILD_CACHE", "off")
    with pytest.raises(UnsafePathError, match="inside the cache directory"):
        package(built.root, out=os.path.join(default_cache_dir(), "v1", "pkg"))


def test_a_refused_destination_gets_no_lock_beside_it(built: Workspace) -> None:
    """A directory of the user's, a file or a symlink refused as the package directory
    leaves nothing beside it (no ``.<name>.epbuild.lock``)."""
    (built.root / "mine").mkdir()
    (built.root / "mine" / "notes.txt").write_text("keep me")
    (built.root / "afile").write_text("x")
    (built.root / "link").symlink_to("mine")
    before = sorted(p.name for p in built.root.iterdir())
    for out in ("mine", "afile", "link"):
        with pytest.raises(UnsafePathError):
            package(built.root, out=out)
    assert sorted(p.name for p in built.root.iterdir()) == before


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
    proc = built.main("package")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((built.root / "ship" / "manifest.json").read_text())
    assert (manifest["package_name"], manifest["package_version"]) == ("demo", "1.2")
    built.manifest(text + '\n[package]\ndevices = { nope = "npu" }\n')
    proc = built.main("package", "-o", "dist")
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
    assert (
        variant["compatibility_string"].startswith("v2:")
        and variant["ep"] == "QNNExecutionProvider"
    )
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

    assert target("qnn", QNN73) == ("QNNExecutionProvider", None)
    assert target("openvino", {"device_type": "GPU.1"}) == ("OpenVINOExecutionProvider", "gpu")
    assert target("tensorrt", {}) == ("TensorrtExecutionProvider", "gpu")
    plugin = {"library": "libx.so", "ep_name": "MyEp", "device_type": "npu"}
    assert target("plugin", {}, plugin) == ("MyEp", "npu")


# Started together: each reads one byte from stdin (the start signal) before it runs the CLI.
RACER = r"""
import os, sys
from epbuild.frontends.cli import main
os.read(0, 1)
sys.exit(main(sys.argv[1:]))
"""


def race(*commands: list[str]) -> list[tuple[int, str, str]]:
    """Run CLI commands in processes that start at one signal; (exit code, stdout, stderr)
    of each."""
    go, signal = os.pipe()
    try:
        procs = [
            subprocess.Popen([sys.executable, "-c", RACER, *args], stdin=go,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in commands
        ]  # fmt: skip
    finally:
        os.close(go)
    os.write(signal, b"x" * len(commands))  # every process imported epbuild: start them
    os.close(signal)
    outs = [p.communicate(timeout=waits.scaled(300)) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outs, strict=True)]


def whole(dist: Path) -> dict[str, Any]:
    """The deployment manifest of ``dist``, after checking that every file it lists is there
    with its recorded size and sha256, and that nothing else is."""
    deploy = json.loads((dist / DEPLOY_NAME).read_text())
    for rel, entry in deploy["files"].items():
        data = (dist / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert set(tree(dist)) == {*deploy["files"], DEPLOY_NAME}
    return deploy  # type: ignore[no-any-return]


@pytest.mark.slow
def test_two_runs_into_one_directory_under_any_spelling_leave_a_whole_package(
    built: Workspace, tmp_path: Path
) -> None:
    """Two ``package`` runs started together into one directory — one through a symlinked
    spelling of the workspace, or from a second workspace — never leave a damaged package,
    and every run that exits 0 wrote what it claims."""
    link = tmp_path / "link"
    link.symlink_to(built.root)
    other = tmp_path / "ws2"
    shutil.copytree(built.root, other, symlinks=True)
    shutil.rmtree(other / ".epbuild")
    shutil.rmtree(other / "build")
    assert subprocess.run([sys.executable, "-m", "epbuild", "-C", str(other), "build"],
                          capture_output=True,
                          timeout=waits.scaled(300)).returncode == 0  # fmt: skip
    dist = built.root / "dist"
    mine = ["-C", str(built.root), "package", "-o", "dist"]
    pairs = [
        (mine, ["-C", str(link), "package", "-o", "dist"]),  # the workspace through a link
        (mine, ["-C", str(other), "package", "-o", str(link / "dist")]),  # another workspace
    ]
    for round_ in range(16):
        if dist.exists():
            shutil.rmtree(dist)
        results = race(*([*args, "--json"] for args in pairs[round_ % 2]))
        final = whole(dist)
        claims = [json.loads(out)["deployment"] for rc, out, _ in results if rc == 0]
        assert [rc for rc, _, _ in results] == [0, 0], results
        assert final in claims  # the last writer's package, whole
        assert not [p.name for p in built.root.iterdir() if p.name.startswith(".dist.epbuild-")]


def test_files_the_package_does_not_list_are_the_users(built: Workspace) -> None:
    package(built.root, out="dist")
    dist = built.root / "dist"
    (dist / "logo.png").write_bytes(b"png")
    (dist / "assets").mkdir()
    (dist / "assets" / "strings.txt").write_text("hello")
    (dist / "empty").mkdir()
    before = tree(dist)
    proc = built.main("package", "-o", "dist")  # even with nothing to update
    assert proc.returncode == 2, proc.stderr
    assert "holds 3 file(s) its epbuild-package.json does not list" in proc.stderr
    assert "assets/, empty/, logo.png" in proc.stderr and "--force" in proc.stderr
    assert "Traceback" not in proc.stderr and tree(dist) == before
    built.model("models/c.onnx", matmul_model(99))
    with pytest.raises(UnsafePathError, match=r"logo\.png"):
        package(built.root, out="dist", build=True)
    assert tree(dist) == before
    proc = built.main("package", "-o", "dist", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "deleted assets/, empty/, logo.png" in proc.stdout
    assert not (dist / "logo.png").exists() and not (dist / "assets").exists()
    whole(dist)


def test_siblings_named_like_temporaries_are_left_unless_their_maker_is_dead(
    built: Workspace,
) -> None:
    package(built.root, out="dist")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(dead.stdout)  # that process has exited: its pid is gone (not reused this fast)
    root = built.root
    users = [root / ".dist.epbuild-notes", root / f".dist.epbuild-new-{os.getpid()}-0123abcd"]
    for d in users:  # a name of the user's, and a live process's temporary
        d.mkdir()
        (d / "keep.txt").write_text("mine")
    stale = root / f".dist.epbuild-new-{pid}-89abcdef"
    stale.mkdir()
    (stale / "half.onnx").write_text("x")
    built.model("models/c.onnx", matmul_model(99))
    package(built.root, out="dist", build=True)
    assert not stale.exists()  # its maker is dead: a half-made package, removed
    assert all((d / "keep.txt").read_text() == "mine" for d in users)
    whole(root / "dist")


def test_waiting_for_another_package_run_says_who_and_honours_lock_timeout(
    built: Workspace,
) -> None:
    from epbuild.shipping.writer import lock_path
    from epbuild.state import locks

    package(built.root, out="dist")
    built.model("models/c.onnx", matmul_model(99))
    assert built.build().ok
    with locks.hold(lock_path(str(built.root / "dist")), "epbuild package into dist"):
        proc = built.cli("package", "-o", "dist", "--lock-timeout", "0.5")
        assert proc.returncode == 3, proc.stderr
        assert f"waiting for epbuild package into dist (pid {os.getpid()})" in proc.stderr
        assert "timed out after 0.5s" in proc.stderr and "Traceback" not in proc.stderr
        waiter = subprocess.Popen(
            [sys.executable, "-m", "epbuild", "-C", str(built.root), "package", "-o", "dist"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert waiter.stderr is not None
        line = waiter.stderr.readline()  # it says whom it waits for, then waits
        assert f"waiting for epbuild package into dist (pid {os.getpid()})" in line
        assert waiter.poll() is None
    out, err = waiter.communicate(timeout=waits.scaled(300))
    assert waiter.returncode == 0, err
    assert "packaged 3 component(s)" in out
    whole(built.root / "dist")


SWAP_CRASH = r"""
import os, sys
real = os.rename
def rename(src, dst, *a, **k):
    if ".epbuild-new-" in os.fspath(src) and not os.path.basename(os.fspath(dst)).startswith("."):
        os._exit(9)  # killed between the two renames
    return real(src, dst, *a, **k)
os.rename = rename
from epbuild.frontends.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_two_rename_fallback_keeps_the_old_package_as_it_says(
    built: Workspace, monkeypatch: Any
) -> None:
    """Where the kernel has no RENAME_EXCHANGE (``EPBUILD_NO_RENAME_EXCHANGE=1`` takes that
    path here): the package is replaced by two renames; a failed second rename puts the old
    package back, as the error says; a run killed between them leaves the old one aside, and
    the next run puts it back before it writes."""
    from epbuild.shipping.writer import NO_EXCHANGE_ENV

    package(built.root, out="dist")
    dist = built.root / "dist"
    built.model("models/c.onnx", matmul_model(99))
    assert built.build().ok
    env = {**os.environ, NO_EXCHANGE_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "epbuild", "-C", str(built.root), "package",
                           "-o", "dist", "--json"], capture_output=True, text=True, env=env,
                          timeout=waits.scaled(300))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert whole(dist) == json.loads(proc.stdout)["deployment"]
    assert not [p.name for p in built.root.iterdir() if p.name.startswith(".dist.epbuild-")]

    before = tree(dist)
    built.model("models/c.onnx", matmul_model(98))
    assert built.build().ok
    monkeypatch.setenv(NO_EXCHANGE_ENV, "1")
    real = os.rename

    def full_disk(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if ".epbuild-new-" in os.fspath(src) and os.fspath(dst) == str(dist):
            raise OSError(28, "No space left on device", os.fspath(dst))
        real(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", full_disk)
    with pytest.raises(StorageError, match="the old package is unchanged"):
        package(built.root, out="dist")
    monkeypatch.setattr(os, "rename", real)
    assert tree(dist) == before  # as the error says
    assert not [p.name for p in built.root.iterdir() if p.name.startswith(".dist.epbuild-")]

    crash = subprocess.run([sys.executable, "-c", SWAP_CRASH, "-C", str(built.root), "package",
                            "-o", "dist"], capture_output=True, text=True, env=env,
                           timeout=waits.scaled(300))  # fmt: skip
    assert crash.returncode == 9, crash.stderr
    assert not dist.exists()  # the old package is aside, under the dead run's name
    aside = [p for p in built.root.iterdir() if p.name.startswith(".dist.epbuild-old-")]
    assert len(aside) == 1 and tree(aside[0]) == before
    again = package(built.root, out="dist")
    assert "pair/htp/a_ctx.onnx" in again.stats.kept  # the old package was put back first
    whole(dist)
    assert not [p.name for p in built.root.iterdir() if p.name.startswith(".dist.epbuild-")]


def test_model_globs_never_pick_up_epbuilds_own_outputs(workspace: Workspace) -> None:
    """A package directory, a copied ctx model and a directory cache inside a folder the
    manifest's glob covers are not models to compile; a plain model named ``*_ctx.onnx`` is."""
    from epbuild.manifest.load import load_manifest

    workspace.model("models/a.onnx", matmul_model(1))
    workspace.model("models/plain_ctx.onnx", matmul_model(2))
    text = render_manifest(
        {"providers": {"htp": HTP73}, "groups": {"g": {"models": ["models/**/*"],
                                                       "providers": ["htp"]}}}
    )  # fmt: skip
    workspace.manifest(text)
    proc = workspace.main("build", "--cache", "models/cache")
    assert proc.returncode == 0, proc.stderr
    assert list((workspace.root / "models" / "cache" / "v1" / "objects").rglob("*"))
    proc = workspace.main("package", "-o", "models/dist")
    assert proc.returncode == 0, proc.stderr
    shutil.copyfile(workspace.root / "build" / "g" / "htp" / "a_ctx.onnx",
                    workspace.root / "models" / "copied_ctx.onnx")  # fmt: skip
    manifest = load_manifest(workspace.root / "epbuild.toml")
    assert [e.path for e in manifest.groups["g"].entries] == [
        "models/a.onnx", "models/plain_ctx.onnx"]  # fmt: skip
    status = workspace.main_json("status")
    assert [(a["id"], a["stale"]) for a in status["actions"]] == [
        ("g/htp/a", False), ("g/htp/plain_ctx", False)]  # fmt: skip


def shippable(workspace: Workspace, extra: str = "") -> Workspace:
    """One model for one HTP target, packaged without compatibility strings (the QNN EP can
    crash judging them on x86_64) plus ``extra`` lines of the [package] table."""
    workspace.model("m/c.onnx", matmul_model(4))
    text = render_manifest(
        {
            "providers": {"htp": HTP73},
            "groups": {"g": {"models": ["m/c.onnx"], "providers": ["htp"]}},
        }
    )
    workspace.manifest(text + "[package]\ncompatibility_strings = false\n" + extra)
    return workspace


def test_apps_registering_the_conventional_name_select_and_run_the_package(
    workspace: Workspace,
) -> None:
    """onnxruntime-genai and Windows ML register the QNN plugin as QNNExecutionProvider:
    a package built with defaults declares that name, and ONNX Runtime selects and runs it."""
    ws = shippable(workspace)
    proc = ws.main("package", "-o", "dist", "--build")
    assert proc.returncode == 0, proc.stderr
    assert "registering the execution provider as QNNExecutionProvider (htp)" in proc.stdout
    dist = ws.root / "dist"
    manifest = json.loads((dist / "manifest.json").read_text())
    assert manifest["components"]["g/c"]["variants"]["htp"]["ep"] == "QNNExecutionProvider"
    assert manifest["additional_metadata"]["epbuild"]["ep_names"] == {"htp": "QNNExecutionProvider"}
    assert whole(dist)["ep_names"] == {"htp": "QNNExecutionProvider"}
    x = np.random.default_rng(5).standard_normal((1, 32), dtype=np.float32)
    got = probe(dist, QNN73, {"g/c": x.tolist()}, ep="QNNExecutionProvider")
    assert got["selected"]["g/c"] == ["htp", "g/htp"]
    y, providers = got["outputs"]["g/c"]
    assert providers[0] == "QNNExecutionProvider"
    assert rel_error(y, cpu(ws.root / "m" / "c.onnx", x)) < 2e-2
    # The compile registered it under that name too: its EPContext nodes say so.
    from epbuild.onnx.proto import read_model

    info = read_model(dist / "g" / "htp" / "c_ctx.onnx")
    assert {n.attributes["source"] for n in info.context_nodes} == {"QNNExecutionProvider"}


def test_ep_names_packages_for_an_app_that_registers_another_name(workspace: Workspace) -> None:
    ws = shippable(workspace, 'ep_names = { htp = "qnn" }\n')
    proc = ws.main("package", "-o", "dist", "--build")
    assert proc.returncode == 0, proc.stderr
    assert "registering the execution provider as qnn (htp)" in proc.stdout
    dist = ws.root / "dist"
    deploy = whole(dist)
    assert deploy["ep_names"] == {"htp": "qnn"} and deploy["actions"][0]["ep_name"] == "qnn"
    manifest = json.loads((dist / "manifest.json").read_text())
    assert manifest["components"]["g/c"]["variants"]["htp"]["ep"] == "qnn"
    x = np.ones((1, 32), np.float32)
    got = probe(dist, QNN73, {"g/c": x.tolist()}, ep="qnn")
    assert got["selected"]["g/c"] == ["htp", "g/htp"] and got["outputs"]["g/c"][1][0] == "qnn"
    # epbuild's own opening registers the plugin under the name the package declares.
    args = [sys.executable, "-c", OPEN, str(dist), "g", "open"]
    opened = subprocess.run(args, capture_output=True, text=True, timeout=waits.scaled(300))
    assert opened.returncode == 0, opened.stderr[-2000:]
    assert json.loads(opened.stdout.strip().splitlines()[-1]) == [1, 32]


def test_an_app_registering_another_name_is_told_the_name_the_package_expects(
    workspace: Workspace,
) -> None:
    from epbuild.errors import EpNameMismatchError

    ws = shippable(workspace)
    package(ws.root, out="dist", build=True)
    dist = ws.root / "dist"
    # What the app sees: ONNX Runtime selects nothing, and says only that.
    proc = run_probe(dist, QNN73, {"g/c": None}, "qnn")
    assert proc.returncode != 0 and "No suitable model variant found" in proc.stderr
    # What epbuild says: both names, and both ways to make them agree.
    with pytest.raises(EpNameMismatchError) as info:
        open_package(dist, "g", ep_name="qnn")
    message, hint = info.value.message, info.value.hint or ""
    assert "named 'QNNExecutionProvider', but the app registers it as 'qnn'" in message
    assert "register_execution_provider_library('QNNExecutionProvider'" in hint
    assert 'ep_names = { htp = "qnn" }' in hint
    # and the other way round
    ws.manifest((ws.root / "epbuild.toml").read_text() + 'ep_names = { htp = "qnn" }\n')
    package(ws.root, out="dist")
    with pytest.raises(EpNameMismatchError, match="named 'qnn', but the app registers it as "
                       "'QNNExecutionProvider'"):  # fmt: skip
        open_package(dist, "g", ep_name="QNNExecutionProvider")


def test_ep_names_are_checked(workspace: Workspace) -> None:
    ws = shippable(workspace)
    base = (ws.root / "epbuild.toml").read_text()
    for extra, message in (
        ('ep_names = { nope = "qnn" }', "package.ep_names.nope: no provider named 'nope'"),
        ('ep_names = { htp = "q nn" }', '"q nn" is not a valid name'),
        ('ep_names = { htp = "qnn\\n" }', '"qnn\\n" is not a valid name'),
        ('ep_names = { htp = "" }', "package.ep_names.htp"),
    ):
        ws.manifest(base + extra + "\n")
        proc = ws.main("package", "-o", "dist")
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    trt = base.replace("[package]", '[providers.gpu]\nep = "tensorrt"\n\n[package]')
    ws.manifest(trt + 'ep_names = { gpu = "trt" }\n')
    proc = ws.main("package", "-o", "dist")
    assert proc.returncode == 2 and "always named 'TensorrtExecutionProvider'" in proc.stderr


def test_the_registration_name_is_in_no_key_and_older_outputs_stay_valid(
    built: Workspace, tmp_path: Path
) -> None:
    """Renaming the registration (qnn → QNNExecutionProvider) rebuilt nothing: keys name the
    adapter, not the registration; outputs compiled under the old name pass every check."""
    from epbuild.kinds.compilekey import compile_key
    from epbuild.onnx.context import compatibility_problems, source_problems
    from epbuild.onnx.proto import read_model
    from epbuild.planning.workspace import open_workspace
    from epbuild.providers import get_provider
    from epbuild.providers.base import ProviderConfig

    ws = open_workspace(built.root)
    for action in ws.actions:
        key = compile_key(action, ws.keys)
        assert key.components["ep"] == "qnn" and key.key == ws.state.records[action.id].key
        assert "QNNExecutionProvider" not in json.dumps(key.components)
    old = tmp_path / "old"
    old.mkdir()
    save_model = "import onnx, sys; sys.path.insert(0, sys.argv[2]); from modelgen import matmul_model; onnx.save(matmul_model(4), sys.argv[1])"  # noqa: E501
    subprocess.run([sys.executable, "-c", save_model, str(old / "c.onnx"),
                    str(Path(__file__).parent)], check=True, timeout=waits.scaled(120))  # fmt: skip
    compile_as_qnn = r"""
import sys, onnxruntime as ort, onnxruntime_qnn
ort.register_execution_provider_library("qnn", onnxruntime_qnn.get_library_path())
so = ort.SessionOptions()
so.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "qnn"],
                            {"backend_type": "htp", "htp_arch": "73", "soc_model": "60"})
so.add_session_config_entry("ep.context_enable", "1")
so.add_session_config_entry("ep.context_file_path", sys.argv[2])
so.add_session_config_entry("ep.context_embed_mode", "0")
ort.InferenceSession(sys.argv[1], so)
"""  # how epbuild compiled before: the plugin registered as "qnn"
    ctx = old / "c_ctx.onnx"
    proc = subprocess.run([sys.executable, "-c", compile_as_qnn, str(old / "c.onnx"), str(ctx)],
                          capture_output=True, text=True, timeout=waits.scaled(300))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = read_model(ctx)
    assert "ep_compatibility_info.qnn" in info.metadata
    config = ProviderConfig("htp", "qnn", QNN73, {}, {})
    adapter = get_provider("qnn")
    assert source_problems("c", info, adapter, config) == []
    assert compatibility_problems("c", info, adapter, config) == []


def test_a_package_another_writer_changed_meanwhile_is_not_reported_written(
    built: Workspace, monkeypatch: Any
) -> None:
    """A writer that ignores the lock (an older epbuild, a script) empties part of the
    package right after the swap: the run fails instead of reporting it packaged."""
    from epbuild.shipping import writer

    swap = writer._swap

    def then_another_writer(new: str, dest: str) -> None:
        swap(new, dest)
        os.unlink(os.path.join(dest, "single", "htp", "c_ctx.onnx"))

    monkeypatch.setattr(writer, "_swap", then_another_writer)
    with pytest.raises(StorageError, match=r"changed by another process .*single/htp/c_ctx.onnx"):
        package(built.root, out="dist")
