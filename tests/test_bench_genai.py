"""benchmarks/bench_genai.py runs end to end and reports what it measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from epbuild.llm.generate import genai_installed

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_genai.py"


# A benchmark's whole pipeline (a cold build, two re-builds, generation on the CPU and the
# emulated HTP). Fast: the builds in test_llm_build.py test_unshared_build_noop_and_rebuilds,
# the generation in test_llm_pipeline.py test_verify_generate_matches_the_source.
@pytest.mark.slow
@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_bench_genai_reports_its_figures() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "3", "--runs", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for label in ("cold build", "unchanged re-build", "search-option edit", "HTP (emulated)"):
        assert label in out
    assert "tokens: all 3 greedy tokens match the source" in out
