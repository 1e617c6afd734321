"""The tiny genai model folders under ``tests/fixtures/llm`` and the manifest that builds one
(tests and ``benchmarks/bench_genai.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

LLM_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"
"""One folder per family: ``llama``, ``qwen2``, ``llama-pipeline``, ``llama-text``
(``make_*_fixture.py`` made them)."""
TEXT_PROMPTS = LLM_FIXTURES / "text-prompts.txt"
"""Ten prompts, one a line, that ``llama-text`` continues with clear margins."""


def chat_manifest(*, share: bool = False, context: int | None = 64, window: int | None = 16) -> str:
    """``epbuild.toml`` with one LLM, ``chat`` (source ``models/tiny``), for HTP v73;
    ``context``/``window`` None leave ``context_length``/``window_size`` out."""
    lines = [
        "[providers.htp-v73]",
        'ep = "qnn"',
        'options = { htp_arch = "73", soc_model = "60" }',
        "",
        "[llms.chat]",
        'source = "models/tiny"',
        'providers = ["htp-v73"]',
    ]
    if context is not None:
        lines.append(f"context_length = {context}")
    if window is not None:
        lines.append(f"window_size = {window}")
    lines.append(f"share_weights = {str(share).lower()}")
    return "\n".join(lines) + "\n"


def place_source(root: Path, family: str = "llama") -> Path:
    """Copy the fixture ``family`` to ``root/models/tiny`` (left as it is when already there:
    a test may have edited it); returns that folder."""
    folder = root / "models" / "tiny"
    if not folder.exists():
        shutil.copytree(LLM_FIXTURES / family, folder)
    return folder
