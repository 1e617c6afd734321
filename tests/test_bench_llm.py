"""benchmarks/bench_llm.py: its command line, and the LLM-like workspace it generates."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest
import waits
from onnx import numpy_helper
from scriptload import load_script

from epbuild import status

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_llm.py"


def _bench() -> ModuleType:
    return load_script("benchmarks/bench_llm.py")


def _external(model: onnx.ModelProto) -> dict[str, dict[str, str]]:
    return {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer}


def test_help_lists_the_parameters() -> None:
    proc = waits.run([sys.executable, str(SCRIPT), "--help"], "the benchmark's --help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--parts", "--layers", "--hidden", "--workdir", "--keep", "--runs", "--json"):
        assert flag in proc.stdout


def test_each_part_shares_one_external_file(tmp_path: Path) -> None:
    bench = _bench()
    bench.make_workspace(tmp_path, parts=2, layers=3, hidden=16)
    weights = []
    for k in range(2):
        d = tmp_path / "models" / f"part{k}"
        assert sorted(p.name for p in d.iterdir()) == ["decode.onnx", "prefill.onnx", "weights.bin"]
        assert (d / "weights.bin").stat().st_size == 3 * bench.layer_bytes(16)
        prefill, decode = (onnx.load(str(d / f"{s}.onnx"), load_external_data=False)
                           for s in ("prefill", "decode"))  # fmt: skip
        refs = _external(prefill)
        assert len(refs) == 3 and refs == _external(decode)  # the same file, the same offsets
        assert {r["location"] for r in refs.values()} == {"weights.bin"}
        assert len({r["offset"] for r in refs.values()}) == 3
        shapes = [[d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
                  for m in (prefill, decode)]  # fmt: skip
        assert shapes == [[1, 128, 16], [1, 1, 16]]
        for s in ("prefill", "decode"):
            onnx.checker.check_model(str(d / f"{s}.onnx"))  # external data inside the folder
        loaded = onnx.load(str(d / "decode.onnx"))
        weights.append(numpy_helper.to_array(loaded.graph.initializer[2]))
    assert not np.array_equal(weights[0], weights[1])  # each part has its own seed

    again = tmp_path / "again"
    bench.make_workspace(again, parts=2, layers=3, hidden=16)
    for p in (tmp_path / "models").rglob("*"):
        if p.is_file():
            assert p.read_bytes() == (again / p.relative_to(tmp_path)).read_bytes()

    result = status(tmp_path)
    assert [a.id for a in result.actions] == ["part0/htp", "part1/htp"]
    assert all(a.stale for a in result.actions)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_run_passes_its_checks(tmp_path: Path) -> None:
    args = ["--parts", "2", "--layers", "1", "--hidden", "32", "--runs", "1", "--json"]
    proc = waits.run(
        [sys.executable, str(SCRIPT), *args, "--workdir", str(tmp_path / "work"), "--quiet"],
        "the tiny LLM benchmark run",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout)
    assert figures["checks"] and all(figures["checks"].values()), figures["checks"]
    assert figures["change_one_part_rebuilt"] == ["part1/htp"]
    assert list((tmp_path / "work").iterdir()) == []  # without --keep nothing is left behind
