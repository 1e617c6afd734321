"""Benchmark an LLM entry end to end on the committed builder-made fixtures.

    python benchmarks/bench_genai.py [--family llama|qwen2|llama-pipeline] [--tokens 20]
        [--runs 3]

In a temp workspace, for one fixture, unshared, HTP v73: the cold build (static
preparation as an action in a worker + two QNN compiles + the package files; a decoder-pipeline
fixture compiles its static stages as they are), the unchanged re-build (the full path,
which records the no-op fingerprint), the no-op build after it (the fast path: stats only,
median of --runs), a config-only edit of the source (search options: rewrites
genai_config.json, compiles nothing), then greedy
generation with onnxruntime-genai: tokens/s of the package through the QNN EP (emulated HTP
on x86_64) and of the source on the CPU, each the median of --runs child processes (prompt
included), and whether the tokens matched.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from llmfixture import chat_manifest, place_source  # noqa: E402  (the tests' fixtures)


def _epbuild(ws: Path, *args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "epbuild", "-C", str(ws), *args],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["llama", "qwen2", "llama-pipeline"], default="llama")
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from epbuild.llm.generate import DEFAULT_NEAR_TIE, compare, generate

    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        place_source(ws, args.family)
        (ws / "epbuild.toml").write_text(chat_manifest())
        cold = _epbuild(ws, "build")
        warm = _epbuild(ws, "build")
        noop = statistics.median(_epbuild(ws, "build") for _ in range(max(args.runs, 1)))
        config = ws / "models" / "tiny" / "genai_config.json"
        data = json.loads(config.read_text())
        data["search"]["top_k"] = 7
        config.write_text(json.dumps(data))
        edit = _epbuild(ws, "build")
        package = ws / "build" / "chat" / "htp-v73"
        assert json.loads((package / "genai_config.json").read_text())["search"]["top_k"] == 7
        htp = [
            generate(package, qnn=True, tokens=args.tokens, max_length=64) for _ in range(args.runs)
        ]
        cpu = [
            generate(ws / "models" / "tiny", qnn=False, tokens=args.tokens, max_length=64)
            for _ in range(args.runs)
        ]
    result = compare(htp[0], cpu[0], DEFAULT_NEAR_TIE)
    print(f"fixture: {args.family}, {args.tokens} tokens, {args.runs} runs")
    print(f"cold build (prepare + 2 compiles + package): {cold:.2f} s")
    print(f"unchanged re-build: {warm:.2f} s")
    print(f"no-op build (fast path): {noop:.3f} s")
    print(f"search-option edit (config rewritten, nothing compiled): {edit:.2f} s")
    print(f"HTP (emulated) tokens/s: {statistics.median(g.tokens_per_second for g in htp):.1f}")
    print(f"CPU source tokens/s: {statistics.median(g.tokens_per_second for g in cpu):.1f}")
    print(f"tokens: {result.describe()}")


if __name__ == "__main__":
    main()
