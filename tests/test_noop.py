"""The no-op fast path answers only when nothing it vouches for changed."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import waits
from conftest import Workspace
from modelgen import matmul_model

from epbuild.planning.noop import fast_noop


def _noop_ready(ws: Workspace) -> None:
    ws.cli("build", check=True)
    ws.cli("build", check=True)  # all up to date: records the fingerprint
    assert (ws.root / ".epbuild" / "noop.json").exists()


@pytest.mark.slow
def test_fast_path_answers_after_a_noop(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    _noop_ready(ws)
    doc = fast_noop(str(ws.root), None, [])
    assert doc is not None and doc["summary"]["up_to_date"] == 2
    assert fast_noop(str(ws.root), None, ["pair"]) is None  # other selectors: full path
    proc = ws.cli("build", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["summary"]["up_to_date"] == 2


def test_build_cache_new_after_a_noop_seeds_it(simple_built: Workspace, tmp_path: Path) -> None:
    """``build --cache NEW`` on an up-to-date workspace (the fast path would answer) stores
    every up-to-date action in NEW, which then restores them all after a clean."""
    from test_cache import check_consistent

    ws = simple_built
    _noop_ready(ws)
    assert fast_noop(str(ws.root), None, []) is not None
    new = tmp_path / "new-cache"
    doc = ws.main_json("build", "--cache", str(new))
    assert doc["summary"]["up_to_date"] == 2 and doc["summary"]["compiled"] == 0, doc
    assert doc["warnings"] == []
    assert sorted(e.id for e in check_consistent(new)) == ["pair/htp", "single/htp/c"]
    ws.main("clean", check=True)
    doc = ws.main_json("build", "--cache-only", "--cache", str(new))
    assert doc["summary"]["restored"] == 2 and doc["summary"]["compiled"] == 0, doc


def test_fast_path_imports_nothing_heavy(simple_built: Workspace) -> None:
    ws = simple_built
    _noop_ready(ws)
    code = (
        "import sys; from epbuild.frontends.cli import main; "
        "rc = main(['-C', sys.argv[1], 'build']); "
        "heavy = [m for m in ('onnx', 'onnxruntime', 'epbuild.api', 'filelock') "
        "if m in sys.modules]; "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    proc = waits.run([sys.executable, "-c", code, str(ws.root)], "the no-op build")
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


@pytest.mark.slow
def test_changed_bytes_miss_and_rebuild(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    _noop_ready(ws)
    ws.model("models/c.onnx", matmul_model(42))
    assert fast_noop(str(ws.root), None, []) is None
    doc = ws.cli_json("build")
    assert doc["summary"]["compiled"] == 1


@pytest.mark.slow
def test_touch_misses_then_records_again(simple_ws: Callable[..., Workspace]) -> None:
    ws = simple_ws()
    _noop_ready(ws)
    p = ws.root / "models" / "a.onnx"
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - 3_000_000_000))
    assert fast_noop(str(ws.root), None, []) is None
    ws.cli("build", check=True)  # full path: up to date, records a new fingerprint
    assert fast_noop(str(ws.root), None, []) is not None


@pytest.mark.slow
def test_new_glob_match_and_deleted_output_miss(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    htp = {"ep": "qnn", "options": {"soc_model": "60"}}
    group = {"models": ["m/*.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": htp}, "groups": {"g": group}})
    _noop_ready(workspace)
    workspace.model("m/b.onnx", matmul_model(5))
    assert fast_noop(str(workspace.root), None, []) is None
    assert workspace.cli_json("build")["summary"]["compiled"] == 1
    _noop_ready(workspace)
    (workspace.root / "build" / "g" / "htp" / "a_ctx_qnn.bin").unlink()
    assert fast_noop(str(workspace.root), None, []) is None
    summary = workspace.cli_json("build")["summary"]
    assert summary["compiled"] + summary.get("restored", 0) == 1


def test_manifest_edit_and_clean_miss(simple_built: Workspace) -> None:
    ws = simple_built
    _noop_ready(ws)
    manifest = ws.root / "epbuild.toml"
    manifest.write_text(manifest.read_text() + "\n# a comment\n")
    assert fast_noop(str(ws.root), None, []) is None
    _noop_ready(ws)
    assert ws.main("clean").returncode == 0
    assert fast_noop(str(ws.root), None, []) is None


def test_bad_arguments_fail_before_the_fast_path(simple_built: Workspace) -> None:
    ws = simple_built
    _noop_ready(ws)
    for args in (["-j", "0"], ["--memory-budget", "lots"], ["--cache", "c", "--no-cache"]):
        proc = ws.cli("build", *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "up to date" not in proc.stdout
    assert fast_noop(str(ws.root), None, []) is not None  # it would have answered
    proc = ws.cli("build")
    assert proc.returncode == 0 and proc.stdout.startswith("epbuild: 2 up to date in ")
