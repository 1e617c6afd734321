"""benchmarks/bench_olive.py: without Olive it says how to install it and exits 0 (CI has
no Olive), and the split it asks Olive for puts every layer in one of the parts."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import waits
from scriptload import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_olive.py"


def _bench() -> ModuleType:
    return load_script("benchmarks/bench_olive.py")


def test_without_olive_it_says_how_to_install_it_and_exits_0(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-python"
    proc = waits.run(
        [sys.executable, str(SCRIPT), "--olive-python", str(missing), str(tmp_path / "ws")],
        "the benchmark without olive",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"olive: not importable in {missing}" in proc.stdout
    assert "pip install olive-ai" in proc.stdout
    assert not (tmp_path / "ws").exists()  # nothing measured, nothing written


def test_split_assignments_cover_every_layer_in_order() -> None:
    bench = _bench()
    found = bench.split_assignments(24, 4)
    assert found["model.embed_tokens"] == 0 and found["lm_head"] == 5
    layers = [found[f"model.layers.{i}"] for i in range(24)]
    assert layers == sorted(layers) and [layers.count(k) for k in (1, 2, 3, 4)] == [6] * 4
    assert found["model.layers.24"] == 4  # the final norm goes with the last part
    assert set(bench.split_assignments(2, 1).values()) == {0, 1, 2}
