"""LLM sources are untrusted input: a downloaded genai folder never makes epbuild read or
ship a file from elsewhere, run away with memory, write a package it reports wrongly, or
end in a traceback. Each case is one clear message (exit 2) naming the file and the key."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace
from llmfixture import chat_manifest, place_source

CONFIG = "models/tiny/genai_config.json"


def _config(ws: Workspace) -> dict[str, Any]:
    return json.loads((ws.root / CONFIG).read_text())  # type: ignore[no-any-return]


def _edit(ws: Workspace, change: Callable[[dict[str, Any]], None]) -> None:
    config = _config(ws)
    change(config)
    (ws.root / CONFIG).write_text(json.dumps(config))


def _refused(ws: Workspace, *needles: str, command: str = "build") -> str:
    proc = ws.main(command)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "bug in epbuild" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    return proc.stderr


@pytest.fixture
def llm_ws(workspace: Workspace) -> Workspace:
    return workspace.llm()


def test_a_link_out_of_the_source_folder_is_refused(llm_ws: Workspace, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not for shipping")
    os.symlink(secret, llm_ws.root / "models" / "tiny" / "special_tokens_map.json")
    _refused(llm_ws, "special_tokens_map.json is a link to", str(secret), "outside the folder")
    assert not (llm_ws.root / "build").exists()
    _refused(llm_ws, "special_tokens_map.json", command="status")


def test_a_link_inside_the_folder_is_fine(llm_ws: Workspace) -> None:
    os.symlink("tokenizer.json", llm_ws.root / "models" / "tiny" / "extra_tokens.json")
    assert llm_ws.main("status").returncode == 0


def test_a_decoder_file_outside_the_folder_is_refused(llm_ws: Workspace) -> None:
    _edit(llm_ws, lambda c: c["model"]["decoder"].update(filename="../../../x.onnx"))
    _refused(llm_ws, "model.decoder.filename names '../../../x.onnx', not a file of the folder")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda c: c["model"]["decoder"].update(num_hidden_layers=10**7),
         "model.decoder.num_hidden_layers is 10000000: it must be between 1 and 1024"),
        (lambda c: c["model"]["decoder"].pop("num_hidden_layers"),
         "has no model.decoder.num_hidden_layers"),
        (lambda c: c["model"]["decoder"]["inputs"].update(past_key_names="past.key"),
         "model.decoder.inputs.past_key_names is 'past.key': it must hold one %d"),
        (lambda c: c["model"]["decoder"].update(session_options=[]),
         "model.decoder.session_options must be a table"),
        (lambda c: c.update(search=[]), "search must be a table"),
        (lambda c: c["model"]["decoder"].update(inputs=["input_ids"]),
         "model.decoder.inputs must be a table"),
        (lambda c: c["search"].update(max_length=1e400), "search.max_length must be a whole"),
        (lambda c: c["search"].update(max_length="abc"), "search.max_length must be a whole"),
        (lambda c: c["search"].update(temperature=float("nan")),
         "search.temperature must be a finite number"),
        (lambda c: c["model"].update(eos_token_id="x"), "model.eos_token_id must be a token id"),
    ],
)  # fmt: skip
def test_a_config_epbuild_cannot_use_is_one_message_naming_the_key(
    llm_ws: Workspace, change: Callable[[dict[str, Any]], None], needle: str
) -> None:
    _edit(llm_ws, change)
    _refused(llm_ws, needle, "llms.chat.source", "genai_config.json")


def test_a_deeply_nested_config_is_refused_by_every_command(llm_ws: Workspace) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    text = (llm_ws.root / CONFIG).read_text().rstrip()
    (llm_ws.root / CONFIG).write_text(text[:-1] + ', "deep": ' + deep + "}")
    for command in ("build", "status", "clean", "lock"):
        _refused(llm_ws, "genai_config.json nests", command=command)


def test_a_kv_cache_beyond_the_memory_is_refused_before_anything_runs(
    workspace: Workspace,
) -> None:
    place_source(workspace.root)
    _edit(workspace, lambda c: c["model"].update(context_length=10_000_000))
    workspace.manifest(chat_manifest(context=10_000_000, window=16))
    (workspace.root / "epbuild.toml").write_text(
        '[workspace]\nmemory_budget = "1G"\n' + (workspace.root / "epbuild.toml").read_text()
    )
    # 2 × 2 layers × 2 KV heads × 10,000,000 × head size 16 × 4 bytes
    err = _refused(workspace, "llms.chat.context_length", "KV cache 4.8 GB", "(1.0 GB)")
    assert "lower context_length" in err
    assert not (workspace.root / ".epbuild").exists()


@pytest.mark.parametrize("bad", ["../stage.onnx", "..", "C:context.onnx"])
def test_a_pipeline_stage_outside_the_folder_is_refused(workspace: Workspace, bad: str) -> None:
    place_source(workspace.root, "llama-pipeline")
    workspace.manifest(chat_manifest(context=None, window=None))

    def rename(c: dict[str, Any]) -> None:
        stage = c["model"]["decoder"]["pipeline"][0]
        ((_name, table),) = stage.items()
        table["filename"] = bad

    _edit(workspace, rename)
    _refused(workspace, "not a file of the folder")


def test_a_linked_pipeline_stage_is_refused(workspace: Workspace, tmp_path: Path) -> None:
    folder = place_source(workspace.root, "llama-pipeline")
    workspace.manifest(chat_manifest(context=None, window=None))
    outside = tmp_path / "lm_head.onnx"
    (folder / "lm_head.onnx").rename(outside)
    os.symlink(outside, folder / "lm_head.onnx")
    _refused(workspace, "lm_head.onnx is a link to", "outside the folder")


# ---------------------------------------------------------------------------------------
# Random mutations of a real genai_config.json: never a traceback, never exit 0 with a
# package other than the source makes.


def _mutations(config: Any, rng: random.Random) -> Any:
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append((node, k))
                walk(v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                paths.append((node, i))
                walk(v)

    walk(config)
    parent, key = rng.choice(paths)
    choice = rng.randrange(4)
    values: list[Any] = [None, [], {}, "x", "%d", -1, 0, 10**9, 1e308, True, 2.5, [1]]
    if choice == 0 and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = rng.choice(values)
    return config


@pytest.mark.parametrize("seed", range(8))
def test_random_config_mutations_never_end_in_a_traceback(llm_ws: Workspace, seed: int) -> None:
    rng = random.Random(seed)
    config = _mutations(_mutations(_config(llm_ws), rng), rng)
    (llm_ws.root / CONFIG).write_text(json.dumps(config))
    for command in ("status", "build"):
        proc = llm_ws.main(command)
        assert proc.returncode in (0, 1, 2), (command, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and "bug in epbuild" not in proc.stderr, proc.stderr
    if proc.returncode == 0:  # a package was written: exactly what the source makes now
        from epbuild.llm.package import package_plan
        from epbuild.manifest.load import load_manifest
        from epbuild.providers import get_provider

        m = load_manifest(llm_ws.root / "epbuild.toml")
        llm, provider = m.llms["chat"], m.providers["htp-v73"]
        plan = package_plan(str(llm_ws.root), llm, provider, get_provider("qnn").file_options)
        out = llm_ws.root / "build" / "chat" / "htp-v73" / "genai_config.json"
        assert out.read_bytes() == plan.config


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d.update(num_hidden_layers=3),
         "model.decoder.num_hidden_layers is 3, the graph has 2"),
        (lambda d: d.update(head_size=32),
         "model.decoder.head_size is 32, hidden_size / num_attention_heads is 64 / 4"),
        (lambda d: d.update(num_key_value_heads=4),
         "model.decoder.num_key_value_heads is 4, the graph's is 2"),
    ],
)  # fmt: skip
def test_sizes_that_are_not_the_graphs_are_refused_before_preparing(
    llm_ws: Workspace, change: Callable[[dict[str, Any]], None], needle: str
) -> None:
    _edit(llm_ws, lambda c: change(c["model"]["decoder"]))
    proc = llm_ws.main("build")  # a source mistake like any other: exit 2, one message
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "models/tiny/genai_config.json" in proc.stderr and "Traceback" not in proc.stderr
    assert not (llm_ws.root / ".epbuild" / "llm" / "chat" / "prepared").exists()
    assert needle in llm_ws.main("status").stdout
