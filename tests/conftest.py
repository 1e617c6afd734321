"""Shared fixtures: a ``workspace`` that generates a manifest and tiny models in a temp dir."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import waits
from llmfixture import chat_manifest, place_source
from modelgen import matmul_model, save

HTP73 = {"ep": "qnn", "options": {"htp_arch": "73", "soc_model": "60"}}
HTP75 = {"ep": "qnn", "options": {"htp_arch": "75", "soc_model": "57"}}


def toml_key(key: str) -> str:
    """``key`` bare where TOML allows it, else quoted."""
    return key if key and all(c.isalnum() or c in "_-" for c in key) else json.dumps(key)


def toml_value(value: Any, key: Callable[[str], str] = json.dumps) -> str:
    """Render a Python value as TOML (enough for manifests, and for the odd values the
    property tests try: nan, inf, huge integers); ``key`` renders an inline table's keys."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v, key) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key(k)} = {toml_value(v, key)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def value_paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into nested dicts and lists, the root's (``()``) first: what the manifest
    fuzzers pick a value to replace, delete or add beside from."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += value_paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += value_paths(v, (*prefix, i))
    return out


def render_manifest(data: dict[str, Any]) -> str:
    """dict → epbuild.toml text (tables for workspace/providers/groups)."""
    lines: list[str] = []
    if "workspace" in data:
        lines.append("[workspace]")
        lines += [f"{k} = {toml_value(v)}" for k, v in data["workspace"].items()]
    for section in ("providers", "groups"):
        for name, table in data.get(section, {}).items():
            lines.append(f"\n[{section}.{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


class Workspace:
    """A temp workspace: write models and a manifest, run epbuild on it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def model(self, rel: str, model: Any = None, **kw: Any) -> Path:
        return save(model if model is not None else matmul_model(), self.root / rel, **kw)

    def manifest(self, data: dict[str, Any] | str) -> Path:
        path = self.root / "epbuild.toml"
        path.write_text(data if isinstance(data, str) else render_manifest(data))
        return path

    def llm(self, family: str = "llama", **manifest: Any) -> Workspace:
        """``models/tiny`` from the LLM fixture ``family`` (kept when already there) and a
        manifest that builds it (``llmfixture.chat_manifest(**manifest)``)."""
        place_source(self.root, family)
        self.manifest(chat_manifest(**manifest))
        return self

    def build(self, *selectors: str, **kw: Any) -> Any:
        from epbuild import build

        return build(self.root, None, list(selectors), **kw)

    def cli(
        self, *args: str, check: bool = False, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        proc = waits.run([sys.executable, "-m", "epbuild", "-C", str(self.root), *args],
                         f"epbuild {' '.join(args)}", timeout=timeout)  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"epbuild {args} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def main(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """The CLI's ``main`` in this process (what ``cli`` runs, less an interpreter's start
        and imports, ~0.2 s of CPU each): for tests about what a command does, not about its
        process. Whatever it imports stays imported here: none for a command that loads
        onnxruntime (``verify``) or that a test stops with a signal."""
        import contextlib
        import io

        from epbuild.frontends.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["-C", str(self.root), *args])
        if check and code != 0:
            raise AssertionError(f"epbuild {args} failed ({code}):\n{err.getvalue()}")
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())

    def main_json(self, *args: str) -> dict[str, Any]:
        """``main(*args, "--json")``'s document."""
        return _document(self.main(*args, "--json"))

    def cli_json(self, *args: str) -> dict[str, Any]:
        return _document(self.cli(*args, "--json"))


def _document(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON document a command printed."""
    try:
        return json.loads(proc.stdout)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise AssertionError(f"no JSON ({proc.returncode}): {proc.stdout}\n{proc.stderr}") from exc


@pytest.fixture(autouse=True)
def _private_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never touch the real per-user cache; each test starts with an empty one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.delenv("EPBUILD_CACHE", raising=False)


@pytest.fixture(autouse=True)
def _cache_off(_private_user_cache: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The action cache is off unless a test turns it on (``cache=`` / ``--cache``, or
    ``monkeypatch.delenv("EPBUILD_CACHE")``): tests that expect compiles get compiles.
    Runs after ``_private_user_cache`` (which clears EPBUILD_CACHE) by depending on it."""
    monkeypatch.setenv("EPBUILD_CACHE", "off")


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    """An empty workspace directory."""
    return Workspace(tmp_path / "ws")


def write_simple(workspace: Workspace, **group_overrides: Any) -> Workspace:
    """A sharing pair (a, b) and a single model (c) for one HTP target, unbuilt."""
    import numpy as np

    w = np.random.default_rng(7).standard_normal((32, 32), dtype=np.float32) * 0.1
    workspace.model("models/a.onnx", matmul_model(1, shared=w))
    workspace.model("models/b.onnx", matmul_model(2, shared=w, batch=4))
    workspace.model("models/c.onnx", matmul_model(3))
    workspace.manifest(
        {
            "providers": {"htp": HTP73},
            "groups": {
                "pair": {"models": ["models/a.onnx", "models/b.onnx"], "providers": ["htp"],
                         "share_weights": True, **group_overrides},
                "single": {"models": ["models/c.onnx"], "providers": ["htp"]},
            },
        }
    )  # fmt: skip
    return workspace


@pytest.fixture
def simple_ws(workspace: Workspace) -> Callable[..., Workspace]:
    """A workspace with a sharing pair and a single model for one HTP target."""

    def make(**group_overrides: Any) -> Workspace:
        return write_simple(workspace, **group_overrides)

    return make


# ---------------------------------------------------------------------------------------
# Waits and bounds on a busy machine (tests/waits.py; README "Running the tests")
#
# Every wait in a test is for an event, with a deadline scaled by EPBUILD_TEST_TIMEOUT_SCALE
# (waits.scale); so is every test's pytest-timeout bound. epbuild's own processes dump their
# Python stacks on SIGUSR1 into one directory per session, which an expired wait shows.


@pytest.fixture(autouse=True, scope="session")
def _session_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stack dumps on for epbuild's processes (tests/waits.py). Keeps module- and
    session-scoped fixtures (set up before the per-test
    ``_private_user_cache``) off the real per-user cache: a build there restored whatever an
    older checkout had cached under the same key (test_ortcompat's ctx lost its
    ep_compatibility_info that way)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(waits.STACKS_VAR, str(tmp_path_factory.mktemp("stacks")))
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        mp.setenv("EPBUILD_CACHE", "off")
        yield


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the processes the tests start. A shell starts a background job (``cmd &``
    without job control: CI runners, ``nohup``, scripts) with SIGINT ignored, its children
    inherit that, and a Python started with SIGINT ignored never raises KeyboardInterrupt:
    every test that stops a build or a watcher with SIGINT then waited out its deadline. A
    handler (unlike "ignored") is reset to the default in a child, which restores it."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scale each test's pytest-timeout bound (its ``timeout`` marker, else the ini's)."""
    factor = waits.scale()
    if factor == 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is None:
            base = default
        else:
            base = float(marker.args[0] if marker.args else marker.kwargs.get("timeout", 0))
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * factor), append=False)


@pytest.fixture(scope="module")
def frozen_heap() -> Iterator[Callable[[], None]]:
    """``gc.freeze()`` what exists now; yields ``gc.collect``, which then scans only what came
    after: cheap enough to call after every example of a property test, so that an unclosed
    file (or socket, or pipe) warns in the example that left it, not in a later test."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield gc.collect
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------------------------------
# Built workspaces made once per session (the inner loop: compile once, copy per test)


@pytest.fixture(scope="session")
def built_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, Callable[[Workspace], None], Workspace], Workspace]:
    """``built_once(name, make, workspace)``: the first call runs ``make`` (write models and
    a manifest, build) in a workspace of the session's own; every call copies that built
    workspace to ``workspace.root`` (a test's own copy to change at will). A copy is up to
    date: records are relative and digests decide, so only the stat cache misses once."""
    import shutil

    made: dict[str, Path] = {}

    def copy(name: str, make: Callable[[Workspace], None], workspace: Workspace) -> Workspace:
        if name not in made:
            template = Workspace(tmp_path_factory.mktemp(f"built-{name}") / "ws")
            with pytest.MonkeyPatch.context() as mp:  # the test's env is not set up yet
                mp.setenv("XDG_CACHE_HOME", str(template.root.parent / "xdg-cache"))
                mp.setenv("EPBUILD_CACHE", "off")
                make(template)
            made[name] = template.root
        shutil.copytree(made[name], workspace.root, symlinks=True)
        return workspace

    return copy


def _build_simple(ws: Workspace) -> None:
    from epbuild.results import Outcome

    result = write_simple(ws).build()
    assert result.ok, [(a.id, a.error) for a in result.actions if a.error]
    assert result.count(Outcome.COMPILED) == 2  # the pair (one action) and the single


@pytest.fixture
def simple_built(
    built_once: Callable[[str, Callable[[Workspace], None], Workspace], Workspace],
    workspace: Workspace,
) -> Workspace:
    """``simple_ws()`` built: the test's own copy of a build made once per session (three
    compiles saved per test). Its first status or build re-hashes (new inodes) and finds
    everything up to date."""
    return built_once("simple", _build_simple, workspace)


def _build_llm(ws: Workspace) -> None:
    ws.llm()
    ws.cli("build", check=True)


@pytest.fixture
def llm_built(
    built_once: Callable[[str, Callable[[Workspace], None], Workspace], Workspace],
    workspace: Workspace,
) -> Workspace:
    """``workspace.llm()`` built (prepared, two compiles, packaged): the test's own copy of a
    build made once per session."""
    return built_once("llm", _build_llm, workspace)
