"""``epbuild add`` on every way TOML lets a manifest be written: the loader's message where
the loader refuses the file, a correct edit (in the file's own form and line endings)
where it accepts it; two edits at once both land; a path is a path, not a pattern."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
from pathlib import Path

import pytest
from conftest import Workspace
from modelgen import matmul_model

from epbuild._names import tomllib
from epbuild.frontends.cli import main
from epbuild.manifest.load import load_manifest

PROVIDER = '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
GROUP = '[groups.main]\nmodels = ["models/a.onnx"]\nproviders = ["htp"]\n'

ADDS = {
    "model": ["add", "model", "models/b.onnx", "--group", "main"],
    "new-group": ["add", "model", "models/b.onnx", "--group", "extra", "-p", "htp"],
    "provider": ["add", "provider", "v75", "--ep", "qnn", "--option", "htp_arch=75"],
    "target": ["add", "target", "snapdragon-8-gen-3"],
}


@pytest.fixture
def ws(workspace: Workspace) -> Workspace:
    for i, name in enumerate("ab"):
        workspace.model(f"models/{name}.onnx", matmul_model(i))
    return workspace


def run(ws: Workspace, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["-C", str(ws.root), *args])
    return rc, out.getvalue(), err.getvalue()


REFUSED = {
    "duplicate key": (PROVIDER + GROUP + 'providers = ["htp"]\n', ":7: invalid TOML"),
    "array of groups": (PROVIDER + '[[groups]]\nmodels = ["models/a.onnx"]\n', "groups: must be"),
    "groups = 5": ("groups = 5\n" + PROVIDER, ":1: groups: must be object, not an integer"),
    'providers = "x"': ('providers = "x"\n' + GROUP, ":1: providers: must be object"),
    "[groups] main = 3": (PROVIDER + "[groups]\nmain = 3\n", ":5: groups.main: must be object"),
    "array of providers": ('[[providers]]\nep = "qnn"\n' + GROUP, ":1: providers: must be"),
    "BOM": ("\ufeff" + PROVIDER + GROUP, ":1: starts with a UTF-8 byte-order mark (BOM)"),
    "nested arrays": ("x = " + "[" * 500 + "]" * 500 + "\n", "nested too deeply"),
}


@pytest.mark.parametrize("what", list(ADDS))
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_file_the_loader_refuses_gets_the_loaders_message(
    ws: Workspace, case: str, what: str
) -> None:
    text, needle = REFUSED[case]
    path = ws.root / "epbuild.toml"
    path.write_bytes(text.encode())
    rc, out, err = run(ws, *ADDS[what])
    assert rc == 2, (out, err)
    assert err.startswith(f"epbuild: error: {path}") and needle in err, err
    assert "fix this first (nothing written)" in err and "Traceback" not in err
    assert path.read_bytes() == text.encode()
    if case != "nested arrays":  # every command says the same
        rc, _, status_err = run(ws, "status")
        assert rc == 2 and needle in status_err, status_err


ACCEPTED = {
    "inline providers": 'providers = { htp = { ep = "qnn", options = { htp_arch = "73", '
    'soc_model = "60" } } }\n' + GROUP,
    "inline groups": 'groups = { main = { models = ["models/a.onnx"], providers = ["htp"] } }\n'
    + PROVIDER,
    "dotted keys": 'providers.htp.ep = "qnn"\nproviders.htp.options.htp_arch = "73"\n'
    'providers.htp.options.soc_model = "60"\n' + GROUP,
    "dotted keys in a table": '[providers]\nhtp.ep = "qnn"\nhtp.options = { htp_arch = "73", '
    'soc_model = "60" }\n\n' + GROUP,
    "tables spread over the file": GROUP + PROVIDER.replace("htp]", "other]") + "\n" + PROVIDER,
    "array of model tables": PROVIDER + '[groups.main]\nproviders = ["htp"]\n\n'
    '[[groups.main.models]]\npath = "models/a.onnx"\n',
    "CRLF": (PROVIDER + "\n" + GROUP).replace("\n", "\r\n"),
}


@pytest.mark.parametrize("what", list(ADDS))
@pytest.mark.parametrize("case", list(ACCEPTED))
def test_a_valid_file_in_any_form_is_edited(ws: Workspace, case: str, what: str) -> None:
    text = ACCEPTED[case]
    path = ws.root / "epbuild.toml"
    path.write_bytes(text.encode())
    before = tomllib.loads(text)
    rc, out, err = run(ws, *ADDS[what])
    assert rc == 0, err
    assert "wrote" in out
    after_bytes = path.read_bytes()
    after = tomllib.loads(after_bytes.decode())
    manifest = load_manifest(path)
    if what == "model":
        assert [e.path for e in manifest.groups["main"].entries] == [
            "models/a.onnx",
            "models/b.onnx",
        ]
    elif what == "new-group":
        assert [e.path for e in manifest.groups["extra"].entries] == ["models/b.onnx"]
    elif what == "provider":
        assert manifest.providers["v75"].options["htp_arch"] == "75"
    else:
        assert "snapdragon-8-gen-3" in manifest.groups["main"].providers
    # Nothing else changed meaning.
    for family in ("providers", "groups"):
        for name, table in before[family].items():
            if what in ("model", "target") and family == "groups":
                continue
            assert after[family][name] == table
    if case == "CRLF":
        assert after_bytes.count(b"\n") == after_bytes.count(b"\r\n")


def _add_providers(root: str, prefix: str, count: int, start: multiprocessing.synchronize.Event):
    from epbuild.manifest.edit import add_provider

    start.wait(60)
    for i in range(count):
        add_provider(root, name=f"{prefix}{i}", ep="qnn", options={"htp_arch": 75})


def test_two_edits_at_once_both_land(ws: Workspace) -> None:
    """Two processes each add 25 providers as fast as they can: all 50 are in the file."""
    path = ws.root / "epbuild.toml"
    path.write_text(PROVIDER + "\n" + GROUP)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [
        ctx.Process(target=_add_providers, args=(str(ws.root), prefix, 25, start))
        for prefix in ("x", "y")
    ]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    names = set(load_manifest(path).providers)
    assert names == {"htp"} | {f"{p}{i}" for p in "xy" for i in range(25)}


def test_a_model_path_with_pattern_characters_is_that_file(ws: Workspace) -> None:
    ws.model("models/br[1].onnx", matmul_model(5))
    ws.model("models/br1.onnx", matmul_model(6))
    (ws.root / "epbuild.toml").write_text(PROVIDER + "\n" + GROUP)
    rc, _, err = run(ws, "add", "model", "models/br[1].onnx", "-g", "main")
    assert rc == 0, err
    group = load_manifest(ws.root / "epbuild.toml").groups["main"]
    assert [e.path for e in group.entries] == ["models/a.onnx", "models/br[1].onnx"]
    rc, out, _ = run(ws, "add", "model", "models/br[1].onnx", "-g", "main")
    assert rc == 0 and "already listed" in out
    # A pattern that names no file is still a pattern.
    rc, _, err = run(ws, "add", "model", "models/b*.onnx", "-g", "other", "-p", "htp")
    assert rc == 0, err
    assert {e.path for e in load_manifest(ws.root / "epbuild.toml").groups["other"].entries} == {
        "models/b.onnx",
        "models/br[1].onnx",
        "models/br1.onnx",
    }


def test_init_from_lists_a_file_with_pattern_characters(ws: Workspace) -> None:
    ws.model("models/br[1].onnx", matmul_model(5))
    rc, _, err = run(ws, "init", "--from", "models")
    assert rc == 0, err
    models = load_manifest(Path(ws.root, "epbuild.toml")).groups["models"].entries
    assert sorted(e.path for e in models) == [
        "models/a.onnx",
        "models/b.onnx",
        "models/br[1].onnx",
    ]
