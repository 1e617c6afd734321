"""Cross-references between manifest tables: the providers a group or an LLM lists."""

from __future__ import annotations

from collections.abc import Mapping

from epbuild.manifest.locate import Where


def check_provider_list(
    where: Where, base: tuple[str, ...], names: list[str], providers: Mapping[str, object]
) -> None:
    """Every provider a table lists (``base + ("providers",)``) is defined, and listed once."""
    for i, pname in enumerate(names):
        if pname not in providers:
            defined = ", ".join(providers) or "none"
            raise where.error(
                (*base, "providers"),
                f"provider {pname!r} is not defined",
                f"add a [providers.{pname}] table (defined: {defined})",
            )
        if pname in names[:i]:
            raise where.error((*base, "providers"), f"{pname!r} is listed twice")
