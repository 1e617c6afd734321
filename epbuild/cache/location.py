"""Where the cache lives: ``--cache``/``--no-cache``, then ``EPBUILD_CACHE``, then the
manifest's ``[workspace] cache``, then a per-user directory (platform conventions).

A directory is the local tier. A URL (``s3://bucket/prefix``, ``file:///srv/cache``) is the
remote tier, with the per-user directory as the local tier in front of it.
"""

from __future__ import annotations

import os
from collections import namedtuple
from typing import TYPE_CHECKING

from epbuild.errors import UserError
from epbuild.userdirs import default_cache_dir

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache

OFF = ("off", "none", "no", "0", "false")
ENV = "EPBUILD_CACHE"


class CacheConfig(namedtuple("CacheConfig", "local remote push", defaults=(None, False))):
    """A resolved cache location (a named tuple: cheap to import; made by ``collections``,
    as ``typing.NamedTuple`` compiles each annotation)."""

    __slots__ = ()
    local: str
    """Absolute path of the local cache directory."""
    remote: str | None
    """fsspec URL of the remote tier, if any."""
    push: bool
    """Write compiled actions to the remote tier too."""


def is_url(value: str) -> bool:
    """Whether a cache location is an fsspec URL rather than a directory."""
    return "://" in value


def resolve(
    option: str | bool | None,
    *,
    base: str,
    manifest_value: str | None = None,
    manifest_root: str | None = None,
    push: bool = False,
) -> CacheConfig | None:
    """The cache to use, or None when caching is off.

    ``option`` is the ``--cache`` value (a directory relative to ``base``, or a URL), False
    for ``--no-cache``, None to fall back to the environment, the manifest and the default.
    """
    if option is False:
        return None
    value: str | None = option if isinstance(option, str) else None
    rel_to = base
    if value is None and os.environ.get(ENV) is not None:
        value, rel_to = os.environ[ENV], os.getcwd()
    if value is None and manifest_value is not None:
        value, rel_to = manifest_value, manifest_root or base
    if value is not None and value.strip().lower() in (*OFF, ""):
        return None
    if value is None:
        return CacheConfig(default_cache_dir(), None, push)
    if is_url(value):
        return CacheConfig(default_cache_dir(), value, push)
    return CacheConfig(os.path.abspath(os.path.join(rel_to, os.path.expanduser(value))), None, push)


def source(option: str | bool | None, manifest_value: str | None = None) -> str:
    """Which setting chose the cache, in ``resolve``'s order (for messages)."""
    if option is not None:
        return "--no-cache" if option is False else "--cache"
    if os.environ.get(ENV) is not None:
        return f"{ENV}={os.environ[ENV]!r}"
    if manifest_value is not None:
        return "[workspace] cache"
    return "the per-user default"


def open_cache(
    cfg: CacheConfig | None, *, push: bool = False, cache_only: bool = False, chosen_by: str = ""
) -> ActionCache | None:
    """The action cache at ``cfg`` (``resolve``'s answer; None when caching is off), checked:
    ``push`` (``--cache-push``) and ``cache_only`` (``--cache-only``) need a cache, ``push``
    a remote tier, and the local tier must be a directory. ``chosen_by``: the setting that
    chose ``cfg`` (``source``), named in those messages."""
    by = f" (set by {chosen_by})" if chosen_by else ""
    if cfg is None:
        if push or cache_only:
            flag = "--cache-push" if push else "--cache-only"
            raise UserError(
                f"{flag} needs a cache, and the cache is off{by}",
                hint="name one with --cache DIR (or drop --no-cache, EPBUILD_CACHE=off or "
                '[workspace] cache = "off")',
            )
        return None
    if push and cfg.remote is None:
        raise UserError(
            "--cache-push needs a remote cache URL",
            hint="pass --cache s3://bucket/prefix (or set [workspace] cache to a URL)",
        )
    if os.path.lexists(cfg.local) and not os.path.isdir(cfg.local):
        raise UserError(
            f"the cache {cfg.local} is not a directory{by}",
            hint="pass --cache DIR naming a directory (or move that file away)",
        )
    from epbuild.cache.actioncache import ActionCache  # not on a command that opens none

    return ActionCache(cfg.local, cfg.remote, push=cfg.push)
