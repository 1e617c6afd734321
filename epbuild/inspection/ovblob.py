"""The numerical check of an OpenVINO CPU ctx model without the EP: a loader subprocess.

The onnxruntime-openvino Linux wheel cannot load its own CPU EPContext blobs (its bundled
OpenVINO lacks the IR frontend; docs/research/openvino-ep.md). The blob itself is sound: the
standalone ``openvino`` package imports it. So where the EP fails with that known limit,
``verify --numerics`` runs this module in the action's toolchain: it unwraps the blob from
the ``OVEP_BIN`` container (a 40-byte header, a BSON map of partition → offset and size),
imports it with ``openvino.Core().import_model`` on the CPU device at fp32 precision (what
the EP passes at import), runs it and the source model (ORT's CPU EP) on the same feeds and
prints the same JSON line as ``loadcheck``.

It must run in a process of its own: the ``openvino`` wheel and the OpenVINO bundled in
onnxruntime-openvino are builds of the same library with different C++ ABIs, and whichever
loads first breaks the other in that process.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from epbuild.inspection.loadcheck import Figures, answer, reference, samples
from epbuild.onnx.proto import read_model

MAGIC = b"OVEP_BIN"
_HEADER = struct.Struct("<8sQQQQ")
"""magic, version, header size, BSON start offset, BSON size."""
IMPORT_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}
"""What the EP passes at import; the CPU plugin's default on a bf16-capable CPU is bf16."""


class BlobError(ValueError):
    """The context binary is not what the OpenVINO EP writes."""


def bson(buf: bytes, pos: int = 0) -> dict[str, Any]:
    """The document at ``pos`` (the types the EP writes: strings, documents, arrays,
    32/64-bit integers, doubles, booleans)."""
    try:
        (size,) = struct.unpack_from("<i", buf, pos)
        if size < 5 or pos + size > len(buf) or buf[pos + size - 1] != 0:
            raise BlobError(f"the blob map is not valid BSON (a document of {size} bytes)")
        end, pos = pos + size - 1, pos + 4
        doc: dict[str, Any] = {}
        while pos < end:
            kind = buf[pos]
            key_end = buf.index(b"\0", pos + 1)
            key, pos = buf[pos + 1 : key_end].decode(), key_end + 1
            if kind == 0x02:
                (n,) = struct.unpack_from("<i", buf, pos)
                doc[key], pos = buf[pos + 4 : pos + 3 + n].decode(), pos + 4 + n
            elif kind in (0x03, 0x04):
                (n,) = struct.unpack_from("<i", buf, pos)
                doc[key], pos = bson(buf, pos), pos + n
            elif kind == 0x10:
                doc[key], pos = struct.unpack_from("<i", buf, pos)[0], pos + 4
            elif kind == 0x12:
                doc[key], pos = struct.unpack_from("<q", buf, pos)[0], pos + 8
            elif kind == 0x01:
                doc[key], pos = struct.unpack_from("<d", buf, pos)[0], pos + 8
            elif kind == 0x08:
                doc[key], pos = buf[pos] != 0, pos + 1
            else:
                raise BlobError(f"BSON element type {kind:#x} of {key!r} is not supported")
        return doc
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, BlobError):
            raise
        raise BlobError(f"the blob map is not valid BSON ({exc})") from exc


def unwrap(data: bytes, partition: str) -> bytes:
    """The compiled model of ``partition`` in an ``OVEP_BIN`` container."""
    if len(data) < _HEADER.size or not data.startswith(MAGIC):
        raise BlobError("the context binary does not start with the OVEP_BIN header")
    _, _, _, start, size = _HEADER.unpack_from(data)
    blobs = bson(data[start : start + size]).get("blob_metadata_map")
    entry = blobs.get(partition) if isinstance(blobs, dict) else None
    if not isinstance(entry, dict):
        raise BlobError(f"the context binary has no blob for partition {partition!r}")
    offset, length = entry.get("data_offset"), entry.get("size")
    if not isinstance(offset, int) or not isinstance(length, int):
        raise BlobError(f"the blob map entry of {partition!r} has no offset and size")
    if offset < 0 or length <= 0 or offset + length > len(data):
        raise BlobError(f"the blob of {partition!r} lies outside the file ({len(data)} bytes)")
    return data[offset : offset + length]


def _context(ctx: str) -> tuple[dict[str, Any], bytes]:
    """The EPContext node's attributes and the bytes of its context binary."""
    nodes = read_model(ctx).context_nodes
    if len(nodes) != 1:
        raise BlobError("the check handles ctx models of exactly one EPContext node")
    attrs = nodes[0].attributes
    ref = attrs.get("ep_cache_context")
    if attrs.get("embed_mode", 1) == 0 and isinstance(ref, str | bytes):
        name = ref.decode() if isinstance(ref, bytes) else ref
        with open(os.path.join(os.path.dirname(ctx), name), "rb") as f:
            return attrs, f.read()
    import onnx  # embedded: the reader never reads payloads into memory

    model = onnx.load(ctx, load_external_data=False)
    for n in model.graph.node:
        if n.op_type == "EPContext":
            for a in n.attribute:
                if a.name == "ep_cache_context":
                    return attrs, bytes(a.s)
    raise BlobError("the EPContext node has no ep_cache_context")


def _version_problem(attrs: dict[str, Any], ov_version: str, provider: str) -> str | None:
    wanted = attrs.get("ep_sdk_version")
    wanted = wanted.decode() if isinstance(wanted, bytes) else wanted
    have = ".".join(ov_version.split(".")[:2])
    if isinstance(wanted, str) and wanted and wanted != have:
        return (
            f"the blob was compiled by OpenVINO {wanted}, the openvino package here is "
            f'{ov_version}: pin "openvino=={wanted}.*" in the toolchain requirements of '
            f"provider {provider!r}"
        )
    return None


def check(job: dict[str, Any]) -> dict[str, Any]:
    """Run the source on ORT's CPU EP and the blob through openvino; compare each output."""
    import onnxruntime as ort

    provider = job["provider"]["name"]
    try:
        attrs, data = _context(job["ctx"])
    except ImportError:
        return {
            "outcome": "not_loadable_here",
            "message": "its blob is embedded in the ctx model, and reading it needs the onnx "
            f'package: add "onnx" to the toolchain requirements of provider {provider!r}',
        }
    try:
        import openvino as ov
    except ImportError:
        sdk = attrs.get("ep_sdk_version") or b"<ep_sdk_version>"
        sdk = sdk.decode() if isinstance(sdk, bytes) else sdk
        return {
            "outcome": "not_loadable_here",
            "message": "to check it with the standalone openvino package instead, add "
            f'"openvino=={sdk}.*" to the toolchain requirements of provider {provider!r}',
        }
    version = ov.get_version().split("-")[0]
    problem = _version_problem(attrs, version, provider)
    if problem:
        return {"outcome": "not_loadable_here", "message": problem}
    partition = attrs.get("partition_name", "")
    partition = partition.decode() if isinstance(partition, bytes) else str(partition)
    blob = unwrap(data, partition)

    cpu, names = reference(ort, job)
    compiled = ov.Core().import_model(blob, "CPU", IMPORT_CONFIG)
    by_name = {n: port for port in compiled.outputs for n in port.get_names()}
    missing = [n for n in names if n not in by_name]
    if missing:
        return {"outcome": "failed", "message": f"the blob has no output named {missing[0]!r}"}
    figures = Figures(names)
    for feed in samples(cpu, job):
        got = compiled(feed)
        figures.add([got[by_name[n]] for n in names], cpu.run(None, feed))
    note = f"run with the standalone openvino {version} (import_model on CPU, fp32)"
    return {"outcome": "passed", "message": note, **figures.result()}


def main() -> None:
    """Entry point: one JSON job on stdin (``ctx``, ``source``, ``provider``, the numerics
    inputs), one JSON line on stdout."""
    answer(check, plain=(BlobError,))


if __name__ == "__main__":
    main()
