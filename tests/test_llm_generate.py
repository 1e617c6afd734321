"""Greedy generation in a child process and the token comparison of verify --generate
(epbuild/llm/generate.py): a crash or a missing onnxruntime-genai is a reason, never a
crash of epbuild; near ties are told apart from clear divergences."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from epbuild.llm.generate import (
    Generation,
    GenerationError,
    Verdict,
    compare,
    genai_installed,
    generate,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"


def _gen(tokens: list[int], margins: list[float]) -> Generation:
    return Generation(tuple(tokens), tuple(margins), 1.0)


def test_compare_match() -> None:
    result = compare(_gen([1, 2, 3], [0.0] * 3), _gen([1, 2, 3], [0.5] * 3), 0.05)
    assert (result.verdict, result.matched, result.compared) == (Verdict.MATCH, 3, 3)
    assert result.describe() == "all 3 greedy tokens match the source"


def test_compare_near_tie_is_not_a_failure() -> None:
    result = compare(_gen([1, 9, 3], [0.5] * 3), _gen([1, 2, 3], [0.5, 0.02, 0.5]), 0.05)
    assert result.verdict is Verdict.NEAR_TIE and result.step == 1 and result.matched == 1
    assert "near tie at step 1: token 9 vs the source's 2 (source top-2 margin 0.020)" in (
        result.describe()
    )


def test_compare_clear_divergence() -> None:
    result = compare(_gen([1, 2, 7, 7], [0.5] * 4), _gen([1, 2, 3, 3], [0.5, 0.5, 0.4, 0.1]), 0.05)
    assert result.verdict is Verdict.DIVERGED
    assert result.to_json() == {
        "verdict": "diverged",
        "matched": 2,
        "compared": 4,
        "step": 2,
        "package_token": 7,
        "source_token": 3,
        "margin": 0.4,
    }


@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_generate_on_cpu_is_deterministic() -> None:
    first = generate(FIXTURES / "llama", qnn=False, tokens=6, max_length=32)
    again = generate(FIXTURES / "llama", qnn=False, tokens=6, max_length=32)
    assert len(first.tokens) == 6 and first.tokens == again.tokens
    assert len(first.margins) == 6 and all(m >= 0 for m in first.margins)
    assert first.tokens_per_second > 0
    assert compare(first, again, 0.05).verdict is Verdict.MATCH


@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_broken_model_is_a_reason(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", folder)
    (folder / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(GenerationError) as info:
        generate(folder, qnn=False, tokens=4, max_length=32)
    assert info.value.reason.startswith("generation failed (exit 1): ")


def _wrapper(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


def test_a_crash_is_a_reason(tmp_path: Path) -> None:
    python = _wrapper(tmp_path, "echo about to crash >&2; kill -SEGV $$")
    with pytest.raises(GenerationError) as info:
        generate(FIXTURES / "llama", qnn=True, tokens=4, max_length=32, python=python)
    assert "killed by SIGSEGV" in info.value.reason and "about to crash" in info.value.reason


def test_without_genai_says_how_to_install(tmp_path: Path) -> None:
    python = _wrapper(tmp_path, f'exec {sys.executable} -S "$@"')  # no site-packages
    with pytest.raises(GenerationError) as info:
        generate(FIXTURES / "llama", qnn=False, tokens=4, max_length=32, python=python)
    assert info.value.reason.startswith("onnxruntime-genai is not installed")
    assert 'pip install "epbuild[genai]"' in info.value.reason
