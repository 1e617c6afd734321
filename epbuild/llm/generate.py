"""Greedy generation with onnxruntime-genai in a child process, and the step-by-step
comparison of a package's tokens with its source's (the core of ``verify --generate``).

The coordinator never imports onnxruntime_genai: a child process generates and prints one
JSON line, so a crash of ORT, genai or the EP (a signal) becomes a reason, never a crash of
epbuild. HTP computes in fp16: a flip where the source's top two logits are within
``near_tie`` of each other is a near tie, not a failure (measured margins:
docs/research/qnn-plugin.md).

A package generates *teacher-forced* on its source's tokens (``forced``): at each step it
gives its own greedy choice, then continues from the source's token, so that a package that
flips one token is still compared with the source's text after it (``epbuild.llm.agreement``
counts the steps that agree). Up to the first difference this is exactly free-running greedy
generation. The child says what it is doing line by line, so that a generation stopped at
its time limit says how far it got (``GenerationTimeout``).
"""

from __future__ import annotations

import enum
import importlib.util
import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epbuild._dataclass import dataclass, field
from epbuild._names import GENERATE_TIMEOUT
from epbuild.errors import UserError

INSTALL_HINT = 'install onnxruntime-genai: pip install "epbuild[genai]"'
DEFAULT_PROMPT = "The quick brown fox"
DEFAULT_NEAR_TIE = 0.05
"""Largest top-2 margin of the source's logits at which a flipped token is a near tie."""

DEFAULT_TIMEOUT = GENERATE_TIMEOUT
"""Seconds one child (a package's or a source's generation, every prompt) may take."""
LONGEST_TIMEOUT = 2_000_000.0
"""Seconds beyond which a timeout is no limit: a child is waited on with ``poll``, whose
timeout is an int of milliseconds (2^31 ms is 24.8 days)."""

_CHILD = r"""
import json, sys, time
args = json.loads(sys.stdin.readline())
try:
    import onnxruntime_genai as og
except Exception as exc:
    if getattr(exc, "name", None) == "onnxruntime_genai":
        raise  # not installed: said as such
    print(json.dumps({"event": "unusable", "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    sys.exit(3)
import numpy as np
def say(**event):
    print(json.dumps(event), flush=True)
if args["qnn"]:
    import onnxruntime_qnn as qnn
    og.register_execution_provider_library("QNNExecutionProvider", qnn.get_library_path())
model = og.Model(args["folder"])
tokenizer = og.Tokenizer(model)
say(event="loaded")
for index, text in enumerate(args["prompts"]):
    forced = args["forced"][index] if args["forced"] is not None else None
    limit = len(forced) if forced is not None else args["tokens"]
    prompt = tokenizer.encode(text)
    say(event="prompt", index=index, prompt_tokens=len(prompt), of=limit)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=args["max_length"], do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    tokens, margins = [], []
    while not generator.is_done() and len(tokens) < limit:
        logits = np.array(generator.get_logits(), dtype=np.float32)
        rows = logits.reshape(-1, logits.shape[-1])
        top = np.partition(rows[-1], -2)[-2:]
        margins.append(float(abs(top[1] - top[0])))
        if forced is None:
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        else:
            tokens.append(int(rows[-1].argmax()))
            want = forced[len(tokens) - 1]
            if want != tokens[-1]:  # continue from the source's token, not its own
                rows[-1, want] = rows[-1].max() + 1.0
                generator.set_logits(logits)
            generator.generate_next_token()
        say(event="token", index=index, count=len(tokens))
    seconds = time.perf_counter() - start
    say(event="done", index=index, tokens=tokens, margins=margins, seconds=seconds,
        prompt_tokens=len(prompt))
"""


class GenerationError(Exception):
    """Generation could not run or did not finish; ``reason`` says why, ``prompt_tokens``
    how many tokens each prompt it had read was (where the child said)."""

    def __init__(self, reason: str, prompt_tokens: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.prompt_tokens = prompt_tokens


class GenaiUnusable(UserError):
    """onnxruntime-genai is installed but does not import (a broken wheel, a library it
    needs missing): nothing can generate here, whatever the model."""


@dataclass(frozen=True)
class PromptProgress:
    """How far one prompt got when its child was stopped."""

    started: bool = False
    prompt_tokens: int = 0
    tokens: int = 0
    """Tokens generated."""
    of: int = 0
    """Tokens it was to generate."""
    done: bool = False

    def describe(self) -> str:
        if not self.started:
            return f"not started, 0 of {self.of} tokens"
        if self.done:
            return f"done, {self.tokens} of {self.of} tokens"
        if self.tokens == 0:
            return f"0 of {self.of} tokens (reading its {self.prompt_tokens}-token prompt)"
        return f"{self.tokens} of {self.of} tokens"


class GenerationTimeout(GenerationError):
    """The child ran out of time; ``progress`` says how far each prompt got."""

    def __init__(self, seconds: float, loaded: bool, progress: list[PromptProgress]) -> None:
        self.seconds = seconds
        self.loaded = loaded
        self.progress = progress
        if not loaded:
            total = sum(p.of for p in progress)
            where = f"still loading the model, 0 of {total} tokens"
        elif len(progress) == 1:
            where = progress[0].describe()
        else:
            where = "; ".join(
                f"prompt {i} of {len(progress)}: {p.describe()}" for i, p in enumerate(progress, 1)
            )
        super().__init__(f"generation did not finish within {seconds:g} s: {where}")


@dataclass(frozen=True)
class Generation:
    """What one greedy generation produced."""

    tokens: tuple[int, ...]
    margins: tuple[float, ...]
    """Per step, the top-1 minus top-2 logit of the step's distribution."""
    seconds: float
    """Prompt plus generation, wall clock."""
    prompt_tokens: int = 0
    """The prompt's tokens (0: not known)."""

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
    timeout: float | None = DEFAULT_TIMEOUT,
    python: str = sys.executable,
) -> Generation:
    """Greedy-generate up to ``tokens`` tokens from ``folder`` (a genai model folder) in a
    child process; ``qnn`` registers the QNN plugin as genai wants it."""
    (found,) = generate_all(
        folder,
        qnn=qnn,
        tokens=tokens,
        prompts=[prompt],
        max_length=max_length,
        timeout=timeout,
        python=python,
    )
    return found


def generate_all(
    folder: str | Path,
    *,
    qnn: bool,
    tokens: int,
    prompts: Sequence[str],
    max_length: int,
    forced: Sequence[Sequence[int]] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    python: str = sys.executable,
) -> list[Generation]:
    """One generation per prompt, in one child process (the model is loaded once). With
    ``forced`` (token ids per prompt: the source's), each step's token is the model's own
    greedy choice after the forced tokens before it (teacher forcing), as many steps as
    forced. ``timeout``: seconds for the whole child (None: no limit); when it runs out,
    ``GenerationTimeout`` says how far each prompt got."""
    args = {
        "folder": str(folder),
        "qnn": qnn,
        "tokens": tokens,
        "prompts": list(prompts),
        "forced": [list(f) for f in forced] if forced is not None else None,
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
    except subprocess.TimeoutExpired as exc:
        assert timeout is not None
        out = exc.stdout  # bytes on POSIX, whatever ``text`` says
        said = out.decode("utf-8", "replace") if isinstance(out, bytes) else (out or "")
        wanted = [len(f) for f in forced] if forced is not None else [tokens] * len(prompts)
        loaded, progress = read_progress(said, wanted)
        raise GenerationTimeout(timeout, loaded, progress) from None
    events = _events(proc.stdout)
    for event in events:
        if event.get("event") == "unusable":
            raise GenaiUnusable(
                f"onnxruntime-genai is installed but does not import: {event.get('error')}",
                hint='reinstall it (pip install --force-reinstall "epbuild[genai]"), or '
                "install what its error names",
            )
    if proc.returncode != 0:
        sizes = tuple(int(e["prompt_tokens"]) for e in events if e.get("event") == "prompt")
        raise GenerationError(_failure(proc), sizes)
    done = [e for e in events if e.get("event") == "done"]
    if len(done) != len(prompts):
        raise GenerationError(f"generation printed no result: {proc.stdout[-300:]!r}")
    return [
        Generation(
            tuple(e["tokens"]), tuple(e["margins"]), float(e["seconds"]), int(e["prompt_tokens"])
        )
        for e in done
    ]


def _events(text: str) -> list[dict[str, Any]]:
    """The child's JSON lines (anything else it printed is left out)."""
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def read_progress(text: str, wanted: Sequence[int]) -> tuple[bool, list[PromptProgress]]:
    """From what a child printed before it was stopped: whether it loaded the model, and
    how far each prompt got of the tokens ``wanted`` of it."""
    loaded = False
    prompts = len(wanted)
    progress = [PromptProgress(of=n) for n in wanted]
    for event in _events(text):
        kind, index = event.get("event"), event.get("index")
        if kind == "loaded":
            loaded = True
        if not isinstance(index, int) or not 0 <= index < prompts:
            continue
        now = progress[index]
        if kind == "prompt":
            progress[index] = PromptProgress(True, int(event["prompt_tokens"]), 0, int(event["of"]))
        elif kind == "token":
            progress[index] = PromptProgress(True, now.prompt_tokens, int(event["count"]), now.of)
        elif kind == "done":
            count = len(event["tokens"])
            progress[index] = PromptProgress(True, now.prompt_tokens, count, now.of, done=True)
    return loaded, progress


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
