"""The runtime API: open built actions with the real QNN EP, in order, closed in reverse;
only what a build fully committed; two sharing groups open at once, created one at a time."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild._names import DEFAULT_STATE_DIR, JOURNAL_NAME
from epbuild.errors import CompatibilityError, LockTimeoutError, NotBuiltError, UserError
from epbuild.providers.base import ProviderConfig
from epbuild.runtime import open_action, open_models
from epbuild.state.journal import Journal, load_state

PROVIDER = ProviderConfig("htp", "qnn", {"backend_type": "htp", **HTP73["options"]}, {}, {})


def _make_trio(workspace: Workspace) -> None:
    for i, name in enumerate("abc"):
        workspace.model(f"m/{name}.onnx", matmul_model(10 + i))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/a.onnx", "m/b.onnx", "m/c.onnx"], "providers": ["htp"]}}})  # fmt: skip
    assert workspace.build().ok


@pytest.fixture
def trio(workspace: Workspace, built_once: Any) -> Workspace:
    """A non-sharing group of three models, built (once per session; a copy per test)."""
    return built_once("runtime-trio", _make_trio, workspace)  # type: ignore[no-any-return]


def cpu(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("load", ["path", "bytes"])
def test_open_from_path_and_bytes_matches_cpu(trio: Workspace, load: Any) -> None:
    x = np.random.default_rng(5).standard_normal((1, 32), dtype=np.float32)
    with open_action("g/htp", trio.root, load=load) as built:
        assert built.names == ["a", "b", "c"]
        for name in built.names:
            got = built.run(name, {"x": x})[0]
            want = cpu(trio.root / "m" / f"{name}.onnx", x)
            assert float(np.abs(got - want).max() / np.abs(want).max()) < 2e-2
    assert built.closed
    with pytest.raises(UserError, match="closed"):
        built.session("a")


def test_in_memory_buffer_needs_no_file_next_to_it(trio: Workspace, tmp_path: Path) -> None:
    # The ctx bytes come from elsewhere; ep.context_file_path points the EP at the bin.
    elsewhere = tmp_path / "copy_ctx.onnx"
    shutil.copyfile(trio.root / "build/g/htp/a_ctx.onnx", elsewhere)
    target = trio.root / "build/g/htp/a_ctx.onnx"
    x = np.ones((1, 32), dtype=np.float32)
    with open_models([(target, elsewhere.read_bytes())], PROVIDER) as built:
        got = built.run("a", {"x": x})[0]
    want = cpu(trio.root / "m/a.onnx", x)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 2e-2


def test_sessions_are_destroyed_in_reverse_order(trio: Workspace) -> None:
    destroyed: list[str] = []
    with open_action("g/htp", trio.root) as built:
        for name in built.names:
            weakref.finalize(built.session(name), destroyed.append, name)
        assert destroyed == []
    assert destroyed == ["c", "b", "a"]


def test_reverse_order_even_when_the_body_raises(trio: Workspace) -> None:
    destroyed: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), open_action("g/htp", trio.root) as built:
        for name in built.names:
            weakref.finalize(built.session(name), destroyed.append, name)
        raise RuntimeError("boom")
    assert destroyed == ["c", "b", "a"]


def _edit(ctx: Path, dest: Path, change: Any) -> Path:
    model = onnx.load(str(ctx), load_external_data=False)
    change(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dest))
    for bin_file in ctx.parent.glob("*.bin"):
        shutil.copyfile(bin_file, dest.parent / bin_file.name)
    return dest


def _set_compat(value: str) -> Any:
    def change(model: onnx.ModelProto) -> None:
        for p in model.metadata_props:
            if p.key.startswith("ep_compatibility_info."):  # QNNExecutionProvider, or qnn
                p.value = value

    return change


def _set_source(model: onnx.ModelProto) -> None:
    for node in model.graph.node:
        for a in node.attribute:
            if a.name == "source":
                a.s = b"openvino"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set_compat("v2:6:2.40.0:5.40.0:73:60:0:0"), "QNN SDK 2.40.0"),
        (_set_compat("v2:6:2.51.0:5.51.0:75:69:0:0"), "htp_arch 75"),
        (_set_source, "source 'openvino'"),
    ],
)
def test_mismatched_context_is_rejected(trio: Workspace, tmp_path: Path, change: Any,
                                        message: str) -> None:  # fmt: skip
    bad = _edit(trio.root / "build/g/htp/a_ctx.onnx", tmp_path / "bad" / "a_ctx.onnx", change)
    with pytest.raises(CompatibilityError, match=message) as info:
        open_models([bad], PROVIDER)
    assert "a_ctx.onnx" in info.value.message


def test_shared_group_is_refused_here_not_crashed(simple_built: Workspace) -> None:
    ws = simple_built
    with pytest.raises(CompatibilityError, match="weight-shared QNN contexts"):
        open_action("pair/htp", ws.root)


@pytest.fixture
def two_pairs(workspace: Workspace, built_once: Any) -> Workspace:
    """Two weight-sharing groups (pair, pair2) and a single-model group, built (once per
    session; a copy per test)."""
    return built_once("runtime-two-pairs", _make_two_pairs, workspace)  # type: ignore[no-any-return]


def _make_two_pairs(ws: Workspace) -> None:
    import numpy as np

    w = np.random.default_rng(7).standard_normal((32, 32), dtype=np.float32) * 0.1
    ws.model("models/a.onnx", matmul_model(1, shared=w))
    ws.model("models/b.onnx", matmul_model(2, shared=w, batch=4))
    ws.model("models/c.onnx", matmul_model(3))
    ws.manifest({"providers": {"htp": HTP73}, "groups": {
        "pair": {"models": ["models/a.onnx", "models/b.onnx"], "providers": ["htp"],
                 "share_weights": True},
        "single": {"models": ["models/c.onnx"], "providers": ["htp"]}}})  # fmt: skip
    text = (ws.root / "epbuild.toml").read_text()
    (ws.root / "epbuild.toml").write_text(
        text.replace(
            "[groups.single]",
            """[groups.pair2]
models = ["models/a.onnx", "models/b.onnx"]
providers = ["htp"]
share_weights = true

[groups.single]""",
        )
    )
    assert ws.build().ok


class Recorder:
    """A session factory that records creation and destruction: shared contexts cannot be
    loaded on x86_64, so sessions are stand-ins; the lock, the order and the session
    options are epbuild's real code."""

    def __init__(self, log: list[str], tag: str, fail: str | None = None) -> None:
        self.log, self.tag, self.fail = log, tag, fail
        self.before: Any = None
        """Called with the model's name before each creation (a test's seam)."""

    def __call__(self, model: Any, so: Any) -> object:
        name = Path(model).name.removesuffix("_ctx.onnx")
        if self.before is not None:
            self.before(name)
        if name == self.fail:
            raise RuntimeError(f"cannot load {name}")
        self.log.append(f"{self.tag} open {name}")
        try:
            share = so.get_session_config_entry("ep.share_ep_contexts")
        except Exception:  # ORT raises for a key that was never set
            share = "0"
        self.log.append(f"{self.tag} share={share}")
        session = _FakeSession()
        weakref.finalize(session, self.log.append, f"{self.tag} close {name}")
        return session


class _FakeSession:
    pass


def _opened(log: list[str]) -> list[str]:
    return [e for e in log if "share=" not in e]


def _in_thread(target: Any, timeout: float = 60) -> None:
    """Run ``target`` in a thread; a hang fails the test instead of hanging it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout}s: a deadlock"
    if errors:
        raise errors[0]


def test_two_sharing_groups_are_open_at_once_and_close_in_reverse(two_pairs: Workspace) -> None:
    log: list[str] = []
    first = open_action("pair/htp", two_pairs.root, session_factory=Recorder(log, "1"))
    # The same thread opens a second sharing group while the first stays open: no wait.
    second = open_action("pair2/htp", two_pairs.root, lock_timeout=0.05,
                         session_factory=Recorder(log, "2"))  # fmt: skip
    third: list[Any] = []
    _in_thread(lambda: third.append(open_action("pair/htp", two_pairs.root, lock_timeout=0.05,
                                                session_factory=Recorder(log, "3"))))  # fmt: skip
    assert log.count("1 share=1") == log.count("2 share=1") == 2
    assert _opened(log) == ["1 open a", "1 open b", "2 open a", "2 open b", "3 open a", "3 open b"]
    del log[:]
    second.close()
    assert log == ["2 close b", "2 close a"]
    third[0].close()
    first.close()
    assert log == ["2 close b", "2 close a", "3 close b", "3 close a", "1 close b", "1 close a"]


def test_the_lock_is_held_while_a_group_is_created(two_pairs: Workspace) -> None:
    log: list[str] = []
    inside, go = threading.Event(), threading.Event()
    slow = Recorder(log, "1")
    slow.before = lambda name: (inside.set(), go.wait(30)) if name == "b" else None
    first: list[Any] = []
    t = threading.Thread(target=lambda: first.append(
        open_action("pair/htp", two_pairs.root, session_factory=slow)), daemon=True)  # fmt: skip
    t.start()
    assert inside.wait(30)
    # pair's sessions are being created: another sharing group must wait for the lock...
    with pytest.raises(LockTimeoutError, match="pair2/htp: another weight-sharing group"):
        open_action("pair2/htp", two_pairs.root, lock_timeout=0.05,
                    session_factory=Recorder(log, "2"))  # fmt: skip
    # ...but a group without shared weights does not touch the EP's share state.
    with open_action("single/htp", two_pairs.root, lock_timeout=0.05,
                     session_factory=Recorder(log, "s")):  # fmt: skip
        pass
    go.set()
    t.join(30)
    assert not t.is_alive() and first
    with open_action("pair2/htp", two_pairs.root, lock_timeout=5,
                     session_factory=Recorder(log, "2")):  # fmt: skip
        assert not first[0].closed  # both groups open
    first[0].close()
    assert _opened(log) == [
        "1 open a", "s open c", "s close c", "1 open b", "2 open a", "2 open b",
        "2 close b", "2 close a", "1 close b", "1 close a",
    ]  # fmt: skip


def test_opening_inside_a_groups_creation_never_deadlocks(two_pairs: Workspace) -> None:
    """A factory that opens another group while creating one (same thread, lock held)."""
    log: list[str] = []
    nested: list[Any] = []

    def open_inside(name: str) -> None:
        if name != "a":
            return
        with pytest.raises(
            UserError, match=r"pair2/htp while .* pair/htp are being created in this"
        ):
            open_action("pair2/htp", two_pairs.root, session_factory=Recorder(log, "2"))
        # A group without shared weights is fine in there.
        nested.append(open_action("single/htp", two_pairs.root,
                                  session_factory=Recorder(log, "s")))  # fmt: skip

    outer = Recorder(log, "1")
    outer.before = open_inside
    opened: list[Any] = []
    _in_thread(lambda: opened.append(open_action("pair/htp", two_pairs.root,
                                                 session_factory=outer)))  # fmt: skip
    assert _opened(log) == ["s open c", "1 open a", "1 open b"]
    nested[0].close()
    opened[0].close()
    # Afterwards the thread holds nothing: a sharing group opens at once.
    _in_thread(lambda: open_action("pair2/htp", two_pairs.root, lock_timeout=0.05,
                                   session_factory=Recorder(log, "2")).close())  # fmt: skip


def test_a_failed_creation_tears_down_the_first_in_reverse(trio: Workspace) -> None:
    log: list[str] = []
    with pytest.raises(CompatibilityError, match="cannot load c") as info:
        open_action("g/htp", trio.root, session_factory=Recorder(log, "1", fail="c"))
    # Torn down before the error propagates, although its traceback is still alive here.
    assert info.value.__traceback__ is not None
    assert _opened(log) == ["1 open a", "1 open b", "1 close b", "1 close a"]


def test_a_failed_sharing_group_releases_the_lock(two_pairs: Workspace) -> None:
    log: list[str] = []
    with pytest.raises(CompatibilityError, match="cannot load b"):
        open_action("pair/htp", two_pairs.root, session_factory=Recorder(log, "1", fail="b"))
    assert _opened(log) == ["1 open a", "1 close a"]
    _in_thread(lambda: open_action("pair2/htp", two_pairs.root, lock_timeout=0.05,
                                   session_factory=Recorder(log, "2")).close())  # fmt: skip
    assert _opened(log)[2:] == ["2 open a", "2 open b", "2 close b", "2 close a"]


def test_open_action_errors_are_clear(trio: Workspace) -> None:
    with pytest.raises(UserError, match="no action matches"):
        open_action("nope/htp", trio.root)
    manifest = trio.root / "epbuild.toml"
    text = manifest.read_text()
    manifest.write_text(text + '\n[groups.h]\nmodels = ["m/a.onnx"]\nproviders = ["htp"]\n')
    with pytest.raises(NotBuiltError, match="h/htp/a has not been built") as info:
        open_action("h/htp", trio.root)
    assert info.value.hint == "run 'epbuild build h/htp' first"
    trio.model("m/d.onnx", matmul_model(20))
    manifest.write_text(text.replace('"m/c.onnx"]', '"m/c.onnx", "m/d.onnx"]'))
    with pytest.raises(NotBuiltError, match="g/htp/d has not been built"):
        open_action("g/htp", trio.root)


def test_a_model_added_to_a_built_sharing_group_is_not_opened(simple_built: Workspace) -> None:
    ws = simple_built
    manifest = ws.root / "epbuild.toml"
    manifest.write_text(manifest.read_text().replace(
        '"models/b.onnx"]', '"models/b.onnx", "models/c.onnx"]', 1))  # fmt: skip
    message = "pair/htp: build/pair/htp/c_ctx.onnx is not among the outputs of its last build"
    with pytest.raises(NotBuiltError, match=re.escape(message)):
        open_action("pair/htp", ws.root)


def _flip_middle_byte(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _begin_without_done(root: Path, action_id: str) -> None:
    """What a build killed between its journal's ``begin`` and ``done`` leaves behind."""
    path = str(root / DEFAULT_STATE_DIR / JOURNAL_NAME)
    Journal(path).begin(action_id, load_state(path).records[action_id].key)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda root: _begin_without_done(root, "g/htp/b"),
         "g/htp/b: its last build was interrupted while committing"),
        (lambda root: (root / "build/g/htp/c_ctx_qnn.bin").unlink(),
         "g/htp/c is not as its last build left it: output build/g/htp/c_ctx_qnn.bin is missing"),
        (lambda root: (root / "build/g/htp/a_ctx.onnx").write_bytes(b"\0"),
         "g/htp/a is not as its last build left it: output build/g/htp/a_ctx.onnx was modified"),
        (lambda root: _flip_middle_byte(root / "build/g/htp/b_ctx_qnn.bin", keep_mtime=False),
         "g/htp/b is not as its last build left it: output build/g/htp/b_ctx_qnn.bin was modif"),
        (lambda root: (root / "build/g/htp/a_ctx_qnn.bin").unlink()
         or (root / "build/g/htp/a_ctx_qnn.bin").mkdir(),
         "output build/g/htp/a_ctx_qnn.bin is not a file"),
    ],
    ids=["interrupted", "missing", "resized", "same-size", "directory"],
)  # fmt: skip
def test_only_what_was_fully_committed_opens(trio: Workspace, damage: Any, message: str) -> None:
    damage(trio.root)
    log: list[str] = []
    with pytest.raises(NotBuiltError, match=re.escape(message)) as info:
        open_action("g/htp", trio.root, session_factory=Recorder(log, "1"))
    assert info.value.hint == "run 'epbuild build g/htp'"
    assert log == []  # refused before any session was created
    for entry in (trio.root / "build/g/htp").iterdir():
        if entry.is_dir():  # a commit does not rename a file over a directory
            entry.rmdir()
    assert trio.build().ok  # and that is the fix
    with open_action("g/htp", trio.root, session_factory=Recorder(log, "1")):
        pass


def test_a_same_size_edit_with_its_mtime_put_back_needs_check_hash(trio: Workspace) -> None:
    """The default check trusts an unchanged (inode, size, mtime), as the planner does;
    ``check="hash"`` re-reads every output."""
    _flip_middle_byte(trio.root / "build/g/htp/b_ctx_qnn.bin", keep_mtime=True)
    with pytest.raises(NotBuiltError, match=r"b_ctx_qnn\.bin was modified"):
        open_action("g/htp", trio.root, check="hash", session_factory=Recorder([], "1"))


def test_touched_outputs_still_open_for_real(trio: Workspace) -> None:
    """A new mtime on identical bytes is no reason to refuse: the file is re-hashed."""
    for f in (trio.root / "build/g/htp").iterdir():
        os.utime(f, ns=(time.time_ns(), time.time_ns()))
    x = np.ones((1, 32), dtype=np.float32)
    with open_action("g/htp", trio.root) as built:
        got = built.run("b", {"x": x})[0]
    want = cpu(trio.root / "m/b.onnx", x)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 2e-2


def test_outputs_replaced_while_opening_are_refused(trio: Workspace) -> None:
    """A build that commits an action while its sessions are being created."""
    log: list[str] = []
    recorder = Recorder(log, "1")

    def rebuild_behind_its_back(name: str) -> None:
        if name == "b":  # a commit renames a new file over the old one: a new inode
            out = trio.root / "build/g/htp/c_ctx_qnn.bin"
            shutil.copyfile(out, out.with_suffix(".new"))
            os.replace(out.with_suffix(".new"), out)

    recorder.before = rebuild_behind_its_back
    message = "g/htp/c: output build/g/htp/c_ctx_qnn.bin was replaced while its sessions"
    with pytest.raises(NotBuiltError, match=re.escape(message)):
        open_action("g/htp", trio.root, session_factory=recorder)
    assert _opened(log) == ["1 open a", "1 open b", "1 open c", "1 close c", "1 close b",
                            "1 close a"]  # fmt: skip


@pytest.mark.parametrize("load", ["path", "bytes"])
def test_ort_unsupported_verdict_refuses_before_any_session(
    trio: Workspace, monkeypatch: pytest.MonkeyPatch, load: str
) -> None:
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    from epbuild.providers.qnn import QnnProvider

    monkeypatch.setattr(QnnProvider, "compatibility_device_types", frozenset({"CPU"}))
    verdicts = capi.OrtCompiledModelCompatibility
    said: list[str] = []

    def judge(devices: list[Any], info: str) -> Any:
        said.append(info)
        return verdicts.EP_UNSUPPORTED if len(said) == 1 else verdicts.EP_SUPPORTED_OPTIMAL

    monkeypatch.setattr(capi, "get_model_compatibility_for_ep_devices", judge)
    with pytest.raises(CompatibilityError, match="EP_UNSUPPORTED") as info:
        open_action("g/htp", trio.root, load=load)  # type: ignore[arg-type]
    assert "a_ctx.onnx" in info.value.message and said[0].startswith("v2:")
    with open_action("g/htp", trio.root, load=load) as built:  # type: ignore[arg-type]
        assert built.names == ["a", "b", "c"]  # OPTIMAL (and no verdict) open as before
