"""``epbuild init``: write a commented starter manifest (tomlkit keeps comments on edits),
or with ``--from DIR`` one listing the models found there (``manifest.discover``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from epbuild._names import MANIFEST_NAME
from epbuild.docsite import page_url
from epbuild.errors import UserError
from epbuild.llm.source import DECODER
from epbuild.manifest.discover import discover
from epbuild.manifest.edit import manifest_lock, manifest_relative, write_checked
from epbuild.manifest.model import DEFAULT_CONTEXT_LENGTH, DEFAULT_WINDOW_SIZE
from epbuild.manifest.tomledit import render_key, render_value, table_text
from epbuild.providers.qnn import WELL_KNOWN_TARGETS, well_known_target

if TYPE_CHECKING:
    from epbuild.manifest.discover import FoundGroup, FoundLlm

_GUIDE = (
    f"# Every key: {page_url('reference/manifest.md')}\n"
    "# Checks in your editor: epbuild schema > epbuild.schema.json, then make this line 1:\n"
    "#   #:schema ./epbuild.schema.json\n"
)
"""Where a starter manifest's reader finds every key, and how their editor checks them."""

STARTER = (
    "# epbuild manifest.\n"
    + _GUIDE
    + """\

[workspace]
out_dir = "build"        # outputs, relative to this file
# jobs = 2               # compiles at once (default: number of CPUs)

# A named provider configuration: which EP, which target ('epbuild add target --list').
[providers.htp-v73]      # Snapdragon X Elite (SC8380XP): HTP v73
ep = "qnn"
options = { htp_arch = "73", soc_model = "60" }
# compiler = "session"   # default "compile_api" (onnxruntime >= 1.23): ModelCompiler
# graph_optimization_level = "all"   # or "disabled", "basic", "extended"

# A model group: its models are compiled for each listed provider.
[groups.main]
models = ["models/*.onnx"]
providers = ["htp-v73"]
share_weights = false    # true: one weight-sharing session group (N ctx + 1 bin)
embed_mode = 0           # 0: separate context binary; 1: embedded in the ctx model
"""
)


def init(directory: str | os.PathLike[str] = ".", name: str | None = None) -> str:
    """Create a starter manifest; refuses to overwrite one. Returns its path."""
    import tomlkit

    path = os.path.join(os.fspath(directory), name or MANIFEST_NAME)
    with manifest_lock(Path(path), "epbuild init"):  # as add holds it: one edit at a time
        if os.path.lexists(path):
            raise UserError(f"{path} already exists; not overwriting it")
        doc = tomlkit.parse(STARTER)  # round-trip through tomlkit: what we write is valid TOML
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "x", encoding="utf-8") as f:
            f.write(tomlkit.dumps(doc))
    return path


@dataclass(frozen=True)
class InitResult:
    """What ``init --from`` wrote: the manifest, its groups and the files it left out."""

    path: str
    groups: tuple[FoundGroup, ...]
    skipped: tuple[str, ...]
    llms: tuple[FoundLlm, ...] = ()

    def lines(self) -> list[str]:
        """One line per group, LLM and skipped file, then the file written."""
        out = []
        for g in self.groups:
            shared = f", sharing {', '.join(g.shared_data)}" if g.share_weights else ""
            out.append(f"group {g.name}: {len(g.models)} model(s){shared}")
        for llm in self.llms:
            out.append(f"llm {llm.name}: {llm.folder} ({llm.source.model_type}, genai model)")
        out += [f"skipped {line}" for line in self.skipped]
        return [*out, f"wrote {self.path}"]


def init_from(
    directory: str | os.PathLike[str] = ".",
    name: str | None = None,
    *,
    source: str,
    target: str | None = None,
) -> InitResult:
    """Write a starter manifest listing the models under ``source`` (relative to
    ``directory``, inside the manifest's directory); refuses to overwrite one.

    Models sharing an external-data file become one ``share_weights`` group, the others
    one group per directory, and an onnxruntime-genai model folder (``genai_config.json``;
    ``source`` itself or one below it) an ``[llms]`` entry (``manifest.discover``).
    ``target``: a well-known SoC to build for (``epbuild add target --list``), default the
    starter's HTP v73 provider.
    """
    path = Path(os.fspath(directory), name or MANIFEST_NAME)
    with manifest_lock(path, "epbuild init --from"):  # check, discover and write as one edit
        return _init_from(directory, path, source, target)


def _init_from(
    directory: str | os.PathLike[str], path: Path, source: str, target: str | None
) -> InitResult:
    if os.path.lexists(path):
        raise UserError(
            f"{path} already exists; not overwriting it",
            hint="edit it with 'epbuild add model PATH... --group NAME'",
        )
    rel = manifest_relative(directory, path, source)
    root = os.path.abspath(path.parent)
    if not os.path.isdir(os.path.join(root, rel)):
        raise UserError(f"--from {source}: no such directory")
    found = discover(root, rel)
    if not found.groups and not found.llms:
        reasons = "".join(f"; skipped {line}" for line in found.skipped)
        raise UserError(
            f"no ONNX models found under {source}{reasons}",
            hint="init --from looks for *.onnx files (not *_ctx.onnx) and onnxruntime-genai "
            "model folders (genai_config.json)",
        )
    provider, provider_text = _provider_block(target)
    text = "\n".join(
        [_HEADER.format(source=source), provider_text]
        + [_group_block(g, provider) for g in found.groups]
        + [_llm_block(llm, provider) for llm in found.llms]
    )
    write_checked(path, None, text)
    return InitResult(str(path), found.groups, found.skipped, found.llms)


_HEADER = (
    "# epbuild manifest, written by 'epbuild init --from {source}'.\n"
    + _GUIDE
    + """\

[workspace]
out_dir = "build"        # outputs, relative to this file
# jobs = 2               # compiles at once (default: number of CPUs)
"""
)


def _provider_block(target: str | None) -> tuple[str, str]:
    """The provider's name and its table: ``target`` (a well-known SoC) or the starter's."""
    if target is None:
        return "htp-v73", STARTER.split("\n\n")[2] + "\n"
    soc = well_known_target(target)
    if soc is None:
        raise UserError(
            f"--target {target!r} is not a SoC epbuild knows",
            hint="known: " + ", ".join(WELL_KNOWN_TARGETS),
        )
    options = {"htp_arch": soc.htp_arch, "soc_model": soc.soc_model}
    comment = f"{soc.title}: HTP v{soc.htp_arch}"
    return target, table_text(
        "providers", target, {"ep": "qnn", "options": options}, comment
    ) + "\n"


def _group_block(group: FoundGroup, provider: str) -> str:
    """One ``[groups.NAME]`` table; a sharing group says which file its models share."""
    from glob import escape

    models = [escape(m) for m in group.models]  # a file name with [ or * is that file
    lines = []
    if group.share_weights:
        lines.append(f"# These models share {', '.join(group.shared_data)}:")
        lines.append("# one weight-sharing session group (N ctx models + 1 context binary).")
    lines.append(f"[groups.{render_key(group.name)}]")
    if len(models) == 1:
        lines.append(f"models = [{render_value(models[0])}]")
    else:
        lines += ["models = [", *(f"    {render_value(m)}," for m in models), "]"]
    lines.append(f"providers = [{render_value(provider)}]")
    if group.share_weights:
        lines.append("share_weights = true")
    return "\n".join(lines) + "\n"


def _llm_block(llm: FoundLlm, provider: str) -> str:
    """One ``[llms.NAME]`` table, with the loader's defaults written out and explained."""
    found = llm.source
    lines = [
        f"# An onnxruntime-genai model ({found.model_type}): a static context + iterator",
        "# pipeline per provider, packaged for genai (check it: epbuild verify --generate).",
        f"[llms.{render_key(llm.name)}]",
        f"source = {render_value(llm.folder)}",
        f"providers = [{render_value(provider)}]",
    ]
    if found.form == DECODER:
        context = min(DEFAULT_CONTEXT_LENGTH, found.context_limit)
        window = min(DEFAULT_WINDOW_SIZE, context)
        lines += [
            f"context_length = {context}    # prompt + generated tokens "
            f"(the model's limit: {found.context_limit})",
            f"window_size = {window}    # the prompt is read this many tokens at a time",
        ]
    else:
        lines[0] = f"# A decoder-pipeline ({found.context_limit} tokens): its static stages"
        lines[1] = "# compiled as they are, per provider (check it: epbuild verify --generate)."
    lines.append("share_weights = true    # one binary for all graphs; false: checkable on x86_64")
    return "\n".join(lines) + "\n"
