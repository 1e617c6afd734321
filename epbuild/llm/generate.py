"""Greedy generation with onnxruntime-genai in a child process, and the step-by-step
comparison of a package's tokens with its source's (the core of ``verify --generate``).

The coordinator never imports onnxruntime_genai: a child process generates and prints one
JSON line, so a crash of ORT, genai or the EP (a signal) becomes a reason, never a crash of
epbuild. HTP computes in fp16: a flip where the source's top two logits are within
``near_tie`` of each other is a near tie, not a failure (measured margins:
docs/research/qnn-plugin.md).
"""

from __future__ import annotations

import enum
import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from epbuild._dataclass import dataclass, field

INSTALL_HINT = 'install onnxruntime-genai: pip install "epbuild[genai]"'
DEFAULT_PROMPT = "The quick brown fox"
DEFAULT_NEAR_TIE = 0.05
"""Largest top-2 margin of the source's logits at which a flipped token is a near tie."""

_CHILD = r"""
import json, sys, time
args = json.loads(sys.stdin.readline())
import onnxruntime_genai as og
import numpy as np
if args["qnn"]:
    import onnxruntime_qnn as qnn
    og.register_execution_provider_library("QNNExecutionProvider", qnn.get_library_path())
model = og.Model(args["folder"])
tokenizer = og.Tokenizer(model)
prompt = tokenizer.encode(args["prompt"])
params = og.GeneratorParams(model)
params.set_search_options(max_length=args["max_length"], do_sample=False)
generator = og.Generator(model, params)
start = time.perf_counter()
generator.append_tokens(prompt)
tokens, margins = [], []
while not generator.is_done() and len(tokens) < args["tokens"]:
    generator.generate_next_token()
    logits = np.asarray(generator.get_output("logits"), dtype=np.float32)
    last = logits.reshape(-1, logits.shape[-1])[-1]
    top = np.partition(last, -2)[-2:]
    margins.append(float(abs(top[1] - top[0])))
    tokens.append(int(generator.get_next_tokens()[0]))
seconds = time.perf_counter() - start
print(json.dumps({"tokens": tokens, "margins": margins, "seconds": seconds,
                  "prompt_tokens": len(prompt)}))
"""


class GenerationError(Exception):
    """Generation could not run or did not finish; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Generation:
    """What one greedy generation produced."""

    tokens: tuple[int, ...]
    margins: tuple[float, ...]
    """Per step, the top-1 minus top-2 logit of the step's distribution."""
    seconds: float
    """Prompt plus generation, wall clock."""

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def genai_installed() -> bool:
    """Whether onnxruntime-genai is importable here (without importing it)."""
    return importlib.util.find_spec("onnxruntime_genai") is not None


def generate(
    folder: str | Path,
    *,
    qnn: bool,
    tokens: int,
    prompt: str = DEFAULT_PROMPT,
    max_length: int,
    timeout: float = 600,
    python: str = sys.executable,
) -> Generation:
    """Greedy-generate up to ``tokens`` tokens from ``folder`` (a genai model folder) in a
    child process; ``qnn`` registers the QNN plugin as genai wants it."""
    args = {
        "folder": str(folder),
        "qnn": qnn,
        "tokens": tokens,
        "prompt": prompt,
        "max_length": max_length,
    }
    try:
        proc = subprocess.run(
            [python, "-c", _CHILD],
            input=json.dumps(args) + "\n",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise GenerationError(f"generation did not finish in {timeout:.0f}s") from None
    if proc.returncode != 0:
        raise GenerationError(_failure(proc))
    try:
        data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise GenerationError(f"generation printed no result: {proc.stdout[-300:]!r}") from None
    return Generation(tuple(data["tokens"]), tuple(data["margins"]), float(data["seconds"]))


def _failure(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "no output"
    if "No module named 'onnxruntime_genai'" in proc.stderr:
        return f"onnxruntime-genai is not installed ({INSTALL_HINT})"
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"the generating process was killed by {name} (last line: {last})"
    return f"generation failed (exit {proc.returncode}): {last}"


class Verdict(enum.Enum):
    """How a package's tokens compare with its source's."""

    MATCH = "match"
    NEAR_TIE = "near_tie"
    """A flip where the source's top two were within the margin: not a failure."""
    DIVERGED = "diverged"


@dataclass(frozen=True)
class Comparison:
    """The step-by-step comparison of one package with its source."""

    verdict: Verdict
    matched: int
    """Steps whose tokens agree before the first difference (or all compared)."""
    compared: int
    step: int | None = None
    """The first step whose tokens differ."""
    package_token: int | None = None
    source_token: int | None = None
    margin: float | None = None
    """The source's top-2 margin at that step."""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "matched": self.matched,
            "compared": self.compared,
            "step": self.step,
            "package_token": self.package_token,
            "source_token": self.source_token,
            "margin": self.margin,
        }

    def describe(self) -> str:
        """One line for the report."""
        if self.verdict is Verdict.MATCH:
            return f"all {self.compared} greedy tokens match the source"
        what = "near tie" if self.verdict is Verdict.NEAR_TIE else "diverged"
        return (
            f"{what} at step {self.step}: token {self.package_token} vs the source's "
            f"{self.source_token} (source top-2 margin {self.margin:.3f}); "
            f"{self.matched} steps matched before"
        )


def compare(package: Generation, source: Generation, near_tie: float) -> Comparison:
    """Compare token ids step by step up to the first difference (after it, the two
    sequences continue from different text, so later steps say nothing)."""
    compared = min(len(package.tokens), len(source.tokens))
    for step in range(compared):
        a, b = package.tokens[step], source.tokens[step]
        if a == b:
            continue
        margin = source.margins[step]
        verdict = Verdict.NEAR_TIE if margin <= near_tie else Verdict.DIVERGED
        return Comparison(verdict, step, compared, step, a, b, margin)
    return Comparison(Verdict.MATCH, compared, compared)
