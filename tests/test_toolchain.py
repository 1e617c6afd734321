"""Per-provider toolchains: QNN and OpenVINO from one manifest, bad toolchains, the
environment epbuild makes (once, under a lock, never half-made).

The OpenVINO tests make a real ``onnxruntime-openvino`` environment with pip, in the per-user
toolchain directory (not the test's private cache), so a machine makes it once: the first
run pays ~10 s plus the download, later runs reuse it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waits
from conftest import HTP73, HTP75, Workspace
from modelgen import matmul_model

from epbuild.cache.location import default_cache_dir
from epbuild.errors import ManifestError
from epbuild.manifest.load import load_manifest
from epbuild.onnx.proto import read_model
from epbuild.toolchains import create
from epbuild.toolchains.env import MARKER, find
from epbuild.toolchains.spec import ToolchainSpec

OPENVINO_PIN = "onnxruntime-openvino==1.24.1"
INTEL_CPU = {
    "ep": "openvino",
    "options": {"device_type": "CPU"},
    "toolchain": {"requirements": [OPENVINO_PIN]},
}
REAL_TOOLCHAINS = os.environ.get("EPBUILD_TOOLCHAINS") or os.path.join(
    default_cache_dir(), "toolchains"
)
"""The per-user toolchain directory, read before the tests' private cache is set up."""


@pytest.fixture
def shared_toolchains(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make and reuse toolchains in the per-user directory (slow to make, cheap to keep)."""
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", REAL_TOOLCHAINS)
    return REAL_TOOLCHAINS


@pytest.fixture
def private_toolchains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty toolchain directory of the test's own."""
    root = tmp_path / "toolchains"
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(root))
    return root


def _mixed(ws: Workspace) -> None:
    ws.model("models/a.onnx", matmul_model(1))
    ws.model("models/b.onnx", matmul_model(2, batch=4))
    ws.manifest(
        {
            "providers": {"htp73": HTP73, "htp75": HTP75, "intel-cpu": INTEL_CPU},
            "groups": {
                "g": {
                    "models": ["models/a.onnx", "models/b.onnx"],
                    "providers": ["htp73", "htp75", "intel-cpu"],
                }
            },
        }
    )


def _by_id(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["id"]: a for a in doc["actions"]}


@pytest.mark.slow  # makes (or reuses) a real toolchain environment with pip
def test_one_manifest_builds_qnn_and_openvino(workspace: Workspace, shared_toolchains: str) -> None:
    _mixed(workspace)
    doc = workspace.cli_json("build", "-j", "2")
    assert doc["summary"]["compiled"] == 6 and doc["summary"]["failed"] == 0, doc
    out = workspace.root / "build" / "g" / "intel-cpu"
    for stem in ("a", "b"):
        info = read_model(str(out / f"{stem}_ctx.onnx"))
        (node,) = info.context_nodes
        binary = f"{stem}_ctx_OpenVINOExecutionProvider.bin"
        assert node.attributes["source"] == "OpenVINOExecutionProvider"
        assert node.attributes["embed_mode"] == 0
        assert node.attributes["ep_cache_context"] == binary
        assert (out / binary).stat().st_size % 65536 == 0  # OVEP_BIN blobs are 64 KiB-aligned

    # Every output passes verify; --load runs each ctx model in its own toolchain: QNN's
    # load here, and the onnxruntime-openvino Linux wheel's known limit is said plainly.
    checked = workspace.cli_json("verify", "--load")
    assert checked["ok"] and checked["problems"] == [], checked
    loads = {c["file"]: c for c in checked["loads"]}
    for stem in ("a", "b"):
        assert loads[f"build/g/htp73/{stem}_ctx.onnx"]["outcome"] == "passed"
        ov = loads[f"build/g/intel-cpu/{stem}_ctx.onnx"]
        assert ov["outcome"] == "not_loadable_here" and "IR frontend" in ov["message"]

    detail = _by_id(workspace.cli_json("status", "--detail"))
    (model,) = detail["g/intel-cpu/a"]["models"]
    assert model["context_nodes"] == 1 and model["cpu_nodes"] == 0 and model["source_nodes"] > 0
    assert detail["g/intel-cpu/a"]["toolchain"]["onnxruntime-openvino"] == "1.24.1"
    assert detail["g/htp73/a"]["toolchain"] is None

    again = workspace.cli_json("build")
    assert again["summary"]["up_to_date"] == 6
    _runtime_says_why(workspace)


def _runtime_says_why(workspace: Workspace) -> None:
    """The runtime opens an OpenVINO action only in its toolchain's Python, and there says
    why the wheel cannot load it."""
    from epbuild.errors import UserError
    from epbuild.runtime import open_action
    from epbuild.toolchains.boot import boot_command

    with pytest.raises(UserError) as info:
        open_action("g/intel-cpu", workspace.root)
    assert "toolchain" in str(info.value) and "cannot load it" in str(info.value)
    toolchain = create.ensure(ToolchainSpec(requirements=(OPENVINO_PIN,)), "intel-cpu")
    probe = (
        "import sys; from epbuild.runtime import open_action\n"
        "try:\n    open_action('g/intel-cpu', sys.argv[1])\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)"
    )
    command = boot_command(toolchain.python, "epbuild.runtime")
    command[-1] = command[-1].split("from epbuild.runtime")[0].replace("; ", "\n") + probe
    proc = waits.run([*command, str(workspace.root)], "the probe in the toolchain")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("CompatibilityError") and "IR frontend" in proc.stdout


@pytest.mark.slow  # makes (or reuses) a real toolchain environment with pip
def test_changed_pin_stales_that_provider_only(
    workspace: Workspace, shared_toolchains: str
) -> None:
    _mixed(workspace)
    workspace.cli("build", "-j", "2", check=True)
    text = (workspace.root / "epbuild.toml").read_text()
    pinned = text.replace(f'"{OPENVINO_PIN}"', f'"{OPENVINO_PIN}", "numpy>=1.24"')
    assert pinned != text
    (workspace.root / "epbuild.toml").write_text(pinned)
    status = _by_id(workspace.cli_json("status"))
    assert {i for i, a in status.items() if a["stale"]} == {"g/intel-cpu/a", "g/intel-cpu/b"}
    reason = status["g/intel-cpu/a"]["reasons"][0]
    assert "numpy>=1.24" in reason and "toolchain" in reason, reason


@pytest.mark.slow  # makes (or reuses) a real toolchain environment with pip
def test_openvino_toolchain_runs_its_own_onnxruntime(shared_toolchains: str) -> None:
    """The worker's interpreter imports onnxruntime from the toolchain and epbuild from the
    copy made for it, nothing from the environment the tests run in."""
    from epbuild.toolchains.boot import boot_command, worker_path

    toolchain = create.ensure(ToolchainSpec(requirements=(OPENVINO_PIN,)), "intel-cpu")
    probe = (
        "import json, onnxruntime as ort, epbuild.executors.worker as w; "
        "print(json.dumps([ort.__file__, w.__file__, ort.get_available_providers()]))"
    )
    command = boot_command(toolchain.python, "epbuild.executors.worker")
    command[-1] = command[-1].replace("from epbuild.executors.worker import main; main()", probe)
    proc = waits.run(command, "the probe in the toolchain")
    assert proc.returncode == 0, proc.stderr
    ort_file, worker_file, providers = json.loads(proc.stdout)
    assert ort_file.startswith(toolchain.prefix)
    assert worker_file.startswith(worker_path())
    assert "OpenVINOExecutionProvider" in providers
    assert sys.prefix not in ort_file


@pytest.mark.slow  # makes (or reuses) a real toolchain environment with pip
def test_bad_toolchains_fail_their_provider_only(
    workspace: Workspace, private_toolchains: Path
) -> None:
    """A missing interpreter, a package that does not exist and an environment without the
    EP each fail their provider's action with one message; -k builds the rest, and no
    environment is left for a later build to trust."""
    workspace.model("models/a.onnx", matmul_model(1))
    workspace.manifest(
        {
            "providers": {
                "htp": HTP73,
                "no-python": {**INTEL_CPU, "toolchain": {"python": "envs/none/bin/python"}},
                "no-package": {
                    **INTEL_CPU,
                    "toolchain": {"requirements": ["epbuild-no-such-package-xyz==1.0"]},
                },
                # epbuild's own environment: onnxruntime and QNN, no OpenVINO EP
                "no-ep": {**INTEL_CPU, "toolchain": {"python": sys.executable}},
            },
            "groups": {
                "g": {
                    "models": ["models/a.onnx"],
                    "providers": ["htp", "no-python", "no-package", "no-ep"],
                }
            },
        }
    )
    for _ in range(2):  # the second build tries again: nothing broken was kept
        proc = workspace.cli("build", "-k", "--json")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        actions = _by_id(json.loads(proc.stdout))
        assert actions["g/htp/a"]["outcome"] in ("compiled", "up_to_date")
        assert "'envs/none/bin/python' does not exist" in actions["g/no-python/a"]["error"]
        no_package = actions["g/no-package/a"]
        assert "making its toolchain" in no_package["error"]
        assert "epbuild-no-such-package-xyz" in no_package["error"]
        assert "pip" in no_package["error"] and "requirements" in no_package["hint"]
        assert "has no onnxruntime-openvino" in actions["g/no-ep/a"]["error"]
        made = [p for p in private_toolchains.iterdir() if (p / MARKER).exists()]
        assert made == []


def test_status_does_not_make_toolchains(workspace: Workspace, private_toolchains: Path) -> None:
    _mixed(workspace)
    status = _by_id(workspace.main_json("status"))
    assert "is not made yet" in status["g/intel-cpu/a"]["reasons"][0]
    dry = workspace.main_json("build", "--dry-run")
    assert dry["summary"]["failed"] == 0
    assert not private_toolchains.exists() or not any(private_toolchains.iterdir())


def test_python_toolchain_builds(workspace: Workspace, private_toolchains: Path) -> None:
    """``toolchain = { python = ... }``: workers run that interpreter (here the tests' own,
    which has onnxruntime-qnn), isolated, with epbuild's copy on their path."""
    workspace.model("models/a.onnx", matmul_model(1))
    htp = {**HTP73, "toolchain": {"python": sys.executable}}
    workspace.manifest(
        {
            "providers": {"htp": htp},
            "groups": {"g": {"models": ["models/a.onnx"], "providers": ["htp"]}},
        }
    )
    doc = workspace.main_json("build")
    assert doc["summary"]["compiled"] == 1, doc
    assert workspace.cli_json("verify")["ok"]
    assert workspace.main_json("build")["summary"]["up_to_date"] == 1


@pytest.fixture
def fake_make(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """``create._make`` replaced by one that writes a marker at once; records each call."""
    calls: list[str] = []
    real = create._make

    def make(
        spec: ToolchainSpec, directory: str, provider: str, locked: Any = None, *_: Any
    ) -> Any:
        calls.append(directory)
        os.makedirs(os.path.join(directory, "bin"), exist_ok=True)
        python = os.path.join(directory, "bin", "python")
        Path(python).write_text("")
        marker = {"format": 1, "python": "bin/python", "version": "3.11.0", "sites": ["lib"]}
        Path(directory, MARKER).write_text(json.dumps(marker))
        return find(spec, "", provider, locked)

    monkeypatch.setattr(create, "_make", make)
    yield calls
    monkeypatch.setattr(create, "_make", real)


def test_environment_is_made_once_under_concurrency(
    private_toolchains: Path, fake_make: list[str]
) -> None:
    spec = ToolchainSpec(requirements=("onnxruntime-openvino==1.24.1",))
    done: list[Any] = []
    threads = [
        threading.Thread(target=lambda: done.append(create.ensure(spec, "p"))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_make) == 1 and len(done) == 4
    assert len({d.python for d in done}) == 1


def test_half_made_environment_is_never_used(
    private_toolchains: Path, fake_make: list[str]
) -> None:
    spec = ToolchainSpec(requirements=("onnxruntime-openvino==1.24.1",))
    from epbuild.toolchains.env import env_dir

    leftover = Path(env_dir(spec))
    (leftover / "lib").mkdir(parents=True)
    (leftover / "lib" / "half.py").write_text("")
    assert find(spec, "", "p") is None  # no marker: not a toolchain
    made = create.ensure(spec, "p")
    assert fake_make == [str(leftover)] and made.prefix == str(leftover)


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({}, "exactly one of requirements and python"),
        ({"requirements": ["x"], "python": "y"}, "exactly one of requirements and python"),
        ({"requirements": ["--index-url=http://x"]}, "pip options are not accepted"),
        ({"requirements": []}, "providers.p.toolchain.requirements"),
        ({"requirements": ["./wheels/onnxruntime_qnn.whl"]}, "is a local file"),
        ({"requirements": ["x @ file:///w/x.whl"]}, "is a local file"),
        ({"pip": ["x"]}, "pip"),
    ],
)
def test_toolchain_table_errors(workspace: Workspace, table: dict[str, Any], needle: str) -> None:
    workspace.model("models/a.onnx", matmul_model(1))
    path = workspace.manifest(
        {
            "providers": {"p": {**INTEL_CPU, "toolchain": table}},
            "groups": {"g": {"models": ["models/a.onnx"], "providers": ["p"]}},
        }
    )
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert needle in str(info.value) and "epbuild.toml" in str(info.value)


def test_openvino_cpu_sharing_group_is_refused_before_compiling(workspace: Workspace) -> None:
    workspace.model("models/a.onnx", matmul_model(1))
    workspace.model("models/b.onnx", matmul_model(2))
    path = workspace.manifest(
        {
            "providers": {"intel-cpu": INTEL_CPU},
            "groups": {
                "g": {
                    "models": ["models/a.onnx", "models/b.onnx"],
                    "providers": ["intel-cpu"],
                    "share_weights": True,
                }
            },
        }
    )
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert "does not share weights on CPU" in str(info.value)
    assert "groups.g.share_weights" in str(info.value)


def test_add_provider_with_a_toolchain(workspace: Workspace) -> None:
    workspace.model("models/a.onnx", matmul_model(1))
    path = workspace.manifest(
        '# mine\n[providers.htp]  # phone\nep = "qnn"\n'
        'options = { htp_arch = "73", soc_model = "60" }\n\n'
        '[groups.g]\nmodels = ["models/a.onnx"]\nproviders = ["htp"]\n'
    )
    before = path.read_text()
    args = ("add", "provider", "intel-cpu", "--ep", "openvino", "--option", "device_type=CPU")
    proc = workspace.main(*args, "--requirement", OPENVINO_PIN)
    assert proc.returncode == 0, proc.stderr
    loaded = load_manifest(path).providers["intel-cpu"]
    assert loaded.toolchain == ToolchainSpec(requirements=(OPENVINO_PIN,))
    assert path.read_text().startswith(before.split("\n[groups.g]")[0])  # comments kept
    edited = path.read_text()
    bad = workspace.cli("add", "provider", "x", "--ep", "openvino", "--python", "")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert path.read_text() == edited


def test_toolchains_list_and_prune(
    workspace: Workspace, private_toolchains: Path, fake_make: list[str]
) -> None:
    """``epbuild toolchains`` lists the environments and which provider uses each;
    ``--prune`` keeps the manifest's, removes the rest (half-made and failed leftovers too)."""
    _mixed(workspace)  # intel-cpu uses OPENVINO_PIN
    used = create.ensure(ToolchainSpec(requirements=(OPENVINO_PIN,)), "intel-cpu")
    other = create.ensure(ToolchainSpec(requirements=("onnxruntime-gpu==1.23.2",)), "gpu")
    (private_toolchains / "0123456789abcdef" / "lib").mkdir(parents=True)  # half-made
    (private_toolchains / "fedcba9876543210.log").write_text("ERROR: no such package\n")
    listed = workspace.main_json("toolchains")["environments"]
    by_path = {e["path"]: e for e in listed}
    assert by_path[used.prefix]["used_by"] == ["intel-cpu"] and by_path[used.prefix]["ready"]
    assert by_path[other.prefix]["used_by"] == []
    assert not by_path[str(private_toolchains / "0123456789abcdef")]["ready"]
    proc = workspace.main("toolchains", "--prune")
    assert proc.returncode == 0, proc.stderr
    left = sorted(p.name for p in private_toolchains.iterdir() if not p.name.startswith("worker-"))
    assert left == [Path(used.prefix).name, Path(used.prefix).name + ".lock"]


@pytest.fixture
def linked_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """``create._make`` for real, but its venv and pip steps make an environment that links
    to the tests' own virtualenv (``pyvenv.cfg`` + ``lib``): a working toolchain in no time."""
    monkeypatch.setenv("EPBUILD_INSTALLER", "pip")

    def run(argv: list[str], log: str, spec: ToolchainSpec, provider: str, *_: Any) -> None:
        if argv[1:3] != ["-m", "venv"]:
            return  # the pip install: everything is there already
        directory = Path(argv[3])
        (directory / "bin").mkdir(parents=True)
        shutil.copy(Path(sys.prefix) / "pyvenv.cfg", directory)
        (directory / "lib").symlink_to(Path(sys.prefix) / "lib")
        (directory / "bin" / "python").symlink_to(os.path.realpath(sys.executable))

    monkeypatch.setattr(create, "_run", run)


def test_prune_skips_an_environment_a_running_build_uses(
    workspace: Workspace, private_toolchains: Path, linked_make: None, tmp_path: Path
) -> None:
    from epbuild.providers.base import dist_version

    workspace.model("models/a.onnx", matmul_model(1))
    pin = f"onnxruntime-qnn=={dist_version('onnxruntime-qnn')}"
    htp = {**HTP73, "toolchain": {"requirements": [pin]}}
    group = {"models": ["models/a.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": htp}, "groups": {"g": group}})
    spec = load_manifest(str(workspace.root / "epbuild.toml")).providers["htp"].toolchain
    assert spec is not None
    env = Path(create.ensure(spec, "htp").prefix)
    gate = tmp_path / "go"
    build = subprocess.Popen(
        [sys.executable, "-m", "epbuild", "-C", str(workspace.root), "build", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "EPBUILD_TEST_HOOK": f"wait:models/a.onnx:{gate}"},
    )  # fmt: skip
    elsewhere = tmp_path / "elsewhere"  # another workspace, no manifest: keeps nothing
    elsewhere.mkdir()
    try:
        logs = workspace.root / "build"
        waits.wait_for(lambda: any("test hook: wait" in p.read_text(errors="replace")
                                   for p in logs.rglob(".epbuild-worker.log")),
                       "the build's worker to hold in the test hook", proc=build)  # fmt: skip
        prune = subprocess.run(
            [sys.executable, "-m", "epbuild", "-C", str(elsewhere), "toolchains", "--prune"],
            capture_output=True, text=True, timeout=waits.scaled(120),
        )  # fmt: skip
        assert prune.returncode == 0, prune.stderr
        assert f"kept {env}: a running build uses it" in prune.stdout, prune.stdout
        assert (env / MARKER).is_file()
    finally:
        gate.touch()
    out, err = waits.communicate(build, "the build holding the toolchain", timeout=300)
    assert build.returncode == 0, err
    assert json.loads(out)["summary"]["compiled"] == 1
    prune = subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(elsewhere), "toolchains", "--prune"],
        capture_output=True, text=True, timeout=waits.scaled(120),
    )  # fmt: skip
    assert f"removed {env}" in prune.stdout, prune.stdout  # no build uses it any more
    assert not env.exists()


def test_noop_without_a_lock_is_fast_until_a_lock_appears(
    workspace: Workspace, private_toolchains: Path, linked_make: None
) -> None:
    """A requirements toolchain and no ``epbuild.lock``: the absent lock is stamped like any
    file, so the no-op takes the fast path; creating or changing the lock makes it miss."""
    from epbuild.planning.noop import fast_noop
    from epbuild.providers.base import dist_version

    workspace.model("models/a.onnx", matmul_model(1))
    pin = f"onnxruntime-qnn=={dist_version('onnxruntime-qnn')}"
    htp = {**HTP73, "toolchain": {"requirements": [pin]}}
    group = {"models": ["models/a.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": htp}, "groups": {"g": group}})
    spec = load_manifest(str(workspace.root / "epbuild.toml")).providers["htp"].toolchain
    assert spec is not None
    create.ensure(spec, "htp")
    assert workspace.main_json("build")["summary"]["compiled"] == 1
    assert workspace.cli_json("build")["summary"]["up_to_date"] == 1  # records the fingerprint
    lock = workspace.root / "epbuild.lock"
    assert not lock.exists()
    assert fast_noop(str(workspace.root), None, []) is not None
    workspace.main("lock", check=True)
    assert lock.is_file()
    assert fast_noop(str(workspace.root), None, []) is None  # a lock appeared
    assert workspace.cli_json("build")["summary"]["up_to_date"] == 1
    assert fast_noop(str(workspace.root), None, []) is not None
    lock.write_text(lock.read_text() + "# edited\n")
    assert fast_noop(str(workspace.root), None, []) is None  # the lock changed
