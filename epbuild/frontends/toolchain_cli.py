"""``epbuild toolchains [--prune] [--json]``: the environments epbuild made for providers'
toolchains (``toolchains.inventory``), which the current manifest uses, and pruning."""

from __future__ import annotations

import argparse
import os

from epbuild._names import MANIFEST_NAME
from epbuild.errors import ManifestError
from epbuild.frontends.render import print_json
from epbuild.manifest.load import find_manifest, load_manifest
from epbuild.toolchains.env import toolchain_root
from epbuild.toolchains.inventory import inventory, prune
from epbuild.toolchains.resolve import Toolchains


def _used(args: argparse.Namespace) -> dict[str, list[str]] | None:
    """Digest → the current manifest's providers that use it; None without a manifest."""
    try:
        manifest = load_manifest(find_manifest(args.directory, args.manifest))
    except ManifestError:
        if args.manifest or os.path.exists(os.path.join(args.directory, MANIFEST_NAME)):
            raise  # a manifest that is there but broken: say so rather than prune blindly
        return None

    used: dict[str, list[str]] = {}
    toolchains = Toolchains(create=False)
    for name, cfg in manifest.providers.items():
        if cfg.toolchain is not None and cfg.toolchain.python is None:
            locked = toolchains.locked_entry(cfg)  # made from epbuild.lock: named by its entry
            digest = cfg.toolchain.digest() if locked is None else locked.digest()
            found = toolchains.lookup(cfg)  # the environment a lock was written from, reused
            for d in {digest, os.path.basename(found.prefix) if found else digest}:
                used.setdefault(d, []).append(name)
    return used


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.0f} MB"


def run_toolchains_command(args: argparse.Namespace) -> int:
    """List (or prune) the environments under the toolchain directory."""
    used = _used(args)
    if args.prune:
        pruned = prune(keep=(used or {}).keys())
        if args.json:
            print_json({"removed": pruned.removed, "busy": pruned.busy}, command="toolchains")
            return 0
        for path in pruned.removed:
            print(f"epbuild: removed {path}")
        for path in pruned.busy:
            print(f"epbuild: kept {path}: a running build uses it (or is making it)")
        kept = "the current manifest's" if used is not None else "no manifest here: none"
        print(f"epbuild: pruned {len(pruned.removed)} ({kept} kept)")
        return 0
    envs = inventory(used)
    if args.json:
        doc = {"root": toolchain_root(), "environments": [e.to_json() for e in envs]}
        print_json(doc, command="toolchains")
        return 0
    print(f"toolchains in {toolchain_root()}:" if envs else f"no toolchains in {toolchain_root()}")
    for e in envs:
        state = f"python {e.python}, {e.installer}" if e.ready else "half-made"
        line = f"  {e.digest}  {', '.join(e.requirements) or '?'}  ({state}, {_mb(e.size)})"
        print(line + (f"  used by: {', '.join(e.used_by)}" if e.used_by else ""))
    return 0
