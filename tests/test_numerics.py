"""``verify --numerics``: each ctx model against its source, on this host's emulated HTP."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import HTP73, Workspace
from modelgen import _model, matmul_model
from onnx import helper, numpy_helper

from epbuild.errors import ManifestError
from epbuild.inspection.verify import verify_outputs
from epbuild.manifest.load import load_manifest
from epbuild.results import CheckStatus, Outcome


def overflow_model(n: int = 32) -> object:
    """x @ W (about 1e5: beyond fp16's 65504) → Relu → @ V (about 1e-3): fine in fp32."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n)).astype(np.float32) * 30000
    v = rng.standard_normal((n, n)).astype(np.float32) * 1e-3
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "V"], ["y"])]  # fmt: skip
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")]
    return _model(nodes, inits, [1, n], [1, n])


@pytest.fixture
def built(workspace: Workspace) -> Callable[..., Workspace]:
    def make(numerics: dict[str, object] | None = None) -> Workspace:
        w = np.random.default_rng(7).standard_normal((32, 32), dtype=np.float32) * 0.1
        workspace.model("m/a.onnx", matmul_model(1, shared=w))
        workspace.model("m/b.onnx", matmul_model(2, shared=w))
        workspace.model("m/c.onnx", matmul_model(3))
        workspace.model("m/big.onnx", overflow_model())
        single = {"models": ["m/c.onnx"], "providers": ["htp"]}
        if numerics:
            single["numerics"] = numerics
        workspace.manifest({"providers": {"htp": HTP73}, "groups": {
            "pair": {"models": ["m/a.onnx", "m/b.onnx"], "providers": ["htp"],
                     "share_weights": True},
            "single": single,
            "big": {"models": ["m/big.onnx"], "providers": ["htp"]}}})  # fmt: skip
        assert workspace.build().ok
        return workspace

    return make


def by_model(result: object) -> dict[str, object]:
    return {c.model.rsplit("/", 1)[-1]: c for c in result.numerics}  # type: ignore[attr-defined]


@pytest.mark.slow
def test_figures_failures_and_limits(built: Callable[..., Workspace]) -> None:
    ws = built()
    result = verify_outputs(ws.root, numerics=True)
    checks = by_model(result)
    good = checks["c_ctx.onnx"]
    assert good.status is CheckStatus.OK and not good.cached
    (out,) = good.outputs
    assert out["name"] == "y" and 0 < out["max_rel"] < 1e-2 and out["cosine"] > 0.9999
    assert out["argmax"] == 1.0  # [1, 32]: logits-like, the argmax agrees
    # an fp16 overflow: the check fails naming the output
    bad = checks["big_ctx.onnx"]
    assert bad.status is CheckStatus.FAILED and bad.reason.startswith("output y: ")
    assert not result.ok
    # a sharing group cannot run here: not checkable, with the reason, never ok
    for name in ("a_ctx.onnx", "b_ctx.onnx"):
        assert checks[name].status is CheckStatus.NOT_CHECKABLE
        assert "weight-shared" in checks[name].reason
    # the CLI: exit 1, the failing output named; JSON per the shape
    proc = ws.cli("verify", "--numerics")
    assert proc.returncode == 1
    assert "build/big/htp/big_ctx.onnx: numerics: output y: max_abs" in proc.stdout
    doc = json.loads(ws.cli("verify", "--numerics", "--json").stdout)
    entry = next(n for n in doc["numerics"] if n["model"].endswith("c_ctx.onnx"))
    assert entry["status"] == "ok" and entry["action"] == "single/htp/c"
    assert {"name", "max_abs", "max_rel", "cosine"} <= set(entry["outputs"][0])


def test_a_second_run_runs_nothing_and_tolerances_rejudge(
    built: Callable[..., Workspace],
) -> None:
    ws = built()
    first = by_model(verify_outputs(ws.root, selectors=["single"], numerics=True))["c_ctx.onnx"]
    again = by_model(verify_outputs(ws.root, selectors=["single"], numerics=True))["c_ctx.onnx"]
    assert again.cached and again.outputs == first.outputs
    # a tolerance is not in the key: the recorded figures are judged again
    text = (ws.root / "epbuild.toml").read_text()
    text = text.replace('providers = ["htp"]\n\n[groups.big]',
                        'providers = ["htp"]\nnumerics = { atol = 0.0, rtol = 1e-9 }\n\n'
                        "[groups.big]")  # fmt: skip
    (ws.root / "epbuild.toml").write_text(text)
    strict = by_model(verify_outputs(ws.root, selectors=["single"], numerics=True))["c_ctx.onnx"]
    assert strict.cached and strict.status is CheckStatus.FAILED
    assert "allowed 1e-09" in strict.reason


@pytest.mark.slow
def test_sample_inputs_are_part_of_the_key(built: Callable[..., Workspace]) -> None:
    ws = built({"inputs": "samples/*.npz"})
    samples = ws.root / "samples"
    samples.mkdir()
    rng = np.random.default_rng(1)
    np.savez(samples / "one.npz", x=rng.standard_normal((1, 32)).astype(np.float32))
    first = by_model(verify_outputs(ws.root, selectors=["single"], numerics=True))["c_ctx.onnx"]
    assert first.status is CheckStatus.OK and not first.cached
    np.savez(samples / "one.npz", x=(rng.standard_normal((1, 32)) * 3).astype(np.float32))
    second = by_model(verify_outputs(ws.root, selectors=["single"], numerics=True))["c_ctx.onnx"]
    assert not second.cached and second.outputs != first.outputs
    np.savez(samples / "two.npz", y=np.zeros((1, 32), np.float32))
    third = by_model(verify_outputs(ws.root, selectors=["single"], numerics=True))["c_ctx.onnx"]
    assert third.status is CheckStatus.FAILED
    assert "two.npz has no array named 'x'" in third.reason


@pytest.mark.parametrize(
    ("numerics", "key"),
    [('{ int_range = [5, 2] }', "int_range"), ('{ float_range = [0.0] }', "float_range"),
     ('{ min_cosine = 2.0 }', "min_cosine"), ('{ inputs = "../x.npz" }', "inputs"),
     ('{ rtol = -1 }', "rtol"), ('{ tol = 1 }', "tol")],
)  # fmt: skip
def test_bad_numerics_settings_name_the_key(workspace: Workspace, numerics: str, key: str) -> None:
    workspace.model("m/c.onnx", matmul_model(3))
    path = workspace.manifest(
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
        f'[groups.g]\nmodels = ["m/c.onnx"]\nproviders = ["htp"]\nnumerics = {numerics}\n'
    )
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert key in str(info.value.message) + str(info.value), str(info.value)


def test_a_model_entry_overrides_the_group(workspace: Workspace, tmp_path: Path) -> None:
    workspace.model("m/c.onnx", matmul_model(3))
    path = workspace.manifest(
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
        '[groups.g]\nproviders = ["htp"]\nnumerics = { rtol = 0.5, seed = 3 }\n'
        'models = [{ path = "m/c.onnx", numerics = { rtol = 0.1 } }]\n'
    )
    (entry,) = load_manifest(path).groups["g"].entries
    assert entry.numerics.rtol == 0.1 and entry.numerics.seed == 3


@pytest.mark.slow
def test_build_numerics_checks_what_it_built_and_detail_shows_it(workspace: Workspace) -> None:
    workspace.model("m/c.onnx", matmul_model(3))
    workspace.model("m/big.onnx", overflow_model())
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {
        "single": {"models": ["m/c.onnx"], "providers": ["htp"]},
        "big": {"models": ["m/big.onnx"], "providers": ["htp"]}}})  # fmt: skip
    proc = workspace.cli("build", "--numerics", "single")
    assert proc.returncode == 0, proc.stderr
    assert "build/single/htp/c_ctx.onnx: numerics: ok (worst output y" in proc.stdout
    proc = workspace.cli("build", "--numerics")
    assert proc.returncode == 1
    assert "big_ctx.onnx: numerics: output y: max_abs" in proc.stdout
    assert "c_ctx.onnx: numerics" not in proc.stdout  # up to date: not checked again
    doc = workspace.cli_json("status", "--detail")
    figures = {a["id"]: a["models"][0]["numerics"] for a in doc["actions"]}
    assert figures["single/htp/c"]["status"] == "ok"
    assert figures["big/htp/big"]["status"] == "failed"
    text = workspace.cli("status", "--detail").stdout
    assert "numerics: failed: output y: max_abs" in text


# ---------------------------------------------------------------------------------------
# Graph coverage: split graphs are said, and "auto" tries the lower optimisation levels


def test_a_split_graph_is_a_warning_naming_the_ops(workspace: Workspace) -> None:
    from modelgen import partial_model

    workspace.model("m/p.onnx", partial_model(1))
    group = {"models": ["m/p.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    (action,) = workspace.build().actions
    assert action.warnings == [
        "m/p.onnx: the graph is split into 2 EPContext nodes; on the CPU EP: Acos x1. Each "
        'split costs a round trip to the CPU: try graph_optimization_level = "auto", or '
        "rewrite those ops"
    ]


def test_auto_tries_lower_levels_only_where_nodes_fall_back(workspace: Workspace) -> None:
    from modelgen import partial_model

    from epbuild.inspection.detail import status_detail

    workspace.model("m/p.onnx", partial_model(1))
    workspace.model("m/c.onnx", matmul_model(3))
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/p.onnx", "m/c.onnx"], "providers": ["htp"],
        "graph_optimization_level": "auto"}}})  # fmt: skip
    result = workspace.build()
    assert result.ok
    from epbuild.state.journal import load_state

    records = load_state(str(workspace.root / ".epbuild/state.jsonl")).records
    # Acos stays on the CPU at every level: all three tried, the first (all) kept
    assert records["g/htp/p"].detail["optimization_tried"] == {
        "all": [1, 2], "basic": [1, 2], "disabled": [1, 2]}  # fmt: skip
    assert records["g/htp/p"].detail["optimization_level"] == "all"
    # nothing falls back: only "all" compiled
    assert records["g/htp/c"].detail["optimization_tried"] == {"all": [0, 1]}
    out = sorted(p.name for p in (workspace.root / "build/g/htp").iterdir())
    assert out == ["c_ctx.onnx", "c_ctx_qnn.bin", "p_ctx.onnx", "p_ctx_qnn.bin"]
    levels = {d.id: d.models[0].optimization_level for d in status_detail(workspace.root)}
    assert levels == {"g/htp/p": "all", "g/htp/c": "all"}
    assert verify_outputs(workspace.root).ok
    assert workspace.build().count(Outcome.UP_TO_DATE) == 2


def test_auto_builds_at_a_lower_level_where_all_compiles_nothing(workspace: Workspace) -> None:
    """ORT's LayerNormFusion (basic level and above) turns a rank-5 hand-written LayerNorm
    into a LayerNormalization the QNN EP refuses: at all and basic it compiles nothing (the
    action fails at a fixed level); auto goes on to disabled, where the EP takes all but
    the Sqrt, and keeps that."""
    from modelgen import rank5_layer_norm_model

    from epbuild.state.journal import load_state

    workspace.model("m/ln.onnx", rank5_layer_norm_model())
    group: dict[str, object] = {"models": ["m/ln.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    (fixed,) = workspace.build().actions
    assert fixed.outcome is Outcome.FAILED and "compiled nothing" in (fixed.error or "")
    group["graph_optimization_level"] = "auto"
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    result = workspace.build()
    assert result.ok, [a.error for a in result.actions]
    (rec,) = load_state(str(workspace.root / ".epbuild/state.jsonl")).records.values()
    tried = rec.detail["optimization_tried"]
    assert tried["all"].startswith("failed: ") and "compiled nothing" in tried["all"]
    assert tried["basic"].startswith("failed: ") and tried["disabled"] == [1, 2]
    assert rec.detail["optimization_level"] == "disabled"
    (model,) = rec.detail["models"].values()
    assert model["optimization_level"] == "disabled" and model["context_nodes"] == 2
    out = sorted(p.name for p in (workspace.root / "build/g/htp").iterdir())
    assert out == ["ln_ctx.onnx", "ln_ctx_qnn.bin"]
    assert verify_outputs(workspace.root).ok
    assert workspace.build().count(Outcome.UP_TO_DATE) == 1


@pytest.mark.slow
def test_auto_survives_a_level_the_ep_crashes_on(workspace: Workspace) -> None:
    """gpt2_dynamo (the exporter corpus) is split at all and basic; at disabled the QNN EP
    crashes the process. auto tries disabled in a process of its own and keeps all."""
    import shutil

    corpus = Path(__file__).parent / "corpus"
    (workspace.root / "m").mkdir(parents=True)
    shutil.copy(corpus / "gpt2_dynamo.onnx", workspace.root / "m")
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/gpt2_dynamo.onnx"], "providers": ["htp"],
        "free_dimensions": {"batch": 1, "sequence_length": 8},
        "graph_optimization_level": "auto"}}})  # fmt: skip
    result = workspace.build()
    assert result.ok, [a.error for a in result.actions]
    from epbuild.state.journal import load_state

    (rec,) = load_state(str(workspace.root / ".epbuild/state.jsonl")).records.values()
    tried = rec.detail["optimization_tried"]
    assert rec.detail["optimization_level"] == "all" and tried["all"][1] >= 2
    assert tried["basic"] == tried["all"] and tried["disabled"].startswith("crashed")
    assert verify_outputs(workspace.root).ok


def test_the_html_report_shows_the_last_figures(workspace: Workspace, tmp_path: Path) -> None:
    from epbuild.inspection.html import write_html_report

    workspace.model("m/c.onnx", matmul_model(3))
    group = {"models": ["m/c.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    assert workspace.build().ok
    verify_outputs(workspace.root, numerics=True)
    page = tmp_path / "r.html"
    write_html_report(workspace.root, None, [], page)
    assert "c: ok (worst output y: max_abs" in page.read_text()


def test_the_deployment_manifest_carries_each_models_figures(workspace: Workspace) -> None:
    from epbuild.shipping.package import package

    workspace.model("m/c.onnx", matmul_model(3))
    workspace.model("m/d.onnx", matmul_model(4))
    group = {"models": ["m/c.onnx", "m/d.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"g": group}})
    assert workspace.build().ok
    verify_outputs(workspace.root, selectors=["g/htp/c"], numerics=True)
    result = package(workspace.root, out="dist")
    figures = {m["name"]: m["numerics"] for a in result.deployment["actions"]
               for m in a["models"]}  # fmt: skip
    assert figures["c"]["status"] == "ok" and figures["c"]["outputs"][0]["name"] == "y"
    assert figures["d"] is None  # never checked


# ---------------------------------------------------------------------------------------
# The check is an action of the graph (kinds.check): journaled, cut off early, cached


def _one_model(workspace: Workspace) -> Workspace:
    workspace.model("m/c.onnx", matmul_model(3))
    single = {"models": ["m/c.onnx"], "providers": ["htp"]}
    workspace.manifest({"providers": {"htp": HTP73}, "groups": {"single": single}})
    assert workspace.build().ok
    return workspace


def _done_records(root: Path, action_id: str) -> list[dict[str, object]]:
    lines = (root / ".epbuild" / "state.jsonl").read_text().splitlines()
    docs = [json.loads(line) for line in lines if line.strip()]
    return [d for d in docs if d.get("op") == "done" and d.get("id") == action_id]


@pytest.mark.slow
def test_a_check_is_an_action_the_graph_cuts_off_early(workspace: Workspace) -> None:
    ws = _one_model(workspace)
    first = by_model(verify_outputs(ws.root, numerics=True))["c_ctx.onnx"]
    assert first.status is CheckStatus.OK and not first.cached
    (rec,) = _done_records(ws.root, "single/htp/c/check")
    figures = ".epbuild/checks/single/htp/c_ctx.numerics.json"
    assert list(rec["outputs"]) == [figures]  # type: ignore[call-overload]
    assert json.loads((ws.root / figures).read_text())["outcome"] == "passed"
    # a plain status neither plans the check nor calls its record orphaned
    doc = ws.cli_json("status")
    assert doc["orphaned"] == [] and {a["kind"] for a in doc["actions"]} == {"compile"}
    # the compile runs again and makes the same bytes: the check stays up to date
    (ws.root / "build/single/htp/c_ctx.onnx").unlink()
    doc = ws.cli_json("build", "--numerics")
    outcomes = {a["id"]: a["outcome"] for a in doc["actions"]}
    assert outcomes == {"single/htp/c": "compiled", "single/htp/c/check": "up_to_date"}
    assert doc["numerics"] == [] and len(_done_records(ws.root, "single/htp/c/check")) == 1
    again = by_model(verify_outputs(ws.root, numerics=True))["c_ctx.onnx"]
    assert again.cached and again.outputs == first.outputs
    # a new sample seed is a new key: the check runs again, the compile does not
    text = (ws.root / "epbuild.toml").read_text()
    (ws.root / "epbuild.toml").write_text(
        text.replace('providers = ["htp"]', 'providers = ["htp"]\nnumerics = { seed = 5 }', 1)
    )
    doc = ws.cli_json("build", "--numerics")
    outcomes = {a["id"]: a["outcome"] for a in doc["actions"]}
    assert outcomes == {"single/htp/c": "up_to_date", "single/htp/c/check": "compiled"}
    assert [n["status"] for n in doc["numerics"]] == ["ok"]
    # clean removes the figures with the compile's outputs
    ws.cli("clean", check=True)
    assert not (ws.root / figures).exists()


@pytest.mark.slow
def test_a_fresh_checkout_restores_the_check_from_the_cache(
    workspace: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    monkeypatch.setenv("EPBUILD_CACHE", str(tmp_path / "cache"))
    ws = _one_model(workspace)
    first = by_model(verify_outputs(ws.root, numerics=True))["c_ctx.onnx"]
    assert first.status is CheckStatus.OK and not first.cached
    from epbuild.cache.operations import export_cache

    report = export_cache(tmp_path / "all.tar", ws.root)  # the compile and the check it ran
    assert report.entries == 2 and report.missing == []
    clone = tmp_path / "clone"
    shutil.copytree(ws.root, clone, ignore=shutil.ignore_patterns("build", ".epbuild"))
    result = Workspace(clone).build()
    assert [a.outcome for a in result.actions] == [Outcome.RESTORED]
    restored = by_model(verify_outputs(clone, numerics=True))["c_ctx.onnx"]
    assert restored.cached and restored.status is CheckStatus.OK
    assert restored.outputs == first.outputs
    (rec,) = _done_records(clone, "single/htp/c/check")
    assert rec.get("restored")


@pytest.mark.slow
def test_a_check_the_cache_lacks_is_not_missing_from_an_export(
    workspace: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeding a new cache from a built workspace stores its compiles; the checks verify
    ran are exported where a cache holds them, never listed as missing (exit 0)."""
    from epbuild.cache.operations import export_cache

    monkeypatch.setenv("EPBUILD_CACHE", str(tmp_path / "first"))
    ws = _one_model(workspace)
    assert by_model(verify_outputs(ws.root, numerics=True))["c_ctx.onnx"].status is CheckStatus.OK
    ws.cli("build", "--cache", str(tmp_path / "second"), check=True)
    report = export_cache(tmp_path / "all.tar", ws.root, cache=str(tmp_path / "second"))
    assert report.missing == [] and report.entries == 1


@pytest.mark.slow
def test_two_numerics_checks_at_once_run_the_check_once(workspace: Workspace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    ws = _one_model(workspace)
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(verify_outputs, ws.root, numerics=True) for _ in range(2)]
        results = [r.result() for r in runs]
    checks = [by_model(r)["c_ctx.onnx"] for r in results]
    assert all(c.status is CheckStatus.OK for c in checks)
    assert checks[0].outputs == checks[1].outputs
    assert sorted(c.cached for c in checks) == [False, True]  # one ran, one took its figures
    assert len(_done_records(ws.root, "single/htp/c/check")) == 1


@pytest.mark.slow
def test_a_loader_that_dies_records_nothing(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader killed (out of memory, a timeout on a busy machine) is no verdict on the
    model: the check fails, nothing is journaled or cached, and the next run checks."""
    from epbuild.inspection import loading

    ws = _one_model(workspace)

    def killed(root: str, ctx: str, job: object, python: object, module: str = "") -> object:
        why = "the loader process died (killed by SIGKILL)"
        return loading.LoadCheck(ctx, loading.LoadOutcome.FAILED, why, died=True)  # as it reads one

    with monkeypatch.context() as m:
        m.setattr(loading, "_run_loader", killed)
        dead = by_model(verify_outputs(ws.root, numerics=True))["c_ctx.onnx"]
    assert dead.status is CheckStatus.FAILED and "killed by SIGKILL" in dead.reason
    assert _done_records(ws.root, "single/htp/c/check") == []
    again = by_model(verify_outputs(ws.root, numerics=True))["c_ctx.onnx"]
    assert again.status is CheckStatus.OK and not again.cached
