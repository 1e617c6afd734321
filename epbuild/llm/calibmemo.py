"""What the calibration of a decoder in parts keeps for the next one, so that an edit of a
late part calibrates from that part on only.

A part's runs depend on the tokens and on what the parts before it give it; the tokens are
the whole chain's greedy choice. Beside its ranges, a calibration writes what each part
read at each run (``<part>.runs``: the residual stream and the sequence lengths, in run
order) and ``memo.json``: the settings, the prompts' tokens, each part's digest (its graphs
and weights; the first part's with the embeddings stage's), each run's chosen token, the
sha256 of every file it wrote, and the sha256 of all that (a memo changed by hand, even to
valid JSON, is not used). The next calibration, of the same settings and prompts,
finds the first part whose digest changed and runs that part and those after it on the
recorded inputs of that part (``Replay``); when the last part chooses every token the
memo holds, the parts before it would have seen exactly what they saw then, so their
ranges and runs are the memo's, copied as they are. A token that differs (the edit changed
what the chain generates) and the calibration starts over with every part: the outcome is
always the ranges a calibration of every part gives.

Its names (``MEMO``, ``runs_name``) are the planner's too; numpy is imported by the
worker's functions only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass, field
from epbuild.fs import digest_file, sha256_hex

if TYPE_CHECKING:
    import numpy as np

MEMO = "memo.json"
MEMO_FORMAT = 2
"""Bump when a memo written before no longer describes the same runs (2: its own digest)."""


def runs_name(part: str) -> str:
    """The file of what ``part`` read at each run."""
    return f"{part}.runs"


@dataclass
class Keep:
    """A calibration's memo: where the last one's outputs are and what this one's are."""

    previous: str
    """The folder of the last calibration's outputs (its ranges, runs and memo; may be
    missing)."""
    out: str
    """The folder this calibration writes into."""
    parts: Mapping[str, str]
    """Part → digest of its graphs and weights, in session order."""
    settings: Mapping[str, Any]
    """What else decides the runs (method, window, KV-cache length, tokens generated,
    versions): a memo of other settings is not used."""
    reused: list[str] = field(default_factory=list)
    """The parts whose ranges came from the memo (set by the calibration)."""


class Diverged(Exception):
    """The replayed parts chose a token the memo does not hold."""


def _sha256(path: str) -> str:
    return str(digest_file(path).sha256)


def first_changed(
    keep: Keep, prompts: Sequence[Sequence[int]], stages: Mapping[str, Sequence[str]]
) -> tuple[int, dict[str, Any] | None]:
    """The index of the first part to calibrate and the memo that holds the parts before
    it (``0, None``: no usable memo, every part runs). ``stages``: part → its ranges
    files' names."""
    try:
        with open(os.path.join(keep.previous, MEMO), encoding="utf-8") as f:
            memo = json.load(f)
    except (OSError, ValueError):
        return 0, None
    if not isinstance(memo, dict) or memo.get("format") != MEMO_FORMAT:
        return 0, None
    if memo.get("digest") != _digest(memo):  # changed since written: any field may lie
        return 0, None
    if memo.get("settings") != dict(keep.settings) or memo.get("prompts") != [
        list(p) for p in prompts
    ]:
        return 0, None
    old = memo.get("parts")
    if not isinstance(old, list) or [p for p, _ in old] != list(keep.parts):
        return 0, None
    start = 0
    for (_, digest), part in zip(old, keep.parts, strict=True):
        if digest != keep.parts[part]:
            break
        start += 1
    if start in (0, len(keep.parts)):  # nothing kept, or nothing changed (a new key all the same)
        return 0, None
    needed = [name for part in list(keep.parts)[:start] for name in stages[part]]
    needed += [runs_name(p) for p in list(keep.parts)[: start + 1]]
    files = memo.get("files", {})
    for name in needed:
        path = os.path.join(keep.previous, name)
        if not isinstance(files, dict) or files.get(name) != _safe_sha256(path):
            return 0, None
    return start, memo


def _digest(memo: Mapping[str, Any]) -> str:
    """The sha256 of a memo's fields but its ``digest``."""
    body = {k: v for k, v in memo.items() if k != "digest"}
    return sha256_hex(json.dumps(body, sort_keys=True).encode())


def _safe_sha256(path: str) -> str | None:
    try:
        return _sha256(path)
    except OSError:
        return None


class RunsWriter:
    """Writes what each part reads at each run (its inputs but the KV cache), in run
    order, to ``<part>.runs`` in ``folder``."""

    def __init__(self, folder: str, kv: Sequence[str], skip: Sequence[str]) -> None:
        self.folder = folder
        self.kv = set(kv)
        self.skip = set(skip)
        self.names: dict[str, list[str]] = {}
        self._files: dict[str, Any] = {}

    def write(self, part: str, inputs: Mapping[str, np.ndarray]) -> None:
        """Keep one run of ``part`` (nothing of a part in ``skip``)."""
        import numpy as np

        if part in self.skip:
            return
        names = self.names.setdefault(part, sorted(set(inputs) - self.kv))
        if part not in self._files:
            path = os.path.join(self.folder, runs_name(part))
            self._files[part] = open(path, "wb")  # noqa: SIM115 (closed by close)
        for name in names:
            np.save(self._files[part], np.ascontiguousarray(inputs[name]), allow_pickle=False)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class _Output:
    def __init__(self, name: str) -> None:
        self.name = name


class Replay:
    """A stage that gives, run after run, what a part read in the memo's calibration (in
    place of the parts before it): a ``Chain`` stage (``get_inputs``, ``get_outputs``,
    ``run``)."""

    def __init__(self, path: str, names: Sequence[str]) -> None:
        self._names = list(names)
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close)

    def get_inputs(self) -> list[Any]:
        return []

    def get_outputs(self) -> list[Any]:
        return [_Output(n) for n in self._names]

    def run(self, _: Any, __: Any) -> list[np.ndarray]:
        import numpy as np

        if not self._file.peek(1):
            raise Diverged("the memo's runs ended early")
        return [np.load(self._file, allow_pickle=False) for _ in self._names]

    def close(self) -> None:
        self._file.close()


def keep_files(keep: Keep, start: int, stages: Mapping[str, Sequence[str]]) -> None:
    """Copy the memo's ranges of the parts before ``start`` and its runs of the parts up
    to it into ``keep.out``."""
    import shutil

    parts = list(keep.parts)
    names = [name for part in parts[:start] for name in stages[part]]
    names += [runs_name(p) for p in parts[: start + 1]]
    for name in names:
        shutil.copyfile(os.path.join(keep.previous, name), os.path.join(keep.out, name))
    keep.reused[:] = parts[:start]


def own_files(folder: str) -> list[str]:
    """The calibration's files in ``folder`` (its ranges and runs), in name order: not its
    memo, nor what the job beside it keeps there (the worker's log, the progress file, the
    scratch folder: dot-named)."""
    return [
        name
        for name in sorted(os.listdir(folder))
        if name != MEMO and not name.startswith(".") and os.path.isfile(os.path.join(folder, name))
    ]


def write_memo(
    keep: Keep,
    prompts: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
    inputs: Mapping[str, Sequence[str]],
) -> None:
    """Write ``memo.json`` of the calibration's files now in ``keep.out``."""
    files = {name: _sha256(os.path.join(keep.out, name)) for name in own_files(keep.out)}
    memo = {
        "format": MEMO_FORMAT,
        "settings": dict(keep.settings),
        "prompts": [list(p) for p in prompts],
        "parts": [[part, digest] for part, digest in keep.parts.items()],
        "inputs": {part: list(names) for part, names in inputs.items()},
        "tokens": [list(t) for t in tokens],
        "files": files,
    }
    memo["digest"] = _digest(memo)
    with open(os.path.join(keep.out, MEMO), "w", encoding="utf-8") as f:
        json.dump(memo, f, sort_keys=True)


def recorded(memo: Mapping[str, Any], part: str) -> list[str]:
    """The names of what ``part`` read, as the memo's runs file holds them."""
    return list(memo["inputs"][part])


def chosen(memo: Mapping[str, Any]) -> Iterator[list[int]]:
    """Each prompt's chosen tokens, as the memo's calibration chose them."""
    for tokens in memo["tokens"]:
        yield list(tokens)
