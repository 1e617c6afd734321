"""Manifest validation: every mistake is one clear message naming file, line and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HTP73, Workspace

from epbuild.errors import ManifestError, UserError
from epbuild.manifest.load import load_manifest
from epbuild.manifest.schema import SCHEMA, SchemaViolation, schema_text, validate


def _err(ws: Workspace, text: str) -> ManifestError:
    ws.model("models/a.onnx")
    path = ws.manifest(text)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    return info.value


GOOD = """\
[providers.htp]
ep = "qnn"
options = { htp_arch = "73", soc_model = "60" }

[groups.g]
models = ["models/a.onnx"]
providers = ["htp"]
"""


def test_good_manifest_loads(workspace: Workspace) -> None:
    workspace.model("models/a.onnx")
    m = load_manifest(workspace.manifest(GOOD))
    assert m.groups["g"].models == ("models/a.onnx",)
    assert m.providers["htp"].options["backend_type"] == "htp"
    assert m.workspace.out_dir == "build"


def test_unknown_key_names_line_and_key(workspace: Workspace) -> None:
    err = _err(workspace, GOOD + "share_weight = true\n")
    assert err.line == 8
    assert err.key == "groups.g.share_weight"
    assert "unknown key" in str(err) and "share_weights" in str(err)
    assert "epbuild.toml:8" in str(err)


def test_misspelt_required_key_is_the_unknown_key_with_the_near_miss(
    workspace: Workspace,
) -> None:
    err = _err(workspace, GOOD.replace('models = ["models/a.onnx"]', 'model = ["models/a.onnx"]'))
    assert err.key == "groups.g.model" and err.line == 6
    assert "unknown key" in str(err) and "did you mean 'models'?" in (err.hint or "")


def test_misspelt_top_level_table_names_its_line(workspace: Workspace) -> None:
    err = _err(workspace, GOOD.replace("[groups.g]", "[group.g]"))
    assert err.key == "group" and err.line == 5
    assert "did you mean 'groups'?" in (err.hint or "")


def test_a_name_too_long_for_a_file_name_is_refused_when_loading(workspace: Workspace) -> None:
    # A group name is a directory of the outputs: 300 characters passed here and failed
    # only when the build wrote its files ('File name too long').
    err = _err(workspace, GOOD.replace("[groups.g]", "[groups." + "a" * 300 + "]"))
    assert "is not a valid name" in str(err) and "at most 64 characters" in (err.hint or "")
    assert err.line == 5
    m = load_manifest(workspace.manifest(GOOD.replace("[groups.g]", "[groups." + "a" * 64 + "]")))
    assert list(m.groups) == ["a" * 64]


def test_wrong_type(workspace: Workspace) -> None:
    err = _err(workspace, GOOD + 'embed_mode = "0"\n')
    assert err.key == "groups.g.embed_mode" and "must be integer" in str(err)


def test_undefined_provider(workspace: Workspace) -> None:
    err = _err(workspace, GOOD.replace('providers = ["htp"]', 'providers = ["htp-v75"]'))
    assert err.key == "groups.g.providers" and "htp-v75" in str(err) and err.line == 7
    assert "[providers.htp-v75]" in str(err)


@pytest.mark.slow
def test_missing_model_fails_its_action_naming_the_line(workspace: Workspace) -> None:
    workspace.model("models/a.onnx")
    workspace.manifest(GOOD.replace('["models/a.onnx"]', '["models/nope.onnx", "models/a.onnx"]'))
    doc = workspace.cli_json("build", "-k")
    by_id = {a["id"]: a for a in doc["actions"]}
    assert by_id["g/htp/a"]["outcome"] == "compiled"
    missing = by_id["g/htp/nope"]
    assert missing["outcome"] == "failed"
    assert (
        "epbuild.toml:6: groups.g.models: model file 'models/nope.onnx' does not exist"
        in (missing["error"])
    )


def test_glob_matching_nothing(workspace: Workspace) -> None:
    err = _err(workspace, GOOD.replace("models/a.onnx", "models/*.bin"))
    assert "matches no files" in str(err)


def test_a_glob_found_model_with_a_backslash_in_its_name(workspace: Workspace) -> None:
    workspace.model("models/x\\y.onnx")  # one file, named x\y.onnx (Linux allows it)
    workspace.manifest(GOOD.replace("models/a.onnx", "models/*.onnx"))
    proc = workspace.cli("status")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = (
        "epbuild.toml:6: groups.g.models: pattern 'models/*.onnx' matches models/x\\y.onnx, "
        "whose name holds a backslash"
    )
    assert said in proc.stderr, proc.stderr
    assert "rename the file (e.g. to models/x_y.onnx)" in proc.stderr
    assert "climbs out" not in proc.stderr


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.onnx", "models/../../x.onnx"])
def test_paths_leaving_workspace(workspace: Workspace, path: str) -> None:
    err = _err(workspace, GOOD.replace("models/a.onnx", path))
    assert err.key == "groups.g.models"
    assert "absolute" in str(err) or "leaves the workspace" in str(err)


def test_out_dir_outside(workspace: Workspace) -> None:
    err = _err(workspace, '[workspace]\nout_dir = "../build"\n' + GOOD)
    assert err.key == "workspace.out_dir" and err.line == 2


def test_output_collision(workspace: Workspace) -> None:
    workspace.model("other/a.onnx")
    err = _err(workspace, GOOD.replace('["models/a.onnx"]', '["models/a.onnx", "other/a.onnx"]'))
    assert "a_ctx.onnx" in str(err)


@pytest.mark.parametrize(
    ("option", "value"),
    [("htp_arch", "99"), ("soc_model", "abc"), ("soc_model", "9999"), ("backend_type", "cpu")],
)
def test_options_the_ep_would_misread(workspace: Workspace, option: str, value: str) -> None:
    options = {"htp_arch": "73", "soc_model": "60", option: value}
    line = "options = { " + ", ".join(f'{k} = "{v}"' for k, v in options.items()) + " }"
    err = _err(workspace, GOOD.replace('options = { htp_arch = "73", soc_model = "60" }', line))
    assert err.key == f"providers.htp.options.{option}"
    assert err.line == 3


def test_backend_type_and_path(workspace: Workspace) -> None:
    err = _err(
        workspace,
        GOOD.replace(
            'soc_model = "60"', 'soc_model = "60", backend_type = "htp", backend_path = "x.so"'
        ),
    )
    assert err.key == "providers.htp.options.backend_path"


def test_embed_1_with_sharing_refused(workspace: Workspace) -> None:
    err = _err(workspace, GOOD + "share_weights = true\nembed_mode = 1\n")
    assert err.key == "groups.g.embed_mode"


def test_multi_soc_with_sharing_refused(workspace: Workspace) -> None:
    text = GOOD.replace(
        'htp_arch = "73", soc_model = "60"', 'htp_arch = "73,75", soc_model = "60,57"'
    )
    err = _err(workspace, text + "share_weights = true\n")
    assert err.key == "groups.g.share_weights"


def test_invalid_toml_has_line(workspace: Workspace) -> None:
    err = _err(workspace, GOOD + "[groups.h\n")
    assert err.line == 8 and "invalid TOML" in str(err)


def test_duplicate_key(workspace: Workspace) -> None:
    err = _err(workspace, GOOD + 'providers = ["htp"]\n')
    assert "invalid TOML" in str(err)


def test_session_option_reserved(workspace: Workspace) -> None:
    err = _err(
        workspace,
        GOOD.replace(
            'ep = "qnn"', 'ep = "qnn"\nsession_options = { "ep.context_embed_mode" = "1" }'
        ),
    )
    assert "ep.context_embed_mode" in (err.key or "")


def test_schema_file_matches_code() -> None:
    path = Path(__file__).parent.parent / "schemas" / "epbuild.schema.json"
    assert path.read_text() == schema_text(), "run: python -m epbuild.manifest.schema"
    assert json.loads(path.read_text()) == SCHEMA


def test_schema_accepts_examples() -> None:
    import tomllib

    for manifest in (Path(__file__).parent.parent / "examples").rglob("epbuild.toml"):
        validate(tomllib.loads(manifest.read_text()))


def test_cli_reports_manifest_error_without_traceback(workspace: Workspace) -> None:
    workspace.model("models/a.onnx")
    workspace.manifest(GOOD + "bogus = 1\n")
    proc = workspace.cli("build")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "epbuild.toml:8: groups.g.bogus: unknown key" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2


def test_init_writes_valid_manifest_and_refuses_overwrite(workspace: Workspace) -> None:
    workspace.root.mkdir(parents=True)
    assert workspace.main("init").returncode == 0
    text = (workspace.root / "epbuild.toml").read_text()
    assert "# " in text and "[providers.htp-v73]" in text
    proc = workspace.main("init")
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert (workspace.root / "epbuild.toml").read_text() == text


def test_init_over_a_directory_named_like_the_manifest_is_a_user_error(
    workspace: Workspace,
) -> None:
    (workspace.root / "epbuild.toml").mkdir(parents=True)
    proc = workspace.main("init")
    assert proc.returncode == 2, proc.stderr
    assert "epbuild.toml" in proc.stderr and "already exists" in proc.stderr
    assert (workspace.root / "epbuild.toml").is_dir()


def test_unknown_selector(workspace: Workspace) -> None:
    workspace.model("models/a.onnx")
    workspace.manifest({"providers": {"htp": HTP73},
                        "groups": {"g": {"models": ["models/a.onnx"],
                                         "providers": ["htp"]}}})  # fmt: skip
    with pytest.raises(UserError, match="no action matches"):
        workspace.build("nope", dry_run=True)


def test_glob_in_workspace_with_glob_characters_in_its_path(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "proj[1]*")
    ws.model("models/a.onnx")
    ws.model("models/b.onnx")
    m = load_manifest(ws.manifest(GOOD.replace('["models/a.onnx"]', '["models/*.onnx"]')))
    assert m.groups["g"].models == ("models/a.onnx", "models/b.onnx")


def test_plugin_library_is_relative_to_the_manifest(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from epbuild.providers import get_provider

    workspace.model("models/a.onnx")
    (workspace.root / "libs").mkdir()
    (workspace.root / "libs" / "libmy_ep.so").write_bytes(b"not really a library")
    text = (
        GOOD + '\n[providers.mine]\nep = "plugin"\nlibrary = "libs/libmy_ep.so"\nep_name = "mine"\n'
    )
    monkeypatch.chdir(tmp_path)  # the coordinator may run anywhere (-C)
    m = load_manifest(workspace.manifest(text))
    cfg = m.providers["mine"]
    assert cfg.settings["library"] == "libs/libmy_ep.so"  # the key stays relocatable
    assert get_provider("plugin").versions(cfg)["plugin-library"] != "absent"


def test_group_carries_its_glob_patterns_normalised(workspace: Workspace) -> None:
    workspace.model("models/a.onnx")
    workspace.model("models/sub/b.onnx")
    models = '["./models/*.onnx", "models/sub/b.onnx"]'
    m = load_manifest(workspace.manifest(GOOD.replace('["models/a.onnx"]', models)))
    assert m.groups["g"].models == ("models/a.onnx", "models/sub/b.onnx")
    assert m.groups["g"].patterns == ("models/*.onnx",)


@pytest.mark.parametrize("section", ["groups", "providers"])
def test_a_name_ending_with_a_newline_is_refused(workspace: Workspace, section: str) -> None:
    workspace.model("m.onnx")
    group, provider = ("main\n", "htp") if section == "groups" else ("main", "htp\n")
    text = (
        f"[providers.{json.dumps(provider)}]\n"
        'ep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
        f"[groups.{json.dumps(group)}]\n"
        f'models = ["m.onnx"]\nproviders = [{json.dumps(provider)}]\n'
    )
    err = _err(workspace, text)
    assert "is not a valid name" in err.message


def test_schema_patterns_have_json_schema_semantics() -> None:
    validate({"main": {}}, {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}})
    for bad in ("main\n", "Main"):
        with pytest.raises(SchemaViolation):
            validate({bad: {}}, {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}})


def test_a_table_option_reaches_the_adapter_that_takes_one(workspace: Workspace) -> None:
    """OpenVINO's load_config is a table in its own hint; QNN refuses a table naming the key."""
    workspace.model("models/a.onnx")
    ov = GOOD.replace(
        'ep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }',
        'ep = "openvino"\noptions = { device_type = "NPU", '
        'load_config = { NPU = { NPU_QDQ_OPTIMIZATION = "YES" } } }',
    )
    m = load_manifest(workspace.manifest(ov))
    assert m.providers["htp"].options["load_config"] == '{"NPU":{"NPU_QDQ_OPTIMIZATION":"YES"}}'
    err = _err(workspace, GOOD.replace('htp_arch = "73"', "htp_arch = { v = 73 }"))
    assert err.key == "providers.htp.options.htp_arch" and err.line == 3
    assert "must be a string, number or boolean" in str(err)
