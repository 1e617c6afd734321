"""Provider adapters (placeholder registry; replaced by the full registry)."""

from __future__ import annotations

from ..errors import ManifestError
from .base import Provider

_cache: dict[str, Provider] = {}


def get_provider(kind: str) -> Provider:
    """The adapter for a manifest ``ep`` value."""
    if kind not in _cache:
        if kind == "qnn":
            from .qnn import QnnProvider

            _cache[kind] = QnnProvider()
        else:
            raise ManifestError(f"unknown provider adapter {kind!r}", hint="known: qnn")
    return _cache[kind]
