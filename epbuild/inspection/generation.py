"""``verify --generate``: each built LLM package generates greedily through its provider
(onnxruntime-genai in a child process), its source folder on the CPU the same way, and the
token ids are compared step by step (``epbuild.llm.generate``).

Verdicts: ``ok`` (all compared steps match, or the first difference is a near tie),
``failed`` (a clear-margin divergence, or the package could not generate), and
``not_checkable`` with the reason (a weight-shared HTP package on x86_64, whose loading
crashes ONNX Runtime's emulation; the source could not generate).
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import UserError
from epbuild.llm.genai_schema import GENAI_CONFIG
from epbuild.llm.generate import (
    DEFAULT_NEAR_TIE,
    DEFAULT_PROMPT,
    INSTALL_HINT,
    Comparison,
    GenerationError,
    Verdict,
    compare,
    genai_installed,
    generate,
)
from epbuild.planning.llms import LlmGroup
from epbuild.results import CheckStatus

if TYPE_CHECKING:
    from epbuild.planning.actions import CompileAction
    from epbuild.planning.workspace import Workspace

SHARED_ON_X86 = (
    "a weight-shared HTP package (one binary for both graphs) crashes ONNX Runtime's x86_64 "
    "emulation when loaded (in onnxruntime-genai and plain ONNX Runtime alike): check it on "
    "a device, or build with share_weights = false to check it here"
)


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
    tokens_per_second: float | None = None
    source_tokens_per_second: float | None = None
    prompt: str | None = None

    def line(self) -> str:
        """One line for the report."""
        head = f"{self.package}: generate: "
        if self.comparison is None:
            word = "not checkable" if self.status is CheckStatus.NOT_CHECKABLE else "failed"
            return f"{head}{word}: {self.reason}"
        rate = (
            f" ({self.tokens_per_second:.1f} tokens/s; "
            f"CPU source {self.source_tokens_per_second:.1f} tokens/s)"
        )
        return head + self.comparison.describe() + rate

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
        }


def require_genai() -> None:
    """``UserError`` saying how to install onnxruntime-genai where it is missing."""
    if not genai_installed():
        raise UserError("verify --generate needs onnxruntime-genai", hint=INSTALL_HINT)


def check_generation(
    ws: Workspace, *, tokens: int, prompt: str | None = None
) -> list[GenerationCheck]:
    """One check per selected LLM × provider; ``prompt`` wins over the entry's own."""
    targets: dict[tuple[str, str], list[CompileAction]] = {}
    for action in ws.actions:
        if isinstance(action.group, LlmGroup):
            targets.setdefault((action.group.name, action.provider.name), []).append(action)
    return [_check(ws, name, actions, tokens, prompt) for (name, _), actions in targets.items()]


def _check(
    ws: Workspace, name: str, actions: list[CompileAction], tokens: int, given: str | None
) -> GenerationCheck:
    llm = ws.manifest.llms[name]
    prompt = given or llm.prompt or DEFAULT_PROMPT
    first = actions[0]
    package = f"{name}/{first.provider.name}"

    def verdict(status: CheckStatus, reason: str) -> GenerationCheck:
        return GenerationCheck(package, first.out_dir, status, reason)

    folder = os.path.join(ws.root, first.out_dir)
    built = all(a.id in ws.state.records for a in actions)
    if not built or not os.path.isfile(os.path.join(folder, GENAI_CONFIG)):
        return verdict(CheckStatus.FAILED, "not built: run 'epbuild build'")
    if llm.share_weights and first.provider.ep == "qnn" and _x86():
        return verdict(CheckStatus.NOT_CHECKABLE, SHARED_ON_X86)
    qnn = first.provider.ep == "qnn"
    try:
        source = generate(
            os.path.join(ws.root, llm.source),
            qnn=False,
            tokens=tokens,
            prompt=prompt,
            max_length=llm.context_length,
        )
    except GenerationError as exc:
        return verdict(CheckStatus.NOT_CHECKABLE, f"the CPU source: {exc.reason}")
    try:
        built_gen = generate(
            folder, qnn=qnn, tokens=tokens, prompt=prompt, max_length=llm.context_length
        )
    except GenerationError as exc:
        return verdict(CheckStatus.FAILED, exc.reason)
    result = compare(built_gen, source, DEFAULT_NEAR_TIE)
    if result.compared == 0:
        return verdict(CheckStatus.FAILED, "no token was generated")
    status = CheckStatus.FAILED if result.verdict is Verdict.DIVERGED else CheckStatus.OK
    return GenerationCheck(
        package,
        first.out_dir,
        status,
        "",
        result,
        built_gen.tokens_per_second,
        source.tokens_per_second,
        prompt,
    )


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")
