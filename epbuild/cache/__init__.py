"""The action cache: outputs stored by content digest, entries keyed by action key.

``store`` holds objects and entries over a storage ``backend`` (a local directory, or any
fsspec URL); ``actioncache`` puts a local tier in front of an optional remote one and
restores entries into staging directories; ``archive`` exports/imports single-file archives;
``prune`` evicts least-recently-used entries; ``location`` decides where the cache lives.
Nothing here is imported on the no-op build path.
"""

from __future__ import annotations
