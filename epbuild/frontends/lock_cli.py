"""``epbuild lock [--check]``: write ``epbuild.lock`` beside the manifest (making missing
toolchains), or say whether it is out of date with the manifest. The lock is written under
the manifest lock ``add`` holds: it is always the lock of the manifest as it is then."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from epbuild.frontends.render import print_json
from epbuild.fs import atomic_write_bytes
from epbuild.manifest.edit import manifest_lock
from epbuild.manifest.load import find_manifest, load_manifest
from epbuild.planning.lock import gather, outdated
from epbuild.toolchains.lockfile import lock_path, read_lock
from epbuild.toolchains.resolve import Toolchains


def run_lock_command(args: argparse.Namespace) -> int:
    """Write (or check) the lock; returns the exit code."""
    manifest = load_manifest(find_manifest(args.directory, args.manifest))
    path = lock_path(manifest.path)
    name = os.path.relpath(path)
    existing = read_lock(path) if os.path.exists(path) else None
    if args.check:
        reasons = ["there is none"] if existing is None else outdated(existing, manifest)
        if args.json:
            doc = {"lock": path, "current": not reasons, "reasons": reasons}
            print_json(doc, command="lock", ok=not reasons)
        elif reasons:
            for r in reasons:
                print(f"epbuild: {name} is out of date: {r}", file=sys.stderr)
            print("  hint: run epbuild lock to write it again, and commit it", file=sys.stderr)
        else:
            print(f"epbuild: {name} is up to date with the manifest")
        return 1 if reasons else 0
    say = (lambda text: print(f"epbuild: {text}", file=sys.stderr)) if not args.json else None
    toolchains = Toolchains(create=True, say=say or (lambda _: None))
    same = _write(manifest.path, path, toolchains)
    if args.json:
        print_json({"lock": path, "written": not same}, command="lock")
    else:
        print(f"epbuild: {name} {'is unchanged' if same else 'written'}")
    return 0


def _write(manifest_path: Path, path: str, toolchains: Toolchains) -> bool:
    """Write the lock of the manifest at ``manifest_path`` to ``path``; whether it was there
    already. The environments are read outside the manifest lock (making a toolchain takes
    minutes); the lock is written under it, for the manifest it was gathered from: one that
    ``add`` changed meanwhile is gathered again."""
    while True:
        before = manifest_path.read_bytes()
        text = gather(load_manifest(manifest_path), toolchains).to_toml()
        with manifest_lock(manifest_path, "epbuild lock"):
            if manifest_path.read_bytes() != before:
                continue  # edited while the environments were read
            try:
                with open(path, encoding="utf-8") as f:
                    same = f.read() == text
            except OSError:
                same = False
            if not same:
                atomic_write_bytes(path, text.encode(), leftovers=True)
            return same
