"""``verify --generate``: each built LLM package generates greedily through its provider
(onnxruntime-genai in a child process), its source folder on the CPU the same way, and the
token ids are compared step by step (``epbuild.llm.generate``, ``epbuild.llm.agreement``).

Verdicts, per prompt: ``ok`` (an unquantized package: all compared steps match, or the first
difference is a near tie; a quantized one: its tokens agree with the source's at
``min_token_agreement`` of the steps or more), ``failed`` (a clear-margin divergence, too
little agreement, a generation that could not run or did not finish within ``--timeout``),
and ``not_checkable`` with the reason (a weight-shared HTP package on x86_64, whose loading
crashes ONNX Runtime's emulation; the source could not generate).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import UserError
from epbuild.kinds.llmquant import LlmQuantizeAction
from epbuild.llm.agreement import Agreement, token_agreement
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.llm.generate import (
    DEFAULT_NEAR_TIE,
    DEFAULT_PROMPT,
    DEFAULT_TIMEOUT,
    INSTALL_HINT,
    Comparison,
    Generation,
    GenerationError,
    GenerationTimeout,
    Verdict,
    compare,
    genai_installed,
    generate_all,
)
from epbuild.llm.qdqgen import qdq_tokens
from epbuild.planning.llms import LlmGroup
from epbuild.results import CheckStatus

if TYPE_CHECKING:
    from epbuild.manifest.model import Llm, Manifest
    from epbuild.planning.actions import CompileAction
    from epbuild.planning.workspace import Workspace

SHARED_ON_X86 = (
    "a weight-shared HTP package (one binary for both graphs) crashes ONNX Runtime's x86_64 "
    "emulation when loaded (in onnxruntime-genai and plain ONNX Runtime alike): check it on "
    "a device, or build with share_weights = false to check it here"
)
TIMEOUT_HINT = "give it more time with --timeout SECONDS (0: no limit)"


@dataclass(frozen=True)
class TokenLimit:
    """The agreement a quantized LLM's package must reach, and the key that sets it."""

    share: float
    key: str
    """Where it comes from: ``[quantization.NAME.check] min_token_agreement``."""


@dataclass
class PromptCheck:
    """One prompt's comparison of a package with its source."""

    prompt: str
    status: CheckStatus
    comparison: Comparison
    agreement: Agreement
    tokens_per_second: float
    source_tokens_per_second: float
    qdq: Agreement | None = None
    """A quantized package's QDQ graphs on the CPU against the source (None: not run)."""
    versus_qdq: Agreement | None = None
    """The package against its QDQ graphs on the CPU, step by step."""

    def describe(self) -> str:
        """The verdict in words: ``compare``'s for an unquantized package (with the
        agreement after a difference), the agreement for a quantized one."""
        if self.agreement.min_agreement is None:
            text = self.comparison.describe()
            if self.comparison.verdict is not Verdict.MATCH:
                text += f"; {self.agreement.agreed} of {self.agreement.compared} agree"
            return text
        text = self.agreement.describe()
        c = self.comparison
        if c.step is not None:
            text += (
                f", first difference at step {c.step}: token {c.package_token} vs the "
                f"source's {c.source_token} (source top-2 margin {c.margin:.3f})"
            )
        text += self._reference()
        return text if self.status is CheckStatus.OK else "too few agree: " + text

    def _reference(self) -> str:
        """What the QDQ graphs on the CPU say: where the package's tokens leave the source's
        while theirs do not, the EP runs the quantized graphs differently; where theirs leave
        it too, the quantization itself loses them."""
        qdq, versus = self.qdq, self.versus_qdq
        if qdq is None or versus is None:
            return ""
        text = (
            f"; the QDQ model on the CPU: {qdq.agreed} of {qdq.compared} agree with the "
            f"source{_from(qdq)}, the package {versus.agreed} of {versus.compared} with it"
            f"{_from(versus)}"
        )
        if self.status is CheckStatus.OK:
            return text
        if qdq.passes:
            return text + (
                ": the EP runs the quantized graphs differently from ONNX Runtime's QDQ "
                "reference (the quantization keeps the tokens; try other weight types)"
            )
        return text + (
            ": the quantization itself loses them (give the layers 'verify --numerics' names "
            "another type in overrides, or exclude them)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "status": self.status.value,
            "comparison": self.comparison.to_json(),
            "agreement": self.agreement.to_json(),
            "tokens_per_second": self.tokens_per_second,
            "source_tokens_per_second": self.source_tokens_per_second,
            "qdq_agreement": self.qdq.to_json() if self.qdq is not None else None,
            "agreement_with_qdq": self.versus_qdq.to_json() if self.versus_qdq else None,
        }


def _from(agreement: Agreement) -> str:
    step = agreement.first_difference
    return "" if step is None else f" (first difference at step {step})"


@dataclass
class GenerationCheck:
    """One LLM package's generation check."""

    package: str
    """``<llm>/<provider>``."""
    folder: str
    """The package folder, workspace-relative."""
    status: CheckStatus
    reason: str = ""
    comparison: Comparison | None = None
    """The first prompt's (``prompts`` has each one's)."""
    tokens_per_second: float | None = None
    source_tokens_per_second: float | None = None
    prompt: str | None = None
    """The first prompt."""
    prompts: tuple[PromptCheck, ...] = ()
    limit: TokenLimit | None = None
    """A quantized package's agreement limit (None: it must match)."""
    timed_out: bool = False
    qdq_reason: str = ""
    """Why a quantized package's QDQ graphs could not run on the CPU (empty: they ran)."""

    def line(self) -> str:
        """One line for the report (one more per prompt where there are several)."""
        head = f"{self.package}: generate: "
        if not self.prompts:
            word = "not checkable" if self.status is CheckStatus.NOT_CHECKABLE else "failed"
            return f"{head}{word}: {self.reason}"
        rate = (
            f" ({self.tokens_per_second:.1f} tokens/s; "
            f"CPU source {self.source_tokens_per_second:.1f} tokens/s)"
        )
        limit = f" [{self.limit.key}]" if self.limit is not None else ""
        if self.qdq_reason:
            limit += f"; the QDQ model on the CPU could not run: {self.qdq_reason}"
        if len(self.prompts) == 1:
            return head + self.prompts[0].describe() + rate + limit
        bad = sum(1 for p in self.prompts if p.status is CheckStatus.FAILED)
        verdict = f"{bad} of {len(self.prompts)} prompts fail" if bad else "every prompt passes"
        lines = [f"{head}{len(self.prompts)} prompts: {verdict}{rate}{limit}"]
        lines += [
            f"  prompt {i} {p.prompt!r}: {p.describe()}" for i, p in enumerate(self.prompts, 1)
        ]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "package": self.package,
            "folder": self.folder,
            "status": self.status.value,
            "reason": self.reason or None,
            "comparison": self.comparison.to_json() if self.comparison else None,
            "tokens_per_second": self.tokens_per_second,
            "source_tokens_per_second": self.source_tokens_per_second,
            "prompt": self.prompt,
            "prompts": [p.to_json() for p in self.prompts],
            "min_token_agreement": self.limit.share if self.limit is not None else None,
            "timed_out": self.timed_out,
            "qdq_reason": self.qdq_reason or None,
        }


def require_genai() -> None:
    """``UserError`` saying how to install onnxruntime-genai where it is missing."""
    if not genai_installed():
        raise UserError("verify --generate needs onnxruntime-genai", hint=INSTALL_HINT)


def check_generation(
    ws: Workspace,
    *,
    tokens: int,
    prompt: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> list[GenerationCheck]:
    """One check per selected LLM × provider; ``prompt`` wins over the entry's own.
    ``timeout``: seconds each generation (a package's, a source's: every prompt) may take
    (None: no limit)."""
    targets: dict[tuple[str, str], list[CompileAction]] = {}
    for action in ws.actions:
        if isinstance(action.group, LlmGroup):
            targets.setdefault((action.group.name, action.provider.name), []).append(action)
    return [
        _check(ws, name, actions, tokens, prompt, timeout) for (name, _), actions in targets.items()
    ]


def token_limit(manifest: Manifest, llm: Llm) -> TokenLimit | None:
    """The agreement an LLM's package must reach: None (it must match the source) unless the
    LLM is quantized (``quantize = "NAME"`` on ``[llms.X]``), then its
    ``[quantization.NAME]`` recipe's ``check.min_token_agreement``."""
    recipe = manifest.quantization.get(llm.quantize) if llm.quantize is not None else None
    if recipe is None:
        return None
    key = f"[quantization.{recipe.name}.check] min_token_agreement"
    return TokenLimit(recipe.check.min_token_agreement, key)


def _check(
    ws: Workspace,
    name: str,
    actions: list[CompileAction],
    tokens: int,
    given: str | None,
    timeout: float | None,
) -> GenerationCheck:
    llm = ws.manifest.llms[name]
    prompts = [given or llm.prompt or DEFAULT_PROMPT]
    first = actions[0]
    package = f"{name}/{first.provider.name}"

    def verdict(status: CheckStatus, reason: str, *, timed_out: bool = False) -> GenerationCheck:
        return GenerationCheck(package, first.out_dir, status, reason, timed_out=timed_out)

    folder = os.path.join(ws.root, first.out_dir)
    built = all(a.id in ws.state.records for a in actions)
    if not built or not os.path.isfile(os.path.join(folder, GENAI_CONFIG)):
        return verdict(CheckStatus.FAILED, "not built: run 'epbuild build'")
    if llm.share_weights and first.provider.ep == "qnn" and _x86():
        return verdict(CheckStatus.NOT_CHECKABLE, SHARED_ON_X86)
    run = partial(
        generate_all, tokens=tokens, prompts=prompts, max_length=llm.context_length, timeout=timeout
    )
    try:
        sources = _source_run(partial(run, os.path.join(ws.root, llm.source)), llm, given)
    except GenerationTimeout as exc:
        reason = f"the CPU source: {exc.reason}; {TIMEOUT_HINT}"
        return verdict(CheckStatus.FAILED, reason, timed_out=True)
    except GenerationError as exc:
        return verdict(CheckStatus.NOT_CHECKABLE, f"the CPU source: {exc.reason}")
    try:  # teacher-forced on the source's tokens (epbuild.llm.agreement)
        built_gens = run(folder, qnn=first.provider.ep == "qnn", forced=[s.tokens for s in sources])
    except GenerationTimeout as exc:
        return verdict(CheckStatus.FAILED, f"{exc.reason}; {TIMEOUT_HINT}", timed_out=True)
    except GenerationError as exc:
        return verdict(CheckStatus.FAILED, exc.reason)
    limit = token_limit(ws.manifest, llm)
    references, qdq_reason = _references(ws, llm, prompts, sources, timeout, limit)
    checks = tuple(
        _prompt_check(text, gen, source, limit, qdq)
        for text, gen, source, qdq in zip(prompts, built_gens, sources, references, strict=True)
    )
    if any(c.comparison.compared == 0 for c in checks):
        return verdict(CheckStatus.FAILED, "no token was generated")
    failed = any(c.status is CheckStatus.FAILED for c in checks)
    return GenerationCheck(
        package,
        first.out_dir,
        CheckStatus.FAILED if failed else CheckStatus.OK,
        "",
        checks[0].comparison,
        checks[0].tokens_per_second,
        checks[0].source_tokens_per_second,
        prompts[0],
        checks,
        limit,
        qdq_reason=qdq_reason,
    )


def _source_run(
    run: Callable[..., list[Generation]], llm: Llm, given: str | None
) -> list[Generation]:
    """The source's generations (``run``: ``generate_all`` of its folder), after
    ``check_room`` of its prompts' sizes (those it read where it failed too)."""
    try:
        sources = run(qnn=False)
    except GenerationError as exc:  # a timeout's prompt sizes are not known: none checked
        check_room(llm, exc.prompt_tokens, given)
        raise
    check_room(llm, tuple(s.prompt_tokens for s in sources), given)
    return sources


def check_room(llm: Llm, prompt_tokens: tuple[int, ...], given: str | None) -> None:
    """A ``UserError`` when a prompt of ``prompt_tokens`` tokens leaves the package no room
    to generate: read in windows of ``window_size`` (the last one padded), it fills the KV
    cache of ``context_length`` (genai stops the package at its first token, while the
    source, unpadded, might still go on). ``given``: the ``--prompt`` (None: the entry's
    ``prompt`` or the default one)."""
    window, context = llm.window_size, llm.context_length
    for tokens in prompt_tokens:
        padded = -(-tokens // window) * window
        if context - max(tokens, padded) >= 1:
            continue
        if given:
            key = "--prompt"
        elif llm.prompt:
            key = f"[llms.{llm.name}] prompt"
        else:
            key = f"the default prompt of verify --generate ([llms.{llm.name}] prompt sets one)"
        raise UserError(
            f"{key}: {tokens} tokens, read in windows of {window} (window_size), "
            f"fill the KV cache of llms.{llm.name} ({context} tokens: context_length): no "
            "token is left to generate",
            hint=f"give a prompt of at most {most} tokens, or raise context_length"
            if (most := (context - 1) // window * window)
            else f"raise context_length above window_size ({window})",
        )


def _references(
    ws: Workspace,
    llm: Llm,
    prompts: list[str],
    sources: list[Generation],
    timeout: float | None,
    limit: TokenLimit | None,
) -> tuple[list[Generation | None], str]:
    """Per prompt, what the QDQ graphs generate on the CPU for a quantized package
    (``limit``: its ``min_token_agreement``; None: not quantized, no reference), and why
    there is none where they could not run."""
    if limit is None or llm.quantize is None:  # QDQ graphs: a quantized LLM's only
        return [None] * len(prompts), ""
    try:
        return list(_qdq_generations(ws, llm, prompts, sources, timeout)), ""
    except GenerationError as exc:
        return [None] * len(prompts), exc.reason


def _qdq_generations(
    ws: Workspace, llm: Llm, prompts: list[str], sources: list[Generation], timeout: float | None
) -> list[Generation]:
    """A quantized LLM's QDQ graphs on the CPU, teacher-forced on the source's tokens
    (``epbuild.llm.qdqgen``): the reference its package is told apart by."""
    actions = [a for a in ws.graph if isinstance(a, LlmQuantizeAction) and a.llm.name == llm.name]
    graphs = {a.stage: os.path.join(ws.root, a.output) for a in actions}
    rel = actions[0].calibration.embeddings if actions else None  # a decoder in parts'
    embeddings = None if rel is None else os.path.join(ws.root, rel)
    missing = [g for g in (*graphs.values(), embeddings) if g and not os.path.isfile(g)]
    if not graphs or missing:
        raise GenerationError("its QDQ graphs are not built: run 'epbuild build'")
    started = time.perf_counter()
    found = qdq_tokens(
        os.path.join(ws.root, llm.source),
        graphs,
        window=llm.window_size,
        context_length=llm.context_length,
        prompts=prompts,
        forced=[s.tokens for s in sources],
        timeout=timeout,
        embeddings=embeddings,
    )
    seconds = (time.perf_counter() - started) / max(1, len(found))
    return [Generation(tokens, (), seconds) for tokens in found]


def _prompt_check(
    prompt: str,
    package: Generation,
    source: Generation,
    limit: TokenLimit | None,
    qdq: Generation | None = None,
) -> PromptCheck:
    """One prompt's verdict: the match rule without a ``limit``, the agreement with one;
    ``qdq``: a quantized package's QDQ graphs' tokens on the CPU (the reference that tells
    an EP's difference from the quantization's)."""
    comparison = compare(package, source, DEFAULT_NEAR_TIE)
    share = limit.share if limit is not None else None
    agreement = token_agreement(package, source, share)
    good = comparison.verdict is not Verdict.DIVERGED if limit is None else agreement.passes
    return PromptCheck(
        prompt,
        CheckStatus.OK if good else CheckStatus.FAILED,
        comparison,
        agreement,
        package.tokens_per_second,
        source.tokens_per_second,
        token_agreement(qdq, source, share) if qdq is not None else None,
        token_agreement(package, qdq, share) if qdq is not None else None,
    )


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")
