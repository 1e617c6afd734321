"""Token agreement of a package with its source (``verify --generate``): at how many steps
the package's greedy token is the source's, the package reading the source's text so far
(``epbuild.llm.generate`` teacher-forces it), and where the first difference is.

An unquantized package must match (a first difference only at a near tie: ``compare``); a
quantized one must agree at ``min_agreement`` of the steps or more, the limit its
``[quantization.NAME.check]`` table gives (``min_token_agreement``). A package that agrees at
no step is never good, whatever the limit.
"""

from __future__ import annotations

from typing import Any

from epbuild._dataclass import dataclass
from epbuild.llm.generate import Generation


@dataclass(frozen=True)
class Agreement:
    """One prompt's token agreement of a package with its source."""

    agreed: int
    """Steps whose tokens are the same."""
    compared: int
    first_difference: int | None = None
    """The first step whose tokens differ (None: none does)."""
    min_agreement: float | None = None
    """The share of steps that must agree (None: the unquantized rule, ``compare``'s)."""

    @property
    def share(self) -> float:
        """Agreeing steps over compared steps (0 when nothing was compared)."""
        return self.agreed / self.compared if self.compared else 0.0

    @property
    def matched(self) -> int:
        """The first N tokens that match, before the first difference."""
        return self.compared if self.first_difference is None else self.first_difference

    @property
    def passes(self) -> bool:
        """At or above the limit, with at least one agreeing step (junk never passes)."""
        if self.min_agreement is None or self.agreed == 0:
            return False
        return self.share >= self.min_agreement

    def describe(self) -> str:
        """How many agree, for the report."""
        text = f"{self.agreed} of {self.compared} greedy tokens agree with the source"
        if self.min_agreement is not None:
            text += f" (at least {_percent(self.min_agreement)} needed)"
        if self.first_difference is None:
            return text
        return f"{text}; the first {self.matched} match"

    def to_json(self) -> dict[str, Any]:
        return {
            "agreed": self.agreed,
            "compared": self.compared,
            "matched": self.matched,
            "first_difference": self.first_difference,
            "min_agreement": self.min_agreement,
        }


def token_agreement(
    package: Generation, source: Generation, min_agreement: float | None = None
) -> Agreement:
    """Compare ``package`` (teacher-forced on ``source``'s tokens) with ``source`` step by
    step, over the steps both have."""
    pairs = list(zip(package.tokens, source.tokens, strict=False))
    differ = [step for step, (a, b) in enumerate(pairs) if a != b]
    return Agreement(
        agreed=len(pairs) - len(differ),
        compared=len(pairs),
        first_difference=differ[0] if differ else None,
        min_agreement=min_agreement,
    )


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%" if share * 100 == int(share * 100) else f"{share * 100:.1f}%"
