"""A toy kind of action, added to epbuild through its kind interface alone
(``epbuild.kinds.contract``): ``lower`` writes a lower-cased copy of a text file,
``count`` (which depends on it) writes how many characters that copy has. A source text
holding ``FAIL`` makes ``lower`` fail. The worker imports this module (``runner``)."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

from epbuild.errors import ModelError, VerificationError
from epbuild.executors.job import Job
from epbuild.kinds.contract import ActionIdentity, Checked, Reported, RunContext, Wording
from epbuild.planning.keys import ActionKey, KeyComputer

SOURCE = "notes.txt"


@dataclass(frozen=True)
class TextAction(ActionIdentity):
    id: str
    kind: str
    source: str
    """Workspace-relative input."""
    output: str
    out_dir: str
    deps: tuple[str, ...] = ()
    group_name: str = "notes"
    provider_name: str = ""
    toolchain: None = None


def toy_actions(request: Any) -> list[Any]:
    """A workspace with ``notes.txt`` has both actions (``request``: a ``GraphRequest``)."""
    manifest = request.manifest
    if not os.path.isfile(os.path.join(str(manifest.root), SOURCE)):
        return []
    out = posixpath.join(manifest.workspace.out_dir, "notes", "text")
    lower = TextAction("notes/lower", "lower", SOURCE, "lower.txt", out)
    lowered = posixpath.join(out, "lower.txt")
    count = TextAction("notes/count", "count", lowered, "count.txt", out, deps=(lower.id,))
    return [count, lower]  # out of order on purpose: the graph orders them


class TextKind:
    def __init__(self, name: str, past: str) -> None:
        self.name = name
        self.words = Wording(past, waits="{a.id} runs first")
        self.follows = False
        self.inline = False
        self.checks_input = False

    def key(self, action: TextAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        try:
            digest = keys.stats.digest(keys.root, action.source).digest
        except OSError as exc:
            raise ModelError(f"{action.source}: cannot read ({exc.strerror})") from exc
        components = {"kind": self.name, "inputs": {action.source: digest}, "versions": {}}
        blob = json.dumps(components, sort_keys=True).encode()
        return ActionKey(hashlib.sha256(blob).hexdigest(), components, {action.source: digest})

    def job(
        self, action: TextAction, key: ActionKey, staging: str, ctx: RunContext
    ) -> tuple[Job, list[str]]:
        payload = {"source": action.source, "output": action.output, "op": self.name}
        return Job(action.id, "toykind:run", staging, payload, dict(key.inputs)), []

    def check(self, action: TextAction, staging: str, ctx: RunContext, result: Reported) -> Checked:
        from epbuild.onnx.staged import staged_names

        names = staged_names(ctx.root, staging)
        if names != [action.output]:
            raise VerificationError(f"staged {names}, expected {action.output}")
        return names, []


LOWER = TextKind("lower", "lowered")
COUNT = TextKind("count", "counted")


def run(job: Job, root: str) -> dict[str, Any]:
    """In the worker (``root``: its working directory, the workspace)."""
    with open(os.path.join(root, str(job.payload["source"])), encoding="utf-8") as f:
        text = f.read()
    if "FAIL" in text:
        raise ModelError(f"{job.payload['source']}: the toy refuses FAIL", hint="remove it")
    out = text.lower() if job.payload["op"] == "lower" else str(len(text))
    with open(os.path.join(root, job.staging, str(job.payload["output"])), "w") as f:
        f.write(out)
    return {"seconds": 0.0, "detail": {}, "versions": {}}
