"""An ``[llms]`` decoder of real size built in parts: time and peak memory of every process.

The decoder is the tiny Llama fixture's graph given the shape of Qwen2.5-0.5B (hidden 896,
14 heads / 2 KV heads of 64, intermediate 4864, 24 layers, vocabulary 151,936; random
fp32 weights, 494 M parameters, written tensor by tensor), so that no torch is needed. It is
built with ``parts`` (default 4, shared binaries, ``-j 2``); the build's trace gives each
action's wall time and its worker's peak RSS. Then one weight of the last layer is edited
and the build run again (only the last part compiles).

With ``--quantize w8a16`` (or ``w4a16``) the decoder is calibrated on text prompts
(``--prompts``, default the tiny fixtures' ten) and quantized part by part before it
compiles; the report adds the calibration's and the quantizations' rows, and the time and
peak memory of ``verify --numerics``. Between the cold build and the edit, the outputs and
the state are removed and restored from the workspace's cache.

    python benchmarks/bench_llm_parts.py [--parts 4] [--context 1024] [--window 64]
        [--quantize w8a16|w4a16] [--prompts FILE] [DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from llmfixture import LLM_FIXTURES, deepen  # noqa: E402

RECIPES = {
    "w8a16": 'activations = "uint16"\nweights = "uint8"\n',
    "w4a16": 'activations = "uint16"\nweights = "int4"\nper_channel = true\n',
}
"""The ``[quantization.NAME]`` settings ``--quantize`` names (beside the prompts)."""
CACHE = "cache"
"""The workspace's own cache (a cold build finds nothing of another workspace's)."""

HIDDEN, HEADS, KV_HEADS, HEAD = 896, 14, 2, 64
INTER, LAYERS, VOCAB, POSITIONS = 4864, 24, 151936, 4096


def _shape(name: str) -> tuple[int, ...]:
    """The Qwen2.5-0.5B shape of a fixture weight."""
    if "embed_tokens" in name:
        return (VOCAB, HIDDEN)
    if name.startswith("lm_head"):
        return (HIDDEN, VOCAB)
    if name in ("cos_cache", "sin_cache"):
        return (POSITIONS, HEAD // 2)
    if "layernorm" in name:
        return (HIDDEN,)
    if "qkv_proj" in name:
        return (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD)
    if "o_proj" in name:
        return (HEADS * HEAD, HIDDEN)
    if "gate_proj" in name or "up_proj" in name:
        return (HIDDEN, INTER)
    if "down_proj" in name:
        return (INTER, HIDDEN)
    raise ValueError(name)


def make_decoder(folder: Path) -> Path:
    """Write the 0.5B-shaped decoder into ``folder`` (a copy of the fixture's other files)."""
    shutil.copytree(LLM_FIXTURES / "llama", folder)
    deepen(folder, LAYERS)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    graph = model.graph
    rng = np.random.default_rng(0)
    (folder / "model.onnx.data").unlink()
    with open(folder / "model.onnx.data", "wb") as data:
        for tensor in graph.initializer:
            shape = _shape(tensor.name)
            if tensor.name in ("cos_cache", "sin_cache"):
                freq = 1.0 / (10000 ** (np.arange(0, HEAD, 2) / HEAD))
                angles = np.outer(np.arange(POSITIONS), freq)
                values = (np.cos if tensor.name == "cos_cache" else np.sin)(angles)
            elif "layernorm" in tensor.name:
                values = np.ones(shape)
            else:
                values = rng.standard_normal(shape, dtype=np.float32) * 0.02
            blob = values.astype(np.float32).tobytes()
            offset = data.tell()
            data.write(blob)
            del tensor.dims[:]
            tensor.dims.extend(shape)
            tensor.data_type = TensorProto.FLOAT
            tensor.data_location = TensorProto.EXTERNAL
            tensor.ClearField("raw_data")
            del tensor.external_data[:]
            refs = {"location": "model.onnx.data", "offset": offset, "length": len(blob)}
            for key, value in refs.items():
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            del values, blob
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            for attr in node.attribute:
                if attr.name == "num_heads":
                    attr.i = HEADS
                elif attr.name == "kv_num_heads":
                    attr.i = KV_HEADS
                elif attr.name == "scale":
                    attr.f = 1 / math.sqrt(HEAD)
    for value in graph.output:
        if value.name == "logits":
            value.type.tensor_type.shape.dim[2].dim_value = VOCAB
    onnx.save(model, folder / "model.onnx")
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    decoder = config["model"]["decoder"]
    decoder.update(head_size=HEAD, hidden_size=HIDDEN, num_attention_heads=HEADS)
    decoder.update(num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS)
    config["model"].update(vocab_size=VOCAB, context_length=POSITIONS)
    config_path.write_text(json.dumps(config, indent=4))
    return folder


def _edit_last_layer(folder: Path) -> None:
    """Change one weight of the last layer in place (the data file's bytes): 0.5 added."""
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    name = f"model.layers.{LAYERS - 1}.mlp.down_proj.MatMul.weight"
    (tensor,) = [t for t in model.graph.initializer if t.name == name]
    offset = int({e.key: e.value for e in tensor.external_data}["offset"])
    with open(folder / "model.onnx.data", "r+b") as f:  # another value each time it runs
        f.seek(offset)
        value = np.frombuffer(f.read(4), dtype=np.float32)[0] + np.float32(0.5)
        f.seek(offset)
        f.write(np.float32(value).tobytes())


def _build(root: Path, trace: Path) -> dict[str, object]:
    from epbuild import build

    t0 = time.perf_counter()
    result = build(root, None, [], jobs=2, trace=trace)
    wall = time.perf_counter() - t0
    events = json.loads(trace.read_text())["traceEvents"]
    actions = {
        e["args"]["action"]: {
            "seconds": round(e["dur"] / 1e6, 1),
            "peak_rss_mb": round((e["args"].get("peak_rss") or 0) / 2**20),
        }
        for e in events
        if e.get("cat") == "compile" and "args" in e
    }
    outcomes = {a.id: a.outcome.value for a in result.actions}
    return {"ok": result.ok, "wall_s": round(wall, 1), "actions": actions, "outcomes": outcomes}


_TREE = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
    "sys.exit(code)"
)
"""Runs a command and says the peak RSS (KiB) of its every process (the waited-for ones)."""


def _command(root: Path, *argv: str) -> dict[str, object]:
    """``epbuild ARGV`` in ``root``: its exit code, wall time and the peak RSS of any of its
    processes (loaders included)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", _TREE, sys.executable, "-m", "epbuild", *argv]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    peak = int(done.stderr.strip().splitlines()[-1])
    return {
        "exit": done.returncode,
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(peak / 1024),
        "tail": done.stdout.strip().splitlines()[-12:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", nargs="?", help="workspace folder (default: a temporary one)")
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--unshared", action="store_true", help="share_weights = false")
    parser.add_argument("--quantize", choices=sorted(RECIPES), help="quantize the parts")
    parser.add_argument(
        "--prompts",
        type=Path,
        default=HERE.parent / "tests" / "fixtures" / "llm" / "text-prompts.txt",
        help="calibration prompts, one a line (with --quantize)",
    )
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="llm-parts-"))
    t0 = time.perf_counter()
    if not (root / "models" / "tiny").exists():
        make_decoder(root / "models" / "tiny")
    made = time.perf_counter() - t0
    quantize = ""
    if args.quantize:
        shutil.copyfile(args.prompts, root / "prompts.txt")
        quantize = f'quantize = "{args.quantize}"\n\n[quantization.{args.quantize}]\n'
        quantize += f'calibration = "prompts.txt"\n{RECIPES[args.quantize]}'
    (root / "epbuild.toml").write_text(
        f'[workspace]\ncache = "{CACHE}"\n\n'
        '[providers.htp-v73]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n\n'
        f'[llms.chat]\nsource = "models/tiny"\nproviders = ["htp-v73"]\n'
        f"context_length = {args.context}\nwindow_size = {args.window}\n"
        f"share_weights = {str(not args.unshared).lower()}\nparts = {args.parts}\n{quantize}"
    )
    report: dict[str, object] = {"decoder_made_s": round(made, 1)}
    report["cold"] = _build(root, root / "cold.json")
    out = root / "build" / "chat" / "htp-v73"
    report["binaries_mb"] = {
        p.name: round(p.stat().st_size / 2**20) for p in sorted(out.glob("*.bin"))
    }
    report["embeddings_mb"] = round((out / "embeddings.onnx.data").stat().st_size / 2**20)
    if args.quantize:
        report["verify_numerics"] = _command(root, "verify", "--numerics")
    for made in (root / "build", root / ".epbuild"):  # the cache stays
        shutil.rmtree(made)
    report["restore"] = _build(root, root / "restore.json")
    _edit_last_layer(root / "models" / "tiny")
    report["edit_last_layer"] = _build(root, root / "edit.json")
    report["bench_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(report, indent=1))
    print(f"workspace: {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
