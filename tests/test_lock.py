"""``epbuild.lock``: written and read back byte-identically, out of date with the manifest
(``lock --check``, ``status``), and ``build --locked`` refusing drifted environments."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

import pytest
import waits
from conftest import HTP73, HTP75, Workspace
from modelgen import matmul_model

from epbuild.cache.location import default_cache_dir
from epbuild.errors import ToolchainError
from epbuild.planning.lock import SEEDS, machine_platform
from epbuild.providers.base import canonical_name, installed_distributions, scanning
from epbuild.providers.qnn import DIST
from epbuild.toolchains import create
from epbuild.toolchains.env import find
from epbuild.toolchains.lockfile import LOCK_NAME, Distribution, EnvironmentLock, Lock, ProviderLock
from epbuild.toolchains.resolve import Toolchains
from epbuild.toolchains.spec import ToolchainSpec

QNN_TOOLCHAIN = {**HTP75, "toolchain": {"python": sys.executable}}
"""A ``python`` toolchain (the tests' own interpreter): locked without making anything."""


def _ws(workspace: Workspace, *, toolchain: bool = False) -> Workspace:
    workspace.model("models/a.onnx", matmul_model(1))
    providers = {"htp73": HTP73, **({"tc": QNN_TOOLCHAIN} if toolchain else {})}
    workspace.manifest(
        {
            "providers": providers,
            "groups": {"g": {"models": ["models/a.onnx"], "providers": sorted(providers)}},
        }
    )
    return workspace


def _lock(ws: Workspace) -> Path:
    ws.main("lock", check=True)
    return ws.root / LOCK_NAME


def test_lock_written_and_read_back_byte_identically(
    workspace: Workspace, private_toolchains: Path
) -> None:
    path = _lock(_ws(workspace, toolchain=True))
    text = path.read_text()
    lock = Lock.from_toml(text)
    assert lock.to_toml() == text
    qnn = lock.providers["htp73"]
    assert qnn.environment == "epbuild"
    assert qnn.versions["onnxruntime-qnn"] != "absent" and qnn.versions["qnn-sdk"]
    assert qnn.library == "onnxruntime_qnn/libonnxruntime_providers_qnn.so"
    assert len(qnn.library_sha256 or "") == 64
    env = lock.environments["epbuild"]
    assert env.distributions["onnxruntime-qnn"].version == qnn.versions["onnxruntime-qnn"]
    assert env.python.count(".") == 2 and env.platform
    tc = lock.environments[lock.providers["tc"].environment]
    assert tc.interpreter == sys.executable and "onnxruntime-qnn" in tc.distributions
    again = workspace.main("lock", check=True)
    assert "unchanged" in again.stdout and path.read_text() == text  # stable: same bytes


def test_lock_check_and_status_say_when_out_of_date(workspace: Workspace) -> None:
    ws = _ws(workspace)
    assert ws.main("lock", "--check").returncode == 1  # no lock yet
    _lock(ws)
    assert ws.main("lock", "--check").returncode == 0
    assert ws.main_json("status")["lock"] == []
    _ws(workspace, toolchain=True)  # a provider with a toolchain joins the manifest
    check = ws.main("lock", "--check")
    assert check.returncode == 1
    assert "provider tc is not in the lock" in check.stderr
    assert any("provider tc is not in the lock" in n for n in ws.main_json("status")["lock"])
    assert "lock        epbuild.lock is out of date" in ws.main("status").stdout


def test_locked_refuses_a_drifted_default_environment(workspace: Workspace) -> None:
    ws = _ws(workspace)
    path = _lock(ws)
    installed = Lock.from_toml(path.read_text()).providers["htp73"].versions["onnxruntime-qnn"]
    path.write_text(
        path.read_text().replace(f'onnxruntime-qnn = "{installed}"', 'onnxruntime-qnn = "2.6.0"')
    )
    for args, env in ((("build", "--locked"), {}), (("build",), {"EPBUILD_LOCKED": "1"})):
        proc = _cli_env(ws, env, *args)
        assert proc.returncode == 2, proc.stderr
        assert f"onnxruntime-qnn 2.6.0 (lock) ≠ {installed} (installed)" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (ws.root / "build").exists()  # nothing compiled
    ws.main("lock", check=True)  # accept the installed versions
    doc = ws.main_json("build", "--locked")
    assert doc["summary"]["compiled"] == 1, doc


def test_locked_names_the_lock_as_the_docs_show_it(workspace: Workspace) -> None:
    """The refusal names ``epbuild.lock`` (beside the manifest), not this machine's path to
    it, and lists each difference on a line of its own (docs/guides/vendors.md)."""
    ws = _ws(workspace)
    path = _lock(ws)
    installed = Lock.from_toml(path.read_text()).providers["htp73"].versions["onnxruntime-qnn"]
    path.write_text(
        path.read_text().replace(f'onnxruntime-qnn = "{installed}"', 'onnxruntime-qnn = "2.6.0"')
    )
    proc = ws.main("build", "--locked")
    assert proc.returncode == 2, proc.stderr
    said = (
        "epbuild: error: --locked: the environment differs from epbuild.lock:\n"
        f"    provider htp73: onnxruntime-qnn 2.6.0 (lock) ≠ {installed} (installed)\n"
    )
    assert said in proc.stderr and str(ws.root) not in proc.stderr, proc.stderr


def test_locked_refuses_a_drifted_toolchain(workspace: Workspace, private_toolchains: Path) -> None:
    ws = _ws(workspace, toolchain=True)
    path = _lock(ws)
    text = path.read_text()
    numpy = Lock.from_toml(text).environments["tc"].distributions["numpy"].version
    head, _, tail = text.partition("[environments.tc.distributions]")
    path.write_text(
        head
        + "[environments.tc.distributions]"
        + tail.replace(f'numpy = "{numpy}"', 'numpy = "1.0.0"', 1)
    )
    proc = ws.main("build", "--locked", "g/tc")
    assert proc.returncode == 2, proc.stderr
    assert f"toolchain tc: numpy 1.0.0 (lock) ≠ {numpy} (installed)" in proc.stderr


def test_locked_without_a_lock_is_a_clear_error(workspace: Workspace) -> None:
    proc = _ws(workspace).main("build", "--locked")
    assert proc.returncode == 2
    assert "no epbuild.lock beside the manifest" in proc.stderr and "epbuild lock" in proc.stderr


@pytest.mark.parametrize("text", ["format = 1\n[providers.x]\nep = 'qnn'\n", "not toml ["])
def test_malformed_lock_names_the_file(workspace: Workspace, text: str) -> None:
    ws = _ws(workspace)
    (ws.root / LOCK_NAME).write_text(text)
    proc = ws.cli("build", "--locked")
    assert proc.returncode == 2 and LOCK_NAME in proc.stderr and "epbuild lock" in proc.stderr
    assert "Traceback" not in proc.stderr


def _cli_env(ws: Workspace, env: dict[str, str], *args: str) -> object:
    import os
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(ws.root), *args],
        capture_output=True, text=True, timeout=waits.scaled(300), env={**os.environ, **env},
    )  # fmt: skip


@pytest.fixture
def private_toolchains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty toolchain directory of the test's own."""
    root = tmp_path / "toolchains"
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(root))
    return root


def _resolved(requirement: str, tmp: Path) -> dict[str, tuple[str, str]]:
    """What pip resolves for ``requirement`` here: name → (version, sha256)."""
    import json
    import subprocess

    report = tmp / "report.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), requirement],
        check=True, capture_output=True, timeout=waits.scaled(600),
    )  # fmt: skip
    found = {}
    for item in json.loads(report.read_text())["install"]:
        sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
        found[canonical_name(item["metadata"]["name"])] = (item["metadata"]["version"], sha)
    return found


@pytest.mark.slow
def test_toolchain_made_from_a_lock_has_exactly_the_locked_set(
    tmp_path: Path, private_toolchains: Path
) -> None:
    """An environment made from a lock entry: in the directory named by the entry's digest,
    exactly the locked distributions (dependencies not re-resolved), hashes checked."""
    requirement = "onnxruntime==1.30.0"  # a small ONNX Runtime wheel: a toolchain needs one
    resolved = _resolved(requirement, tmp_path)
    locked = EnvironmentLock(
        "ort",
        platform.python_version(),
        machine_platform(),
        {n: Distribution(v, sha) for n, (v, sha) in resolved.items()},
        requirements=(requirement,),
    )
    spec = ToolchainSpec(requirements=(requirement,))
    made = create.ensure(spec, "ort", locked=locked)
    assert made.prefix == str(private_toolchains / locked.digest())
    with scanning(made.sites):
        installed = {n: v for n, (v, _s) in installed_distributions().items()}
    assert {n: v for n, v in installed.items() if n not in SEEDS} == {
        n: v for n, (v, _sha) in resolved.items()
    }
    assert find(spec, ".", "ort", locked) == made and find(spec, ".", "ort") is None
    name, (version, _sha) = sorted(resolved.items())[0]
    tampered = EnvironmentLock(
        "ort",
        locked.python,
        locked.platform,
        {**locked.distributions, name: Distribution(version, "0" * 64)},
        requirements=(requirement,),
    )
    with pytest.raises(ToolchainError, match="HASH"):
        create.ensure(spec, "ort", locked=tampered)
    assert not (private_toolchains / tampered.digest()).exists()  # never half-made


def test_a_current_lock_entry_names_the_toolchain_and_prune_keeps_it(
    workspace: Workspace, private_toolchains: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a lock whose entry has the provider's requirements, the toolchain is made from
    it (in the directory its digest names); a changed requirement stops using it."""
    import json
    import os

    from epbuild.manifest.load import load_manifest

    made: list[tuple[str, object]] = []

    def fake_make(
        spec: ToolchainSpec, directory: str, provider: str, locked: object, keep: object = ()
    ) -> object:
        made.append((directory, locked))
        os.makedirs(os.path.join(directory, "bin"))
        Path(directory, "bin", "python").write_text("")
        marker = {"format": 1, "python": "bin/python", "version": "3.11.0", "sites": ["lib"]}
        Path(directory, "epbuild-toolchain.json").write_text(json.dumps(marker))
        return find(spec, "", provider, locked)  # type: ignore[arg-type]

    monkeypatch.setattr(create, "_make", fake_make)
    workspace.model("models/a.onnx", matmul_model(1))
    ov = {"ep": "openvino", "toolchain": {"requirements": ["onnxruntime-openvino==1.24.1"]}}
    path = workspace.manifest(
        {
            "providers": {"ov": ov},
            "groups": {"g": {"models": ["models/a.onnx"], "providers": ["ov"]}},
        }
    )
    env = EnvironmentLock(
        "ov", "3.11.7", machine_platform(), {"numpy": Distribution("2.4.6", "ab" * 32)},
        requirements=("onnxruntime-openvino==1.24.1",),
    )  # fmt: skip
    lock = Lock({"ov": env}, {"ov": ProviderLock("ov", "openvino", "ov")})
    (workspace.root / LOCK_NAME).write_text(lock.to_toml())
    cfg = load_manifest(path).providers["ov"]
    toolchain = Toolchains(create=True).get(cfg)
    assert toolchain is not None and made == [(str(private_toolchains / env.digest()), env)]
    listed = workspace.cli_json("toolchains")["environments"]
    assert [(e["digest"], e["used_by"]) for e in listed] == [(env.digest(), ["ov"])]
    workspace.cli("toolchains", "--prune", check=True)
    assert (private_toolchains / env.digest()).is_dir()  # in use: kept
    changed = {**ov, "toolchain": {"requirements": ["onnxruntime-openvino==1.24.0"]}}
    path = workspace.manifest(
        {
            "providers": {"ov": changed},
            "groups": {"g": {"models": ["models/a.onnx"], "providers": ["ov"]}},
        }
    )
    assert Toolchains(create=False).locked_entry(load_manifest(path).providers["ov"]) is None


def test_a_changed_ep_library_with_the_same_version_changes_the_key(
    workspace: Workspace, tmp_path: Path
) -> None:
    """The sha256 of the EP library that compiles is keyed (stat-cached): a rebuilt or
    patched ``onnxruntime-qnn`` under the same version number is another EP."""
    from epbuild.kinds.compilekey import compile_key
    from epbuild.planning.keys import explain_difference
    from epbuild.planning.workspace import open_workspace
    from epbuild.providers import get_provider
    from epbuild.providers.library import KEY

    site = tmp_path / "site"
    (site / "onnxruntime_qnn-2.7.0.dist-info").mkdir(parents=True)
    package = site / "onnxruntime_qnn"
    package.mkdir()
    (package / "build_and_package_info.py").write_text("qnn_version = '2.51.0'\n")
    library = package / "libonnxruntime_providers_qnn.so"
    library.write_bytes(b"\x7fELF one build")
    os.utime(library, ns=(1_000_000_000, 1_000_000_000))  # old enough to be remembered
    _ws(workspace)

    def key() -> tuple[str, dict[str, object]]:
        ws = open_workspace(workspace.root)
        with scanning((str(site),)):
            computed = compile_key(ws.actions[0], ws.keys)
            inputs = get_provider("qnn").version_inputs(ws.actions[0].provider)
        assert str(library) in inputs  # the no-op fingerprint stamps the library
        return computed.key, computed.components

    before, old = key()
    assert old["versions"][KEY] == hashlib.sha256(b"\x7fELF one build").hexdigest()  # type: ignore[index]
    assert key()[0] == before
    library.write_bytes(b"\x7fELF another build")  # same version, same dist-info
    after, new = key()
    assert after != before
    a, b = old["versions"][KEY][:12], new["versions"][KEY][:12]  # type: ignore[index]
    assert explain_difference(old, new) == [f"EP library sha256 {a} → {b}"]


OPENVINO = {
    "ep": "openvino",
    "options": {"device_type": "CPU"},
    "toolchain": {"requirements": ["onnxruntime-openvino==1.24.1"]},
}
REAL_TOOLCHAINS = os.environ.get("EPBUILD_TOOLCHAINS") or os.path.join(
    default_cache_dir(), "toolchains"
)
"""The per-user toolchain directory (read before the tests' private cache is set up): the
OpenVINO environment is made there once per machine, as in test_toolchain.py."""


# Makes (or reuses) the real OpenVINO toolchain with pip, as test_toolchain.py's slow tests do.
# Fast: a toolchain not made yet keyed from the lock, nothing made
# (test_a_toolchain_not_made_yet_takes_its_keys_from_the_lock, below), a lock entry naming
# the toolchain (test_a_current_lock_entry_names_the_toolchain_and_prune_keeps_it).
@pytest.mark.slow
def test_fresh_clone_restores_a_toolchain_provider_from_the_lock_without_making_it(
    workspace: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A developer locks and builds (QNN + OpenVINO in a toolchain) into a cache; a fresh
    clone with the lock computes the toolchain provider's keys from the lock: ``cache key``,
    ``status`` and ``build --cache-only`` restore everything and make no environment."""
    import shutil

    from epbuild.manifest.load import load_manifest
    from epbuild.planning import lock as locking
    from epbuild.planning.lock import gather

    monkeypatch.setenv("EPBUILD_TOOLCHAINS", REAL_TOOLCHAINS)
    workspace.model("models/a.onnx", matmul_model(1))
    workspace.manifest(
        {
            "providers": {"htp73": HTP73, "ov": OPENVINO},
            "groups": {"g": {"models": ["models/a.onnx"], "providers": ["htp73", "ov"]}},
        }
    )
    # The artifact hashes need the package index; they play no part here.
    monkeypatch.setattr(locking, "resolved_hashes", lambda *a: {})
    manifest = load_manifest(workspace.root / "epbuild.toml")
    text = gather(manifest, Toolchains(create=True)).to_toml()
    (workspace.root / LOCK_NAME).write_text(text)
    cache = str(tmp_path / "cache")
    built = workspace.cli_json("build", "--locked", "--cache", cache)
    assert built["summary"]["compiled"] == 2, built
    key = workspace.cli("cache", "key", check=True).stdout

    clone = Workspace(tmp_path / "clone")
    shutil.copytree(workspace.root / "models", clone.root / "models")
    for name in ("epbuild.toml", LOCK_NAME):
        shutil.copy(workspace.root / name, clone.root / name)
    fresh = tmp_path / "fresh-toolchains"
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", str(fresh))
    assert clone.cli("cache", "key", check=True).stdout == key
    status = {a["id"]: a for a in clone.cli_json("status", "--cache", cache)["actions"]}
    assert any("in the cache" in r for r in status["g/ov/a"]["reasons"]), status
    restored = clone.cli_json("build", "--cache-only", "--locked", "--cache", cache)
    assert restored["summary"]["restored"] == 2, restored
    made = [p.name for p in fresh.iterdir() if p.is_dir()] if fresh.exists() else []
    assert made == []  # no environment made, not even started
    assert (clone.root / "build/g/ov/a_ctx.onnx").is_file()


def test_a_toolchain_not_made_yet_takes_its_keys_from_the_lock(
    workspace: Workspace, private_toolchains: Path
) -> None:
    """The fresh clone's rule without pip: a ``requirements`` toolchain that is not made has
    the key versions its current lock entry pins; ``cache key`` and ``status`` make
    nothing."""
    from epbuild.manifest.load import load_manifest
    from epbuild.planning.keys import ORT_KEY, read_versions

    workspace.model("models/a.onnx", matmul_model(1))
    ov = {"ep": "openvino", "toolchain": {"requirements": ["onnxruntime-openvino==1.24.1"]}}
    path = workspace.manifest(
        {
            "providers": {"ov": ov},
            "groups": {"g": {"models": ["models/a.onnx"], "providers": ["ov"]}},
        }
    )
    numpy = {"numpy": Distribution("2.4.6", "ab" * 32)}
    requirements = ("onnxruntime-openvino==1.24.1",)
    env = EnvironmentLock("ov", "3.11.7", machine_platform(), numpy, requirements=requirements)
    pinned = {"onnxruntime-openvino": "1.24.1", ORT_KEY: "1.24.1", "python": "3.11.7"}
    lock = Lock({"ov": env}, {"ov": ProviderLock("ov", "openvino", "ov", pinned)})
    (workspace.root / LOCK_NAME).write_text(lock.to_toml())
    cfg = load_manifest(path).providers["ov"]
    assert read_versions(cfg, Toolchains(create=False)) == pinned
    workspace.main("cache", "key", check=True)
    (action,) = workspace.main_json("status")["actions"]
    assert action["stale"] and action["id"] == "g/ov/a", action
    assert not private_toolchains.exists() or not any(private_toolchains.iterdir())


def test_a_hand_made_lock_without_the_onnxruntime_pin_is_one_message(
    workspace: Workspace, private_toolchains: Path
) -> None:
    """A lock written by hand whose provider entry pins no onnxruntime: ``cache key`` says
    so and what to do, exit 2 (it was an internal ``KeyError``)."""
    from epbuild.planning.keys import ORT_KEY

    workspace.model("models/a.onnx", matmul_model(1))
    ov = {"ep": "openvino", "toolchain": {"requirements": ["onnxruntime-openvino==1.24.1"]}}
    workspace.manifest(
        {
            "providers": {"ov": ov},
            "groups": {"g": {"models": ["models/a.onnx"], "providers": ["ov"]}},
        }
    )
    numpy = {"numpy": Distribution("2.4.6", "ab" * 32)}
    requirements = ("onnxruntime-openvino==1.24.1",)
    env = EnvironmentLock("ov", "3.11.7", machine_platform(), numpy, requirements=requirements)
    pinned = {"onnxruntime-openvino": "1.24.1", "python": "3.11.7"}
    lock = Lock({"ov": env}, {"ov": ProviderLock("ov", "openvino", "ov", pinned)})
    (workspace.root / LOCK_NAME).write_text(lock.to_toml())
    proc = workspace.cli("cache", "key")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert f"{LOCK_NAME} pins no onnxruntime version ({ORT_KEY!r})" in proc.stderr
    assert "run 'epbuild lock' again" in proc.stderr


def test_build_json_names_what_differs_from_the_nearest_cache_entry(
    workspace: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A miss in a fresh clone (another machine, here another onnxruntime-qnn version) says
    in ``build --json`` which cache entry is nearest and what differs, as status does."""
    import shutil

    from epbuild import api
    from epbuild.providers import qnn

    ws = _ws(workspace)
    cache = str(tmp_path / "cache")
    assert ws.build(cache=cache).to_json()["summary"]["compiled"] == 1
    (ws.root / "models/a.onnx").write_bytes(matmul_model(5).SerializeToString())
    assert ws.build(cache=cache).to_json()["summary"]["compiled"] == 1  # a newer entry
    clone = Workspace(tmp_path / "clone")
    shutil.copytree(ws.root / "models", clone.root / "models")
    shutil.copy(ws.root / "epbuild.toml", clone.root / "epbuild.toml")
    real = qnn.dist_version
    here = real("onnxruntime-qnn")
    monkeypatch.setattr(qnn, "dist_version", lambda d: "9.9.9" if d == DIST else real(d))
    expected = (
        "not in the cache: the cache has g/htp73/a under another key (cache → here): "
        f"onnxruntime-qnn {here} → 9.9.9"
    )  # the nearest entry (same model), not the newest
    assert api.status(clone.root, cache=cache).actions[0].reasons[-1] == expected
    doc = clone.build(cache=cache).to_json()  # the worker's real version then refuses it
    assert expected in doc["actions"][0]["reasons"], doc


def test_a_machine_without_the_ep_takes_its_keys_from_the_lock(workspace: Workspace) -> None:
    """Restoring where the EP is not installed (a packaging job): a provider in epbuild's
    own environment gets the key versions the lock pins, so its keys match the developer's."""
    from epbuild.manifest.load import load_manifest
    from epbuild.planning.keys import read_versions

    ws = _ws(workspace)
    cfg = load_manifest(ws.root / "epbuild.toml").providers["htp73"]
    here = read_versions(cfg, Toolchains(create=False))
    with scanning(()):  # nothing installed
        assert read_versions(cfg, Toolchains(create=False))["onnxruntime-qnn"] == "absent"
    _lock(ws)
    with scanning(()):
        assert read_versions(cfg, Toolchains(create=False)) == here
