"""Where things live in a directory cache (paths relative to its root, ``/``-separated).

A bottom module of ``cache/`` (it imports only ``_names``): the store, the trust records,
the key locks and ``prune`` name their files through it, so a layout change is made once::

    v1/objects/ab/abcdef…            output bytes, named by their sha256
    v1/entries/12/1234…json          one action key → output names, sizes, digests, components
    v1/ids/<hash of action id>/<key> marker: entries of one action id (to explain a miss)
    v1/locks/12/1234….lock           held by the build restoring or compiling that key
    v1/verified/ab/abcdef…           an object's stat when last verified (``trust``)
"""

from __future__ import annotations

import os

from epbuild._names import CACHE_LAYOUT

LAYOUT = CACHE_LAYOUT
OBJECTS = f"{LAYOUT}/objects"
ENTRIES = f"{LAYOUT}/entries"
IDS = f"{LAYOUT}/ids"
LOCKS = f"{LAYOUT}/locks"
VERIFIED = f"{LAYOUT}/verified"


def object_path(digest: str) -> str:
    """Where an object lives."""
    return f"{OBJECTS}/{digest[:2]}/{digest}"


def entry_path(key: str) -> str:
    """Where an entry lives."""
    return f"{ENTRIES}/{key[:2]}/{key}.json"


def key_lock_path(key: str) -> str:
    """The lock a build holds while it restores or compiles ``key``."""
    return f"{LOCKS}/{key[:2]}/{key}.lock"


def verified_path(digest: str) -> str:
    """Where an object's verified stat is recorded."""
    return f"{VERIFIED}/{digest[:2]}/{digest}"


def local_path(root: str, rel: str) -> str:
    """The local path of the file at ``rel`` in the directory cache at ``root``."""
    return os.path.join(root, *rel.split("/"))
