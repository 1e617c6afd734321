"""``epbuild init``: write a commented starter manifest (tomlkit keeps comments on edits)."""

from __future__ import annotations

import os

from epbuild._names import MANIFEST_NAME
from epbuild.errors import UserError

STARTER = """\
# epbuild manifest (README.md documents every key).
# Validate in your editor with schemas/epbuild.schema.json.

[workspace]
out_dir = "build"        # outputs, relative to this file
# jobs = 2               # compiles at once (default: number of CPUs)

# A named provider configuration: which EP, which target.
[providers.htp-v73]
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


def init(directory: str | os.PathLike[str] = ".", name: str | None = None) -> str:
    """Create a starter manifest; refuses to overwrite one. Returns its path."""
    import tomlkit

    path = os.path.join(os.fspath(directory), name or MANIFEST_NAME)
    if os.path.lexists(path):
        raise UserError(f"{path} already exists; not overwriting it")
    doc = tomlkit.parse(STARTER)  # round-trip through tomlkit: what we write is valid TOML
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "x", encoding="utf-8") as f:
        f.write(tomlkit.dumps(doc))
    return path
