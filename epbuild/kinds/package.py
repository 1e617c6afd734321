"""The package kind: an ``[llms]`` entry's genai package for one provider, written as an
action of the graph after the LLM's compiles (which it depends on). Its outputs are the
``genai_config.json`` made from the source's (``decoder-pipeline``, relative file names)
and the source files genai needs beside the ctx models (tokenizer, chat template, a
pipeline's CPU stages), each recorded by digest like a compile's outputs: ``status`` names
an edited or missing package file, ``build`` writes it again, a package that cannot be
written is a failed action. Its key is the digest of the config it writes and of each file
it copies, so an edit of the source config rewrites the package and compiles nothing.

It runs inline (in the building process: it only writes a small file and copies others),
not in a worker.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import time
from collections.abc import Mapping
from typing import Any

from epbuild._dataclass import dataclass
from epbuild.errors import ModelError, VerificationError
from epbuild.executors.job import Job
from epbuild.kinds.contract import BaseKind, Checked, Reported, RunContext, Wording, make_key
from epbuild.kinds.prepare import LlmStep
from epbuild.planning.keys import ActionKey, KeyComputer
from epbuild.providers.contract import ProviderConfig

PACKAGE_FORMAT = 1
"""Bump when the same source makes another package."""


@dataclass(frozen=True)
class PackageAction(LlmStep):
    """One LLM × provider genai package."""

    KIND = "package"
    provider: ProviderConfig
    out_dir: str
    """``<out_dir>/<llm>/<provider>``: beside the ctx models."""
    deps: tuple[str, ...] = ()
    prepared: str = ""
    """The workspace-relative folder of a single decoder's preparation (a decoder in parts
    copies its ``embeddings`` stage from there)."""

    @property
    def provider_name(self) -> str:
        return self.provider.name


class PackageKind(BaseKind):
    """``Kind`` of the LLM packages (``PackageAction``)."""

    name = "package"
    runner = "epbuild.kinds.package:run"
    words = Wording("packaged")
    follows = True
    inline = True

    def key(self, action: PackageAction, keys: KeyComputer, *, fresh: bool) -> ActionKey:
        plan = _plan(keys.root, action)
        copies: dict[str, str] = {}
        for name, rel in plan.copies.items():
            hint = f"restore it, or remove it from {action.llm.source}"
            copies[name] = keys.input_digest(rel, "the file the package copies", hint)
        components: dict[str, Any] = {
            "kind": self.name,
            "format": PACKAGE_FORMAT,
            "config": hashlib.sha256(plan.config).hexdigest(),
            "copies": copies,
        }
        from epbuild.llm.genai_schema import GENAI_CONFIG

        config = posixpath.join(action.llm.source, GENAI_CONFIG)
        try:  # an input too: the no-op path stamps it (read just now by ``_plan``)
            inputs = {config: keys.stats.digest(keys.root, config).digest}
        except OSError as exc:
            raise ModelError(f"{config}: cannot read ({exc.strerror})") from exc
        inputs.update({plan.copies[n]: d for n, d in copies.items()})
        return make_key(components, inputs)

    def payload(self, action: PackageAction, key: ActionKey, ctx: RunContext) -> dict[str, Any]:
        plan = _plan(ctx.root, action)
        payload = {"config": plan.config.decode(), "copies": plan.copies}
        return payload

    def check(
        self, action: PackageAction, staging: str, ctx: RunContext, result: Reported
    ) -> Checked:
        """Exactly the config and the copies were staged."""
        from epbuild.llm.genai_schema import GENAI_CONFIG
        from epbuild.onnx.staged import staged_names

        names = staged_names(ctx.root, staging)
        wanted = sorted({GENAI_CONFIG, *_plan(ctx.root, action).copies})
        if names != wanted:
            missing = sorted(set(wanted) - set(names))
            what = f"{missing[0]} was not written" if missing else f"{names} were staged"
            raise VerificationError(f"package of {action.id}: {what}")
        return names, []


def _plan(root: str, action: PackageAction) -> Any:
    """``package_plan`` of the action; a source config it cannot use is a ``ModelError``
    naming the file."""
    from epbuild.llm.genai_schema import GENAI_CONFIG
    from epbuild.llm.package import package_plan
    from epbuild.providers import get_provider

    adapter = get_provider(action.provider.ep)
    try:
        return package_plan(
            root, action.llm, action.provider, adapter.file_options, action.prepared
        )
    except OSError as exc:
        raise ModelError(
            f"{action.llm.source}/{GENAI_CONFIG}: cannot read ({exc.strerror})",
            hint="restore the LLM's source folder",
        ) from exc
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ModelError(
            f"{action.llm.source}/{GENAI_CONFIG}: the package cannot be made from it ({exc})",
            hint="fix the source's genai_config.json (as genai's model builder writes it)",
        ) from exc


def run(job: Job, root: str) -> dict[str, Any]:
    """Write the config and copy the source files into the staging directory."""
    from epbuild.fs import atomic_copy, atomic_write_bytes
    from epbuild.llm.genai_schema import GENAI_CONFIG

    t0 = time.perf_counter()
    staging = os.path.join(root, job.staging)
    atomic_write_bytes(os.path.join(staging, GENAI_CONFIG), str(job.payload["config"]).encode())
    copies: Mapping[str, str] = job.payload["copies"]
    for name, rel in copies.items():
        atomic_copy(os.path.join(root, rel), os.path.join(staging, name), durable=False)
    return {"seconds": time.perf_counter() - t0, "detail": {}, "versions": {}}


PACKAGE = PackageKind()
