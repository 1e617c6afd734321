"""The build graph: a kind added through the kind interface alone builds, caches, restores
and shows in status; early cutoff; dependencies that fail or are missing; an LLM's
preparation on the graph (restored, never re-run, by a checkout that has a cache)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, _build_llm, write_simple

from epbuild.results import Outcome

TESTS = Path(__file__).parent
BuiltOnce = Callable[[str, Callable[[Workspace], None], Workspace], Workspace]


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The toy kinds registered (tests/toykind.py), and importable by workers."""
    import toykind

    from epbuild.kinds.contract import register, unregister

    search = [str(TESTS), os.environ.get("PYTHONPATH", "")]  # a checkout on it stays first
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, search)))
    register(toykind.LOWER, toykind.toy_actions)
    register(toykind.COUNT)
    try:
        yield
    finally:
        unregister("lower")
        unregister("count")


def _outcomes(result: Any) -> dict[str, Outcome]:
    return {a.id: a.outcome for a in result.actions}


def test_a_toy_kind_builds_caches_restores_and_shows_in_status(
    toy: None, workspace: Workspace, tmp_path: Path
) -> None:
    from epbuild import status

    write_simple(workspace)
    (workspace.root / "notes.txt").write_text("Hello World")
    cache = tmp_path / "cache"
    first = workspace.build(cache=str(cache))
    assert first.ok, [a.error for a in first.actions]
    assert _outcomes(first)["notes/lower"] is Outcome.COMPILED
    assert first.summary()["lowered"] == 1 and first.summary()["counted"] == 1
    out = workspace.root / "build" / "notes" / "text"
    assert (out / "lower.txt").read_text() == "hello world"
    assert (out / "count.txt").read_text() == "11"

    found = {a.id: a for a in status(workspace.root, cache=False).actions}
    assert found["notes/count"].kind == "count" and found["notes/count"].deps == ("notes/lower",)
    assert not found["notes/count"].stale and not found["notes/lower"].stale
    assert [a.outcome for a in workspace.build().actions] == [Outcome.UP_TO_DATE] * 4

    # Another checkout with the same sources restores every kind from the cache.
    other = Workspace(tmp_path / "other")
    write_simple(other)
    (other.root / "notes.txt").write_text("Hello World")
    restored = other.build(cache=str(cache), cache_only=True)
    assert set(_outcomes(restored).values()) == {Outcome.RESTORED}
    assert (other.root / "build" / "notes" / "text" / "count.txt").read_text() == "11"


def test_early_cutoff_an_upstream_rerun_with_the_same_bytes_rebuilds_nothing_downstream(
    simple_built: Workspace, toy: None
) -> None:
    workspace = simple_built  # write_simple's workspace built once per session, copied
    (workspace.root / "notes.txt").write_text("Hello World")
    assert workspace.build().ok
    (workspace.root / "notes.txt").write_text("HELLO WORLD")  # the same lower-cased copy
    again = _outcomes(workspace.build())
    assert again["notes/lower"] is Outcome.COMPILED
    assert again["notes/count"] is Outcome.UP_TO_DATE
    (workspace.root / "notes.txt").write_text("Hello, World")  # another copy: count runs
    third = _outcomes(workspace.build())
    assert third["notes/count"] is Outcome.COMPILED
    assert (workspace.root / "build/notes/text/count.txt").read_text() == "12"


def test_a_failed_action_skips_its_dependents_and_k_builds_the_rest(
    toy: None, workspace: Workspace
) -> None:
    write_simple(workspace)
    (workspace.root / "notes.txt").write_text("FAIL")
    result = workspace.build(keep_going=True)
    by_id = {a.id: a for a in result.actions}
    assert by_id["notes/lower"].outcome is Outcome.FAILED
    assert "the toy refuses FAIL" in (by_id["notes/lower"].error or "")
    assert by_id["notes/count"].outcome is Outcome.SKIPPED
    assert by_id["notes/count"].error == (
        "not started because notes/lower, which it depends on, failed"
    )
    assert by_id["pair/htp"].outcome is Outcome.COMPILED  # an independent branch
    assert result.exit_code == 1


def test_selecting_an_action_takes_along_what_it_depends_on(
    toy: None, workspace: Workspace
) -> None:
    write_simple(workspace)
    (workspace.root / "notes.txt").write_text("abc")
    result = workspace.build("notes/count")
    assert sorted(_outcomes(result)) == ["notes/count", "notes/lower"]


@pytest.mark.parametrize(
    ("deps", "message"),
    [
        ({"notes/lower": ("notes/count",)}, "depend on each other in a circle"),
        ({"notes/lower": ("notes/nowhere",)}, "depends on notes/nowhere, which is not an action"),
    ],
)
def test_a_cycle_or_a_missing_dependency_is_a_planning_error(
    toy: None,
    workspace: Workspace,
    monkeypatch: pytest.MonkeyPatch,
    deps: dict[str, tuple[str, ...]],
    message: str,
) -> None:
    import dataclasses

    import toykind

    from epbuild.errors import UserError

    made = toykind.toy_actions

    def broken(manifest: Any) -> list[Any]:
        return [dataclasses.replace(a, deps=deps.get(a.id, a.deps)) for a in made(manifest)]

    monkeypatch.setattr(toykind, "toy_actions", broken)
    from epbuild.kinds.contract import register

    register(toykind.LOWER, toykind.toy_actions)
    write_simple(workspace)
    (workspace.root / "notes.txt").write_text("abc")
    with pytest.raises(UserError, match=message):
        workspace.build()


# ---------------------------------------------------------------------------------------
# An LLM's preparation on the graph


def _summary(proc: Any) -> dict[str, Any]:
    return json.loads(proc.stdout)["summary"]  # type: ignore[no-any-return]


def test_a_checkout_with_a_cache_restores_the_preparation_and_never_runs_it(
    workspace: Workspace, tmp_path: Path
) -> None:
    workspace.llm()
    cache = str(tmp_path / "cache")
    built = workspace.main("build", "--cache", cache, "--json")
    assert _summary(built)["prepared"] == 1 and _summary(built)["compiled"] == 2, built.stderr

    other = Workspace(tmp_path / "checkout")
    shutil.copytree(workspace.root / "models", other.root / "models")
    shutil.copy(workspace.root / "epbuild.toml", other.root / "epbuild.toml")
    # The CI cache key is known before anything is built, and is the built workspace's.
    key = other.main("cache", "key").stdout
    assert key.startswith("epbuild-") and key == workspace.main("cache", "key").stdout
    # Commands that only read: nothing prepared, nothing written for the LLM.
    for args in (["status"], ["cache", "prune", "--max-size", "10G", "--cache", cache],
                 ["cache", "verify", "--cache", cache], ["cache", "key"]):  # fmt: skip
        proc = other.main(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert not (other.root / ".epbuild" / "llm").exists(), args
    restored = other.main("build", "--cache", cache, "--cache-only", "--json")
    assert restored.returncode == 0, restored.stderr
    actions = {a["id"]: a["outcome"] for a in json.loads(restored.stdout)["actions"]}
    assert actions == {
        "chat/prepare": "restored",
        "chat/htp-v73/context": "restored",
        "chat/htp-v73/iterator": "restored",
        "chat/htp-v73/package": "restored",
    }
    assert "prepared" not in restored.stderr  # no preparation ran
    prepared = other.root / ".epbuild" / "llm" / "chat" / "prepared"
    assert (prepared / "context.onnx").read_bytes() == (
        workspace.root / ".epbuild" / "llm" / "chat" / "prepared" / "context.onnx"
    ).read_bytes()


def test_a_preparation_with_the_same_graphs_compiles_nothing(llm_built: Workspace) -> None:
    """Early cutoff on a real preparation: a node the static graphs drop (dead code in the
    source) prepares again, and the compiles stay up to date."""
    import onnx
    from onnx import helper

    workspace = llm_built  # workspace.llm() built once per session, copied
    source = workspace.root / "models" / "tiny" / "model.onnx"
    model = onnx.load(source, load_external_data=False)
    model.graph.node.append(helper.make_node("Identity", [model.graph.input[0].name], ["dead"]))
    onnx.save(model, source)
    again = workspace.main("build", "--json")
    summary = _summary(again)
    assert summary["prepared"] == 1 and summary["compiled"] == 0 and summary["up_to_date"] == 3


def test_a_preparation_is_stored_in_the_cache_by_hard_links(
    llm_built: Workspace, tmp_path: Path
) -> None:
    """The state directory's outputs are epbuild's own: the cache's objects are the very
    files (the same inodes, read-only), not copies; the package in out_dir is copied."""
    import onnx
    from onnx import helper

    from epbuild.cache.store import object_path
    from epbuild.state.journal import load_state

    workspace = llm_built  # workspace.llm() built once per session, copied
    source = workspace.root / "models" / "tiny" / "model.onnx"
    model = onnx.load(source, load_external_data=False)
    model.graph.node.append(helper.make_node("Identity", [model.graph.input[0].name], ["dead"]))
    onnx.save(model, source)
    cache = tmp_path / "cache"
    assert _summary(workspace.main("build", "--json", "--cache", str(cache)))["prepared"] == 1
    state = load_state(str(workspace.root / ".epbuild" / "state.jsonl"))
    prepared = state.records["chat/prepare"].outputs
    files: dict[str, dict[int, int]] = {}  # digest → inode → mode (two graphs' data alike)
    for rel, out in prepared.items():
        if not rel.endswith(".data"):  # the weights: written first, long vouched for at commit
            continue
        st = (workspace.root / rel).stat()
        files.setdefault(out.digest, {})[st.st_ino] = st.st_mode
    assert files
    for digest, modes in files.items():
        ino = (cache / object_path(digest)).stat().st_ino
        assert ino in modes and modes[ino] & 0o222 == 0, digest


# ---------------------------------------------------------------------------------------
# One record type for the journal and the cache


def test_cache_entries_and_journal_records_share_one_record_and_codec() -> None:
    from epbuild.cache.store import entry_bytes, parse_entry
    from epbuild.state.journal import ActionRecord, OutputRecord

    digest = "ab" * 32
    record = ActionRecord(
        "g/p/m", "k" * 64, {"ep": "qnn"}, {"build/g/p/m_ctx.onnx": OutputRecord(3, digest)},
        1.5, 7, 100.0, {"models": {}},
    )  # fmt: skip
    assert ActionRecord.from_json(record.to_json()) == record  # the journal's round trip
    entry = parse_entry(entry_bytes(record.named()), record.key)  # the cache's
    assert entry == record.named() and entry.placed("build/g/p") == record
    # An entry written before the fold (no "at", "restored") still reads.
    old = {"epbuild_cache_entry": 1, "key": record.key, "id": "g/p/m", "components": {},
           "outputs": {"m_ctx.onnx": {"size": 3, "digest": digest}}, "seconds": 1.0,
           "peak_rss": 0, "detail": {}, "created": 50.0}  # fmt: skip
    assert parse_entry(json.dumps(old).encode(), record.key).at == 50.0


def test_an_edited_or_missing_package_file_is_named_refused_and_repaired(
    llm_built: Workspace,
) -> None:
    workspace = llm_built  # workspace.llm() built once per session, copied
    out = workspace.root / "build" / "chat" / "htp-v73"
    good = (out / "genai_config.json").read_bytes()
    (out / "genai_config.json").write_text(good.decode().replace('"top_k"', '"top_p"'))
    (out / "tokenizer.json").unlink()
    status = workspace.main("status").stdout
    assert "stale       chat/htp-v73/package" in status
    assert "output build/chat/htp-v73/genai_config.json was modified" in status
    assert "output build/chat/htp-v73/tokenizer.json is missing" in status
    verify = workspace.cli("verify")
    assert verify.returncode == 1
    assert "genai_config.json: content does not match the digest" in verify.stdout
    package = workspace.main("package", "-o", "dist")
    assert package.returncode != 0 and "chat/htp-v73/package" in package.stderr
    assert not (workspace.root / "dist").exists()
    repaired = workspace.main("build", "--json")
    assert _summary(repaired)["packaged"] == 1 and _summary(repaired)["compiled"] == 0
    assert (out / "genai_config.json").read_bytes() == good and (out / "tokenizer.json").is_file()


@pytest.fixture
def switched(built_once: BuiltOnce, workspace: Workspace) -> Workspace:
    """An LLM built without share_weights, then with it: the iterator's binary is left.
    Made once per session from the session's ``llm_built`` (built without share_weights);
    the test's own copy."""

    def switch_to_sharing(ws: Workspace) -> None:
        built_once("llm", _build_llm, ws)  # workspace.llm(share=False), built
        ws.llm(share=True)
        assert ws.main("build").returncode == 0

    return built_once("llm-switched-to-sharing", switch_to_sharing, workspace)


def test_clean_orphaned_removes_only_what_no_action_owns(switched: Workspace) -> None:
    """Switching an LLM to share_weights leaves the iterator's binary behind, referenced by
    nothing: status says how much it holds, clean --orphaned removes it and nothing else."""
    workspace = switched  # built without share_weights, then with it (once per session)
    out = workspace.root / "build" / "chat" / "htp-v73"
    left = out / "iterator_ctx_qnn.bin"
    before = sorted(p.name for p in out.iterdir())
    doc = workspace.main_json("status")
    assert doc["orphaned"] == ["chat/htp-v73/context", "chat/htp-v73/iterator"]
    assert doc["orphaned_bytes"] == left.stat().st_size > 0
    assert "'epbuild clean --orphaned' removes them" in workspace.main("status").stdout
    assert workspace.main("clean", "--orphaned", "chat").returncode == 2  # no selectors
    removed = workspace.main_json("clean", "--orphaned")["removed"]
    assert removed == ["build/chat/htp-v73/iterator_ctx_qnn.bin"]
    assert sorted(p.name for p in out.iterdir()) == sorted(set(before) - {left.name})
    after = workspace.main_json("status")
    assert after["orphaned"] == [] and after["orphaned_bytes"] == 0
    assert all(not a["stale"] for a in after["actions"])


def test_the_html_report_draws_the_graph_with_states_and_times(
    simple_built: Workspace, toy: None, tmp_path: Path
) -> None:
    from epbuild.inspection.html import write_html_report

    workspace = simple_built  # write_simple's workspace built once per session, copied
    (workspace.root / "notes.txt").write_text("Hello")
    assert workspace.build().ok
    (workspace.root / "notes.txt").write_text("Hello again")  # both toy actions go stale
    page = tmp_path / "report.html"
    write_html_report(workspace.root, None, [], page)
    text = page.read_text()
    svg = text[text.index('<div id="graph">') : text.index("<h2>Last build</h2>")]
    ids = ["pair/htp", "single/htp/c", "notes/lower", "notes/count"]
    assert all(f'data-id="{i}"' in svg for i in ids)
    assert svg.count("<line ") == 1  # notes/lower → notes/count
    assert "lower · stale" in svg and "compile · up to date" in svg
    assert "lowered in " in svg and "compiled in " in svg


def test_two_clean_orphaned_at_once_remove_the_file_once(switched: Workspace) -> None:
    import subprocess
    import sys

    workspace = switched  # built without share_weights, then with it (once per session)
    command = [sys.executable, "-m", "epbuild", "-C", str(workspace.root), "clean",
               "--orphaned", "--json"]  # fmt: skip
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    removed: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "Traceback" not in err, err
        removed += json.loads(out)["removed"]
    assert removed == ["build/chat/htp-v73/iterator_ctx_qnn.bin"]  # by one of the two
    after = workspace.main_json("status")
    assert after["orphaned"] == [] and all(not a["stale"] for a in after["actions"])
