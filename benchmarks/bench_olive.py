"""Olive's QNN LLM passes beside epbuild on the same decoder: wall time, peak memory,
context binaries, and whether onnxruntime-genai generates the source's tokens.

Olive (olive-ai, in an interpreter of its own: ``--olive-python``, default this one) runs
the ONNX-level part of its QNN LLM recipes (olive-recipes, e.g. Qwen2.5-0.5B-Instruct/QNN)
on the builder-made decoder itself, so no PyTorch model, GPU or hub is needed:

- ``fp16``: GraphSurgeries (RemoveRopeMultiCache, AttentionMaskToSequenceLengths,
  SimplifiedLayerNormToL2Norm) → SplitModel (embeddings, ``--parts`` transformer parts,
  lm_head) → StaticLLM (prompt graph of ``--window`` tokens, token graph of 1) →
  EPContextBinaryGenerator (HTP v73, unshared) → ComposeOnnxModels;
- ``w8a16``: the same with OnnxStaticQuantization (uint16 activations, uint8 weights,
  calibrated on the CPU from the prompts file, GroupQueryAttention left in float, as the
  recipes do) after the surgeries;
- ``w4a16``: OnnxBlockWiseRtnQuantization (4-bit, blocks of 32, symmetric; the lm_head and
  the embedding kept out) → MatMulNBitsToQDQ (uint4 with zero points) before the static
  quantization, in place of the recipes' GPTQ on a GPU.

epbuild builds the same source as an ``[llms]`` entry (the same window, ``parts`` when
``--parts`` is above 1, ``quantize`` with a w8a16 or w4a16 table on the same prompts,
unshared binaries). Each tool runs cold (no cache) in a process of its own; its peak memory is
``wait4``'s for that process tree (the largest single process in it), and for epbuild each
action's worker peak from the build's trace.

    python benchmarks/bench_olive.py [--olive-python PATH] [--model llama-text|llama|0.5b]
        [--precisions fp16,w8a16,w4a16] [--parts 1] [--context 64] [--window 16]
        [--tokens 10] [DIR]

Each package is then run through onnxruntime-genai + the QNN plugin (emulated HTP), teacher
-forced on the source's greedy tokens from each prompt (the CPU), and the tokens that agree
are counted. Olive's package is run as written and, where genai refuses it, again with the
one provider option it lacks (``backend_path``) added to a copy. ``--tokens 0`` skips
generation (the 0.5B decoder takes minutes a token on the emulated HTP). Prints one JSON
document. Without olive in ``--olive-python`` it says how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from llmfixture import LLM_FIXTURES, TEXT_PROMPTS  # noqa: E402  (the tests' fixtures)

INSTALL = """\
olive: not importable in {python}; nothing measured. To run this benchmark, make an
interpreter of its own for Olive (it pins its own torch and transformers) and give it:

    python3 -m venv olive-venv
    olive-venv/bin/pip install olive-ai==0.13.0 requests onnxruntime==1.32.* onnxruntime-qnn \\
        onnxruntime-genai torch
    python benchmarks/bench_olive.py --olive-python olive-venv/bin/python

(olive-ai 0.13.0 imports requests without requiring it; a CPU build of torch is enough.)
"""


PROVIDER = {"htp_arch": "73", "soc_model": "60"}
PRECISIONS = ("fp16", "w8a16", "w4a16")

# Olive 0.13 queues a telemetry heartbeat and waits for its upload when it exits (seconds
# on a machine without the network); only a CI variable skips it.
OLIVE_ENV = {**os.environ, "OLIVE_DISABLE_TELEMETRY": "1", "CI": "1"}

# Calibration feeds for the whole (dynamic) decoder after the graph surgeries: each prompt
# once, no KV cache yet, as the recipes' line-by-line text data gives them.
OLIVE_DATA = """
import json
from pathlib import Path

import numpy as np
from olive.data.registry import Registry
from tokenizers import Tokenizer


@Registry.register_dataloader()
def prompt_loader(dataset, batch_size=1, **kwargs):
    folder = Path("models/tiny")
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    shape = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])
    for line in Path("prompts.txt").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        ids = tokenizer.encode(line.strip()).ids
        feed = {
            "input_ids": np.array([ids], np.int64),
            "past_seq_len": np.array([[len(ids) - 1]], np.int32),
            "total_seq_len": np.array(len(ids), np.int32),
        }
        for i in range(decoder["num_hidden_layers"]):
            for kind in ("key", "value"):
                feed[f"past_key_values.{i}.{kind}"] = np.zeros(shape, np.float32)
        yield feed, 0
"""

W8A16 = (
    '[quantization.w8a16]\ncalibration = "prompts.txt"\nactivations = "uint16"\nweights = "uint8"\n'
)
W4A16 = (
    '[quantization.w4a16]\ncalibration = "prompts.txt"\nactivations = "uint16"\nweights = "int4"\n'
    "per_channel = true\ncheck = { min_token_agreement = 0.0 }\n"
)


def olive_version(python: str) -> str | None:
    """olive-ai's version in interpreter ``python``; None when it cannot import olive."""
    code = "import olive; from importlib.metadata import version; print(version('olive-ai'))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=OLIVE_ENV)
    except OSError:
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def measured(command: list[str], cwd: Path, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``command`` (output to ``log``): exit status, wall seconds and the peak RSS of the
    largest process of its tree (``wait4``, which counts the children it waited for)."""
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": round(time.perf_counter() - started, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024),
    }


def last_error(log: Path) -> str | None:
    """The last exception line of a log (Olive prints tracebacks and may still exit 0)."""
    found = None
    for line in log.read_text(errors="replace").splitlines():
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Fail)\w*(:|$)", line.strip()):
            found = line.strip()
    return found


def split_assignments(layers: int, parts: int) -> dict[str, int]:
    """SplitModel's assignments for a builder-made decoder: the embedding, ``parts`` runs of
    layers (the final norm, ``model.layers.<layers>``, with the last) and the lm_head. A dict:
    Olive 0.13 takes the string form for a file path and fails past 255 characters
    (``OSError: [Errno 36] File name too long``)."""
    found = {"model.embed_tokens": 0}
    for layer in range(layers + 1):
        found[f"model.layers.{layer}"] = 1 + min(layer, layers - 1) * parts // layers
    found["lm_head"] = parts + 1
    return found


def olive_config(
    precision: str, layers: int, parts: int, window: int, files: list[str]
) -> dict[str, Any]:
    """The Olive workflow for ``precision`` on ``models/tiny`` (paths relative to the
    workspace, where Olive runs)."""
    passes: dict[str, Any] = {
        "gs": {
            "type": "GraphSurgeries",
            "surgeries": [
                {"surgeon": "RemoveRopeMultiCache"},
                {"surgeon": "AttentionMaskToSequenceLengths"},
                {"surgeon": "SimplifiedLayerNormToL2Norm"},
            ],
            "save_as_external_data": True,
        }
    }
    if precision == "w4a16":
        passes["rtn"] = {
            "type": "OnnxBlockWiseRtnQuantization",
            "bits": 4,
            "block_size": 32,
            "is_symmetric": True,
            # A 4-bit embedding becomes GatherBlockQuantized, whose packed shape breaks ORT's
            # symbolic shape inference in the quantizer and SplitModel (AssertionError).
            "nodes_to_exclude": ["/lm_head/MatMul", "/model/embed_tokens/Gather"],
            "save_as_external_data": True,
        }
        passes["mq"] = {
            "type": "MatMulNBitsToQDQ",
            "use_int4": True,
            "add_zero_point": True,
            "save_as_external_data": True,
        }
    if precision != "fp16":
        passes["sq"] = {
            "type": "OnnxStaticQuantization",
            "data_config": "prompts",
            "activation_type": "uint16",
            "precision": "uint8",
            "calibration_providers": ["CPUExecutionProvider"],
            "quant_preprocess": True,
            "op_types_to_exclude": ["GatherBlockQuantized", "GroupQueryAttention", "MatMulNBits"],
            "save_as_external_data": True,
        }
    passes["sp"] = {"type": "SplitModel", "split_assignments": split_assignments(layers, parts)}
    passes["st"] = {"type": "StaticLLM", "batch_size": 1, "context_length": window}
    passes["cb"] = {
        "type": "EPContextBinaryGenerator",
        "provider_options": dict(PROVIDER),
        "weight_sharing": False,  # a shared binary crashes ORT when loaded on x86_64
    }
    passes["cp"] = {"type": "ComposeOnnxModels"}
    return {
        "input_model": {
            "type": "ONNXModel",
            "model_path": "models/tiny",
            "onnx_file_name": "model.onnx",
            "model_attributes": {"additional_files": files},
        },
        "systems": {
            "local": {
                "type": "LocalSystem",
                "accelerators": [
                    {"device": "npu", "execution_providers": ["QNNExecutionProvider"]}
                ],
            }
        },
        "data_configs": [
            {
                "name": "prompts",
                "user_script": "olive_data.py",
                "load_dataset_config": {"type": "simple_dataset"},
                "dataloader_config": {"type": "prompt_loader"},
            }
        ],
        "passes": passes,
        "host": "local",
        "target": "local",
        "evaluate_input_model": False,
        "output_dir": f"olive-{precision}",
        "cache_dir": f"olive-cache-{precision}",
        "log_severity_level": 1,
    }


def manifest(precision: str, parts: int, context: int, window: int) -> str:
    lines = [
        '[providers.htp-v73]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n',
        '[llms.chat]\nsource = "models/tiny"\nproviders = ["htp-v73"]',
        f"context_length = {context}\nwindow_size = {window}\nshare_weights = false",
    ]
    if parts > 1:
        lines.append(f"parts = {parts}")
    if precision != "fp16":
        lines.append(f'quantize = "{precision}"\n')
        lines.append(W8A16 if precision == "w8a16" else W4A16)
    return "\n".join(lines) + "\n"


def package_facts(folder: Path) -> dict[str, Any]:
    """Binary sizes, the package's size, and each ctx graph's nodes by type (EPContext nodes
    and what stayed on the CPU)."""
    import onnx

    if not folder.is_dir():
        return {"written": False}
    graphs = {}
    for path in sorted(folder.glob("*_ctx.onnx")):
        ops: dict[str, int] = {}
        for node in onnx.load(path, load_external_data=False).graph.node:
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
        graphs[path.name] = ops
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {
        "written": bool(graphs),
        "binaries_bytes": {p.name: p.stat().st_size for p in sorted(folder.glob("*.bin"))},
        "package_bytes": sum(p.stat().st_size for p in files),
        "ctx_graphs": graphs,
    }


def agreement(
    folder: Path, prompts: list[str], forced: list[list[int]], context: int
) -> dict[str, Any]:
    """Teacher-forced greedy agreement with the source's tokens, per prompt (genai + QNN)."""
    from epbuild.llm.generate import GenerationError, generate_all

    try:
        found = generate_all(
            folder,
            qnn=True,
            tokens=len(forced[0]),
            prompts=prompts,
            max_length=context,
            forced=forced,
        )
    except GenerationError as exc:
        return {"generates": False, "error": str(exc).strip().splitlines()[-1]}
    per_prompt = [
        sum(a == b for a, b in zip(g.tokens, f, strict=False))
        for g, f in zip(found, forced, strict=True)
    ]
    return {
        "generates": True,
        "agreement": f"{sum(per_prompt)} of {sum(len(f) for f in forced)}",
        "per_prompt": per_prompt,
        "tokens_per_s": round(sum(g.tokens_per_second for g in found) / len(found), 1),
    }


def with_backend_path(package: Path, into: Path) -> Path:
    """A copy of Olive's package whose QNN provider options name the HTP backend library
    (genai with the QNN plugin refuses them without it)."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(package, into)
    config_path = into / "genai_config.json"
    config = json.loads(config_path.read_text())
    for stage in config["model"]["decoder"].get("pipeline", [{}])[0].values():
        for options in stage.get("session_options", {}).get("provider_options", []):
            if "qnn" in options:
                options["qnn"]["backend_path"] = "libQnnHtp.so"
    config_path.write_text(json.dumps(config, indent=1))
    return into


def epbuild_run(ws: Path, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    folder = ws / f"epbuild-{precision}"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "models").mkdir(parents=True)
    shutil.copytree(ws / "models" / "tiny", folder / "models" / "tiny")
    shutil.copy(ws / "prompts.txt", folder / "prompts.txt")
    (folder / "epbuild.toml").write_text(manifest(precision, args.parts, args.context, args.window))
    env = {**os.environ, "EPBUILD_CACHE": "off", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "epbuild", "build", "--no-cache", "-j", "2"]
    cold = measured([*command, "--trace", "trace.json"], folder, folder / "build.log", env)
    if cold["rc"] != 0:
        cold["error"] = last_error(folder / "build.log")
    trace = folder / "trace.json"
    if trace.is_file():
        cold["actions"] = {
            e["args"]["action"]: {
                "s": round(e["dur"] / 1e6, 1),
                "peak_rss_mb": round(e["args"].get("peak_rss", 0) / 2**20),
            }
            for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("cat") == "compile"
        }
    again = measured(command, folder, folder / "again.log", env)
    return {
        "cold": cold,
        "unchanged_s": again["wall_s"],
        "package": folder / "build" / "chat" / "htp-v73",
    }


def olive_run(
    ws: Path, precision: str, python: str, layers: int, args: argparse.Namespace
) -> dict[str, Any]:
    plain = sorted((ws / "models" / "tiny").iterdir())
    files = [f"models/tiny/{p.name}" for p in plain if p.suffix in (".json", ".model", ".txt")]
    config = olive_config(precision, layers, args.parts, args.window, sorted(set(files)))
    (ws / f"olive-{precision}.json").write_text(json.dumps(config, indent=1))
    for leftover in (f"olive-{precision}", f"olive-cache-{precision}"):
        shutil.rmtree(ws / leftover, ignore_errors=True)
    config_file = f"olive-{precision}.json"
    command = [python, "-m", "olive", "run", "--config", config_file]
    command += ["--package-config", "olive_package.json"]
    log = ws / f"olive-{precision}.log"
    cold = measured(command, ws, log, OLIVE_ENV)
    text = log.read_text(errors="replace")
    cold["passes_s"] = {
        m.group(1): round(float(m.group(2)), 2)
        for m in re.finditer(r"Pass (\w+):\w+ finished in ([0-9.]+) seconds", text)
    }
    failed = last_error(log)
    if failed or cold["rc"] != 0:
        cold["error"] = failed
    again = measured(command, ws, ws / f"olive-{precision}-again.log", OLIVE_ENV)
    return {"cold": cold, "unchanged_s": again["wall_s"], "package": ws / f"olive-{precision}"}


def _drop_value_info(path: Path) -> None:
    """Drop the shapes the builder wrote for the tiny fixture's tensors (``make_decoder``
    gives the weights new shapes but keeps those: hidden 64 where it is 896, on which Olive's
    shape inference fails); what needs a shape infers it again."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    del model.graph.value_info[:]
    onnx.save(model, path)


def source(ws: Path, model: str) -> int:
    """The decoder in ``ws/models/tiny``; returns its number of layers."""
    target = ws / "models" / "tiny"
    if not target.exists():
        if model == "0.5b":
            from bench_llm_parts import make_decoder

            make_decoder(target)
            _drop_value_info(target / "model.onnx")
        else:
            shutil.copytree(LLM_FIXTURES / model, target)
    config = json.loads((target / "genai_config.json").read_text())
    return int(config["model"]["decoder"]["num_hidden_layers"])


def olive_package_config(python: str, into: Path) -> None:
    """Olive's package config with EPContextBinaryGenerator allowed off the target (a host
    without the QNN EP's hardware refuses it otherwise)."""
    code = "import olive, os; print(os.path.dirname(olive.__file__))"
    found = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True, env=OLIVE_ENV
    )
    package = json.loads((Path(found.stdout.strip()) / "olive_config.json").read_text())
    package["passes"]["EPContextBinaryGenerator"]["run_on_target"] = False
    into.write_text(json.dumps(package))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", help="workspace folder (default: a temporary one)")
    parser.add_argument(
        "--olive-python", default=sys.executable, help="an interpreter with olive-ai"
    )
    parser.add_argument("--model", choices=["llama-text", "llama", "0.5b"], default="llama-text")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--parts", type=int, default=1, help="transformer parts (default 1)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=10, help="0: no generation")
    args = parser.parse_args()
    olive = olive_version(args.olive_python)
    if olive is None:
        print(INSTALL.format(python=args.olive_python))
        return 0
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = set(precisions) - set(PRECISIONS)
    if unknown:
        parser.error(
            f"--precisions: unknown {sorted(unknown)}; choose from {', '.join(PRECISIONS)}"
        )
    ws = Path(args.dir or tempfile.mkdtemp(prefix="bench-olive-")).resolve()
    ws.mkdir(parents=True, exist_ok=True)
    layers = source(ws, args.model)
    shutil.copy(TEXT_PROMPTS, ws / "prompts.txt")
    (ws / "olive_data.py").write_text(OLIVE_DATA)
    olive_package_config(args.olive_python, ws / "olive_package.json")
    prompts = [line.strip() for line in TEXT_PROMPTS.read_text().splitlines() if line.strip()]
    forced: list[list[int]] = []
    if args.tokens:
        from epbuild.llm.generate import generate_all

        found = generate_all(
            ws / "models" / "tiny",
            qnn=False,
            tokens=args.tokens,
            prompts=prompts,
            max_length=args.context,
        )
        forced = [list(g.tokens) for g in found]
    report: dict[str, Any] = {
        "olive": olive,
        "olive_import_s": measured(
            [args.olive_python, "-c", "import olive.workflows"], ws, ws / "import.log", OLIVE_ENV
        )["wall_s"],
        "model": args.model,
        "layers": layers,
        "parts": args.parts,
        "context": args.context,
        "window": args.window,
        "workspace": str(ws),
    }
    for precision in precisions:
        entry: dict[str, Any] = {}
        for tool in ("olive", "epbuild"):
            if tool == "olive":
                run = olive_run(ws, precision, args.olive_python, layers, args)
            else:
                run = epbuild_run(ws, precision, args)
            package = run.pop("package")
            run.update(package_facts(package))
            if forced and run["written"]:
                run["generate"] = agreement(package, prompts, forced, args.context)
                if tool == "olive" and not run["generate"]["generates"]:
                    patched = with_backend_path(package, ws / f"olive-{precision}-backend-path")
                    run["generate_with_backend_path"] = agreement(
                        patched, prompts, forced, args.context
                    )
            entry[tool] = run
        report[precision] = entry
        print(json.dumps({precision: entry}), file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
