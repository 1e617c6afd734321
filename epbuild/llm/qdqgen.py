"""The tokens of a quantized LLM's QDQ graphs on the CPU, teacher-forced on its source's
(``verify --generate``): ONNX Runtime's reference of what the package's quantized graphs
should compute, so that a package that disagrees with its source can be told apart as "the
quantization loses it" (the QDQ graphs disagree too) or "the EP runs the quantized graphs
differently" (they agree).

The QDQ static graphs run in a child process through the feed loop calibration uses
(``epbuild.llm.calibrate.run_prompt``: genai's own recipe), each step's greedy choice taken
before the source's token is fed, as ``epbuild.llm.generate`` teacher-forces a package; a
decoder in parts runs as genai runs it, the CPU embeddings stage then each part's graphs
(``epbuild.llm.calibrate.Chain``). The coordinator imports neither numpy nor onnxruntime;
a crash of the child is a reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from epbuild.executors.local import own_command
from epbuild.llm.calibrate import (
    CONTEXT,
    ITERATOR,
    Chain,
    cpu_session,
    graph_of,
    static_io,
    teacher_forced,
    tokenize,
)
from epbuild.llm.genai_config import EMBEDDINGS
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.llm.generate import GenerationError, GenerationTimeout, PromptProgress, _failure

MODULE = "epbuild.llm.qdqgen"


def qdq_tokens(
    source: str,
    graphs: Mapping[str, str],
    *,
    window: int,
    context_length: int,
    prompts: Sequence[str],
    forced: Sequence[Sequence[int]],
    timeout: float | None,
    embeddings: str | None = None,
) -> list[tuple[int, ...]]:
    """Per prompt, the QDQ graphs' (``graphs``: ``context``/``iterator`` → path, or each
    part's ``partK_context``/``partK_iterator`` in session order after the CPU
    ``embeddings`` stage) greedy token at each step of ``forced`` (the source's tokens), in
    a child process; the prompts are tokenized by ``source``'s tokenizer (a genai model
    folder). ``GenerationTimeout`` after ``timeout`` seconds, ``GenerationError`` when it
    fails."""
    job = {
        "source": source,
        "graphs": dict(graphs),
        "embeddings": embeddings,
        "window": window,
        "context_length": context_length,
        "prompts": list(prompts),
        "forced": [list(f) for f in forced],
    }
    try:
        proc = subprocess.run(
            own_command(MODULE),
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        assert timeout is not None
        progress = [PromptProgress(of=len(f)) for f in forced]
        raise GenerationTimeout(timeout, True, progress) from None
    if proc.returncode != 0:
        raise GenerationError(_failure(proc))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise GenerationError(f"the QDQ graphs printed no result: {proc.stdout[-300:]!r}")
    return [tuple(int(t) for t in tokens) for tokens in json.loads(lines[-1])["tokens"]]


def _run(job: dict[str, Any]) -> dict[str, Any]:
    """In the child: tokenize, then run each prompt through the QDQ graphs on the CPU."""
    start = time.perf_counter()
    with open(f"{job['source']}/{GENAI_CONFIG}", encoding="utf-8") as f:
        io = static_io(json.load(f), int(job["window"]), int(job["context_length"]))
    context, iterator = _runners(job["graphs"], job["embeddings"])
    found = [
        teacher_forced(context, iterator, tokens, io, forced)
        for tokens, forced in zip(
            tokenize(job["source"], job["prompts"]), job["forced"], strict=True
        )
    ]
    return {"tokens": found, "seconds": time.perf_counter() - start}


def _runners(graphs: Mapping[str, str], embeddings: str | None) -> tuple[Any, Any]:
    """The context and the iterator runner: the two graphs' sessions, or for a decoder in
    parts the chains of the embeddings stage and each part's graph."""
    if embeddings is None:
        return cpu_session(graphs[CONTEXT]), cpu_session(graphs[ITERATOR])
    first = (EMBEDDINGS, cpu_session(embeddings))
    context, iterator = (
        Chain(
            [first, *((s, cpu_session(p)) for s, p in graphs.items() if graph_of(s) == g)],
            lambda *_: None,
        )
        for g in (CONTEXT, ITERATOR)
    )
    return context, iterator


def main() -> None:
    """Entry point of the child: one JSON job on stdin, one JSON line on stdout."""
    result = _run(json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
