"""``epbuild add`` and ``epbuild init --from``: edits keep the user's text, bad edits change
nothing, and what ``init --from`` writes builds with the real QNN EP."""

from __future__ import annotations

import difflib
import os
import stat
from pathlib import Path

import onnx
import pytest
from conftest import Workspace
from modelgen import matmul_model, save

from epbuild.frontends.args import option_value
from epbuild.frontends.cli import main
from epbuild.manifest.load import load_manifest

HAND_WRITTEN = """\
# Project manifest, written by hand.
[workspace]
out_dir = "out"   # beside the models

# Targets we ship.
[providers.htp]  # the laptop
ep = "qnn"
options = { htp_arch = "73", soc_model = "60" }   # X Elite
# compiler = "session"

# The LLM pair.
[groups.llm]
models = [
    "models/a.onnx",  # prefill
    # decode comes next
    "models/b.onnx",
]
providers = ["htp"]     # one target for now
share_weights = true

# Vision model.
[groups.vision]
models = ["models/c.onnx"]   # the CNN
providers = [ "htp" ]
embed_mode = 1
# node_name_prefix = "cnn_"
"""


@pytest.fixture
def ws(workspace: Workspace) -> Workspace:
    """The hand-written manifest over four tiny models (d.onnx is in no group yet)."""
    for i, name in enumerate("abcd"):
        workspace.model(f"models/{name}.onnx", matmul_model(i))
    workspace.manifest(HAND_WRITTEN)
    return workspace


def run(ws: Workspace, *args: str) -> tuple[int, str, str]:
    """``epbuild -C ws ARGS...`` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["-C", str(ws.root), *args])
    return rc, out.getvalue(), err.getvalue()


def changes(before: str, after: str) -> tuple[list[str], list[str]]:
    """(lines removed, lines added): every other line is byte-identical and in order."""
    removed, added = [], []
    for line in difflib.ndiff(before.splitlines(), after.splitlines()):
        if line.startswith("- "):
            removed.append(line[2:])
        elif line.startswith("+ "):
            added.append(line[2:])
    return removed, added


def text(ws: Workspace) -> str:
    return (ws.root / "epbuild.toml").read_text()


def test_add_model_to_groups_keeps_comments_in_and_around_arrays(ws: Workspace) -> None:
    rc, out, _ = run(ws, "add", "model", "models/d.onnx", "--group", "llm")
    assert rc == 0 and "added models/d.onnx to group llm" in out
    assert changes(HAND_WRITTEN, text(ws)) == ([], ['    "models/d.onnx",'])
    after_llm = text(ws)
    rc, _, _ = run(ws, "add", "model", "models/d.onnx", "--group", "vision")
    assert rc == 0
    assert changes(after_llm, text(ws)) == (
        ['models = ["models/c.onnx"]   # the CNN'],
        ['models = ["models/c.onnx", "models/d.onnx"]   # the CNN'],
    )
    groups = load_manifest(ws.root / "epbuild.toml").groups
    assert [e.path for e in groups["llm"].entries][-1] == "models/d.onnx"


def test_add_model_already_listed_or_matched_changes_nothing(ws: Workspace) -> None:
    rc, out, _ = run(ws, "add", "model", "models/a.onnx", "--group", "llm")
    assert rc == 0 and "skipped models/a.onnx: already listed in group llm" in out
    assert "nothing to change" in out and text(ws) == HAND_WRITTEN
    ws.manifest(HAND_WRITTEN.replace('"models/c.onnx"]', '"models/[cd].onnx"]'))
    before = text(ws)
    rc, out, _ = run(ws, "add", "model", "models/d.onnx", "-g", "vision")
    assert rc == 0 and "already matched by 'models/[cd].onnx'" in out
    assert text(ws) == before


def test_add_model_new_group_paths_relative_to_the_current_directory(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ws.root / "models")
    rc = main(["-f", "../epbuild.toml", "add", "model", "d.onnx", "-g", "extra", "--share-weights"])
    assert rc == 0
    removed, added = changes(HAND_WRITTEN, text(ws))
    assert removed == []
    assert added == [
        "",
        "[groups.extra]",
        'models = ["models/d.onnx"]',
        'providers = ["htp"]',
        "share_weights = true",
    ]
    tail = '# node_name_prefix = "cnn_"\n\n[groups.extra]\n' + "\n".join(added[2:]) + "\n"
    assert text(ws).endswith(tail)


def test_new_group_with_several_providers_needs_provider(ws: Workspace) -> None:
    assert run(ws, "add", "provider", "v75", "--ep", "qnn", "--option", "htp_arch=75")[0] == 0
    before = text(ws)
    rc, _, err = run(ws, "add", "model", "models/d.onnx", "-g", "extra")
    assert rc == 2 and "pass --provider" in err and "htp, v75" in err
    assert text(ws) == before
    rc, _, _ = run(ws, "add", "model", "models/d.onnx", "-g", "extra", "-p", "v75")
    assert rc == 0 and load_manifest(ws.root / "epbuild.toml").groups["extra"].providers == ("v75",)


def test_add_provider_goes_after_the_last_provider_above_the_next_comment(ws: Workspace) -> None:
    rc, out, _ = run(
        ws,
        "add",
        "provider",
        "v75",
        "--ep",
        "qnn",
        "--option",
        "htp_arch=75",
        "--option",
        "soc_model=57",
    )
    assert rc == 0 and "added provider v75" in out
    new = ["", "[providers.v75]", 'ep = "qnn"', "options = { htp_arch = 75, soc_model = 57 }"]
    assert changes(HAND_WRITTEN, text(ws)) == ([], new)
    assert '# compiler = "session"\n\n[providers.v75]\n' in text(ws)
    assert "soc_model = 57 }\n\n# The LLM pair.\n[groups.llm]" in text(ws)
    provider = load_manifest(ws.root / "epbuild.toml").providers["v75"]
    assert provider.options == {"backend_type": "htp", "htp_arch": "75", "soc_model": "57"}


def test_replace_provider_keeps_its_comments(ws: Workspace) -> None:
    rc, _, _ = run(
        ws,
        "add",
        "provider",
        "htp",
        "--ep",
        "qnn",
        "--replace",
        "--option",
        "htp_arch=75",
        "--option",
        "soc_model=57",
    )
    assert rc == 0
    removed, added = changes(HAND_WRITTEN, text(ws))
    assert removed == ['options = { htp_arch = "73", soc_model = "60" }   # X Elite']
    assert len(added) == 1 and added[0].startswith("options = { htp_arch = 75, soc_model = 57 }")


def test_add_target_known_soc_to_every_group_then_again_is_a_no_op(ws: Workspace) -> None:
    rc, out, _ = run(ws, "add", "target", "snapdragon-8-gen-3")
    assert rc == 0 and "group llm is now also built for snapdragon-8-gen-3" in out
    removed, added = changes(HAND_WRITTEN, text(ws))
    assert removed == ['providers = ["htp"]     # one target for now', 'providers = [ "htp" ]']
    assert added == [
        "[providers.snapdragon-8-gen-3]  # Snapdragon 8 Gen 3 (SM8650): HTP v75",
        'ep = "qnn"',
        'options = { htp_arch = "75", soc_model = "57" }',
        "",
        'providers = ["htp", "snapdragon-8-gen-3"]     # one target for now',
        'providers = [ "htp", "snapdragon-8-gen-3" ]',
    ]
    after = text(ws)
    rc, out, _ = run(ws, "add", "target", "SM8650", "--name", "snapdragon-8-gen-3")
    assert rc == 0 and "nothing to change" in out and text(ws) == after


def test_add_target_described_to_one_group(ws: Workspace) -> None:
    rc, _, _ = run(
        ws,
        "add",
        "target",
        "v79",
        "--ep",
        "qnn",
        "--option",
        "htp_arch=79",
        "--option",
        "soc_model=69",
        "--to",
        "vision",
    )
    assert rc == 0
    m = load_manifest(ws.root / "epbuild.toml")
    assert m.groups["vision"].providers == ("htp", "v79")
    assert m.groups["llm"].providers == ("htp",)
    assert m.providers["v79"].options["htp_arch"] == "79"


BAD_EDITS = [
    (["add", "provider", "x", "--ep", "nope"], "'nope' is not a known provider adapter"),
    (["add", "provider", "x", "--ep", "qnn", "--option", "foo=1"],
     "providers.x.options.foo: unknown provider option 'foo'"),
    (["add", "provider", "x", "--ep", "qnn", "--option", "htp_arch=12"],
     "htp_arch '12' is not a known value"),
    (["add", "provider", "x", "--ep", "qnn", "--option", "htp_arch"], "is not KEY=VALUE"),
    (["add", "provider", "x", "--ep", "qnn", "--option", "=1"], "is not KEY=VALUE"),
    (["add", "provider", "x", "--ep", "qnn", "--option", "a=1", "--option", "a=2"],
     "given twice"),
    (["add", "provider", "htp", "--ep", "qnn"], "provider 'htp' already exists (" ),
    (["add", "provider", "bad name", "--ep", "qnn"], "is not a valid name"),
    (["add", "model", "models/missing.onnx", "-g", "llm"], "'models/missing.onnx' does not exist"),
    (["add", "model", "models/missing.onnx", "-g", "new"], "'models/missing.onnx' does not exist"),
    (["add", "model", "../outside.onnx", "-g", "llm"], "is outside the workspace"),
    (["add", "model", "out/a_ctx.onnx", "-g", "llm"], "is inside the output directory 'out'"),
    (["add", "model", ".epbuild/x.onnx", "-g", "new"], "is inside the state directory"),
    (["add", "model", "models/d.onnx", "-g", "new", "-p", "nope"],
     "provider 'nope' is not defined"),
    (["add", "model", "models/d.onnx", "-g", "vision", "--share-weights"],
     "embed_mode = 1 cannot be combined with share_weights"),
    (["add", "model", "models/d.onnx"], "pass --group"),
    (["add", "target", "nowhere"], "'nowhere' is not a target epbuild knows"),
    (["add", "target", "v75", "--ep", "qnn", "--option", "htp_arch=75", "--option",
      "soc_model=69"], "soc_model '69' is the Snapdragon 8 Elite (SM8750), an HTP v79 chip"),
    (["add", "target", "snapdragon-8-elite", "--to", "nogroup"], "group 'nogroup' is not defined"),
    (["add", "target", "snapdragon-8-elite", "--ep", "openvino"], "its provider is qnn"),
    (["add", "target", "snapdragon-8-elite", "--name", "htp"], "provider 'htp' already exists"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD_EDITS, ids=[" ".join(a) for a, _ in BAD_EDITS])
def test_bad_edit_leaves_the_file_byte_identical(
    ws: Workspace, args: list[str], message: str
) -> None:
    (ws.root.parent / "outside.onnx").write_bytes((ws.root / "models/a.onnx").read_bytes())
    before = (ws.root / "epbuild.toml").read_bytes()
    rc, _, err = run(ws, *args)
    assert rc == 2, err
    assert (ws.root / "epbuild.toml").read_bytes() == before
    lines = err.strip().splitlines()
    assert lines[0].startswith("epbuild: error: ") and message in lines[0], err
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("  hint: "))
    # No temp file left (the state directory holds the edit lock).
    left = sorted(os.listdir(ws.root))
    assert left in (["epbuild.toml", "models"], [".epbuild", "epbuild.toml", "models"])


def test_bad_edit_through_the_console_script_has_no_traceback(ws: Workspace) -> None:
    before = (ws.root / "epbuild.toml").read_bytes()
    proc = ws.cli("add", "provider", "v", "--ep", "qnn", "--option", "vtcm=8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown provider option 'vtcm'" in proc.stderr and "left unchanged" in proc.stderr
    assert (ws.root / "epbuild.toml").read_bytes() == before


def test_edit_of_invalid_toml_says_where(ws: Workspace) -> None:
    ws.manifest(HAND_WRITTEN.replace('ep = "qnn"', 'ep = "qnn'))
    before = (ws.root / "epbuild.toml").read_bytes()
    rc, _, err = run(ws, "add", "target", "snapdragon-8-elite")
    assert rc == 2 and "epbuild.toml:7: invalid TOML" in err
    assert (ws.root / "epbuild.toml").read_bytes() == before


def test_edit_keeps_mode_and_edits_through_a_symlink(ws: Workspace) -> None:
    real = ws.root / "real.toml"
    (ws.root / "epbuild.toml").rename(real)
    (ws.root / "epbuild.toml").symlink_to("real.toml")
    real.chmod(0o640)
    assert run(ws, "add", "target", "snapdragon-8-elite")[0] == 0
    assert (ws.root / "epbuild.toml").is_symlink()
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert "[providers.snapdragon-8-elite]" in real.read_text()


def test_option_values() -> None:
    assert option_value("75") == 75 and option_value("-1") == -1
    assert option_value("true") is True and option_value("false") is False
    assert option_value('"75"') == "75"
    for raw in ("007", "1.5", "htp", "True", "75,73", ""):
        assert option_value(raw) == raw


def _sharing_pair(ws: Workspace) -> None:
    """models/llm/{prefill,decode}.onnx over one external-data file; models/cnn.onnx alone."""
    prefill = save(matmul_model(1), ws.root / "models/llm/prefill.onnx", external="llm.data")
    decode = onnx.load(str(prefill), load_external_data=False)  # same tensors, same file
    for value in (*decode.graph.input, *decode.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 4
    onnx.save(decode, str(ws.root / "models/llm/decode.onnx"))
    ws.model("models/cnn.onnx", matmul_model(3))
    ws.model("build/old_ctx.onnx", matmul_model(4))  # the output directory: skipped
    ws.model("models/stale_ctx.onnx", matmul_model(5))  # an EPContext model's name: skipped


@pytest.mark.slow
def test_init_from_groups_a_sharing_pair_and_builds(workspace: Workspace) -> None:
    _sharing_pair(workspace)
    proc = workspace.cli("init", "--from", "models", check=True)
    assert "group llm: 2 model(s), sharing models/llm/llm.data" in proc.stdout
    m = load_manifest(workspace.root / "epbuild.toml")
    assert {n: [e.path for e in g.entries] for n, g in m.groups.items()} == {
        "llm": ["models/llm/decode.onnx", "models/llm/prefill.onnx"],
        "models": ["models/cnn.onnx"],
    }
    assert m.groups["llm"].share_weights and not m.groups["models"].share_weights
    assert (
        "# These models share models/llm/llm.data:" in (workspace.root / "epbuild.toml").read_text()
    )
    result = workspace.build()
    assert result.exit_code == 0 and len(result.actions) == 2
    out = workspace.root / "build"
    shared = sorted(p.name for p in out.rglob("*") if p.is_file() and "llm" in p.parts)
    assert [n for n in shared if n.endswith("_ctx.onnx")] == ["decode_ctx.onnx", "prefill_ctx.onnx"]
    assert len([n for n in shared if n.endswith(".bin")]) == 1  # N ctx models + 1 binary


@pytest.mark.slow
def test_init_from_refuses_an_existing_manifest_and_bad_dirs(workspace: Workspace) -> None:
    workspace.model("models/a.onnx")
    workspace.manifest("# mine\n")
    proc = workspace.cli("init", "--from", "models")
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert (workspace.root / "epbuild.toml").read_text() == "# mine\n"
    os.unlink(workspace.root / "epbuild.toml")
    for args, message in (
        (["--from", ".."], "outside the workspace"),
        (["--from", "nope"], "no such directory"),
        (["--from", "models", "--target", "pixel"], "not a SoC epbuild knows"),
    ):
        proc = workspace.cli("init", *args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (workspace.root / "epbuild.toml").exists()


def test_init_from_with_a_target(workspace: Workspace) -> None:
    workspace.model("m/a.onnx")
    workspace.model("a.onnx")
    workspace.main("init", "--from", ".", "--target", "sm8750", check=True)
    m = load_manifest(workspace.root / "epbuild.toml")
    assert m.providers["sm8750"].options["soc_model"] == "69"
    assert {n: g.providers for n, g in m.groups.items()} == {"main": ("sm8750",), "m": ("sm8750",)}


def test_edits_of_the_starter_manifest_keep_commented_keys_with_their_table(
    workspace: Workspace,
) -> None:
    workspace.root.mkdir(parents=True)
    workspace.main("init", check=True)
    starter = text(workspace)
    workspace.model("models/a.onnx")
    assert run(workspace, "add", "target", "snapdragon-8-gen-2")[0] == 0
    after = text(workspace)
    assert changes(starter, after)[0] == ['providers = ["htp-v73"]']
    assert (
        '# graph_optimization_level = "all"   # or "disabled", "basic", "extended"\n\n'
        "[providers.snapdragon-8-gen-2]  # Snapdragon 8 Gen 2 (SM8550): HTP v73\n"
        'ep = "qnn"\noptions = { htp_arch = "73", soc_model = "43" }\n\n'
        "# A model group: its models are compiled for each listed provider.\n[groups.main]\n"
    ) in after
    assert load_manifest(workspace.root / "epbuild.toml").groups["main"].providers == (
        "htp-v73",
        "snapdragon-8-gen-2",
    )


def test_first_group_of_a_file_without_final_newline(workspace: Workspace) -> None:
    workspace.model("models/a.onnx")
    workspace.manifest('[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73" }  # x')
    assert run(workspace, "add", "model", "models/a.onnx", "-g", "g")[0] == 0
    assert text(workspace) == (
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73" }  # x\n\n'
        '[groups.g]\nmodels = ["models/a.onnx"]\nproviders = ["htp"]\n'
    )
    assert run(workspace, "add", "provider", "p2", "--ep", "qnn")[0] == 0
    assert '# x\n\n[providers.p2]\nep = "qnn"\n\n[groups.g]\n' in text(workspace)


def test_file_changed_during_the_edit_is_not_overwritten(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import epbuild
    from epbuild.errors import UserError
    from epbuild.manifest import edit

    def meanwhile(path: Path, *, text: str) -> object:
        (ws.root / "epbuild.toml").write_text(HAND_WRITTEN + "# someone else's edit\n")
        return load_manifest(path, text=text)

    result = epbuild.add_target(ws.root, target="snapdragon-8-elite", to=["llm"])
    assert result.written and result.changes[-1] == (
        "group llm is now also built for snapdragon-8-elite"
    )
    monkeypatch.setattr(edit, "load_manifest", meanwhile)
    with pytest.raises(UserError, match="changed while it was being edited"):
        epbuild.add_target(ws.root, target="snapdragon-8-gen-3")
    assert text(ws) == HAND_WRITTEN + "# someone else's edit\n"


def test_an_error_the_file_already_has_is_named_as_such(ws: Workspace) -> None:
    ws.manifest(HAND_WRITTEN.replace('soc_model = "60"', 'soc_model = "1"'))
    before = (ws.root / "epbuild.toml").read_bytes()
    rc, _, err = run(ws, "add", "model", "models/d.onnx", "-g", "llm")
    assert rc == 2 and (ws.root / "epbuild.toml").read_bytes() == before
    assert "epbuild.toml:8: providers.htp.options.soc_model: soc_model '1'" in err
    assert "fix this first (nothing written)" in err
    rc, _, _ = run(ws, "add", "provider", "htp", "--ep", "qnn", "--replace",
                   "--option", "htp_arch=73", "--option", "soc_model=60")  # fmt: skip
    assert (
        rc == 0
        and load_manifest(ws.root / "epbuild.toml").providers["htp"].options["soc_model"] == "60"
    )
