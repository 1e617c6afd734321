"""The manifest's JSON Schema: the one model both validation and ``schemas/`` come from.

``SCHEMA`` is written to ``schemas/epbuild.schema.json`` by ``python -m
epbuild.manifest.schema``; a test fails when the file and this module drift apart.
``validate`` checks a parsed manifest against the subset of JSON Schema used here, without
third-party imports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from epbuild._names import ACTIVATION_TYPES, CALIBRATION_METHODS, WEIGHT_TYPES

NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A group, provider, LLM, recipe or model name: each is a path component of the outputs,
so at most 64 characters (a longer one failed only when the build wrote its files)."""
EP_NAME_PATTERN = "^[A-Za-z][A-Za-z0-9_.-]*$"
"""An execution provider's name as an app registers it (``[package] ep_names``)."""
_SCALAR = {"type": ["string", "integer", "number", "boolean"]}
MAX_FREE_DIMENSION = 1 << 24
"""The largest value ``free_dimensions`` accepts: far beyond any real sequence or batch, and
below what makes ONNX Runtime or an EP overflow or abort while compiling."""
_FREE_DIMENSIONS = {
    "type": "object",
    "additionalProperties": {"type": "integer", "minimum": 1, "maximum": MAX_FREE_DIMENSION},
    "description": "Values for symbolic input dimensions, by name (dim_param), e.g. "
    "{ batch = 1, sequence_length = 128 }: ONNX Runtime's free dimension overrides.",
}

_RANGE = {"type": "array", "minItems": 2, "items": {"type": "number"}}
NUMERICS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "How 'verify --numerics' compares the ctx model with its source.",
    "properties": {
        "rtol": {
            "type": "number",
            "minimum": 0,
            "description": "Allowed max |ctx - source| relative to the output's largest "
            "|source| value (default: the EP's; HTP computes in fp16).",
        },
        "atol": {
            "type": "number",
            "minimum": 0,
            "description": "Allowed max |ctx - source| (within atol or rtol passes).",
        },
        "min_cosine": {
            "type": "number",
            "minimum": -1,
            "maximum": 1,
            "description": "Smallest allowed cosine similarity of each output.",
        },
        "inputs": {
            "type": ["string", "array"],
            "items": {"type": "string", "minLength": 1},
            "minLength": 1,
            "description": ".npz sample inputs (paths or globs relative to the manifest), "
            "one feed each, inputs by name; default: one seeded random feed.",
        },
        "seed": {"type": "integer", "minimum": 0, "description": "Seed of random inputs."},
        "float_range": {
            **_RANGE,
            "description": "[low, high): random float inputs (default standard normal).",
        },
        "int_range": {
            **_RANGE,
            "description": "[low, high): random integer inputs such as token ids (default [0, 4]).",
        },
    },
}

# The compile settings a provider table and a group table both take (a group's win).
COMPILE_PROPERTIES: dict[str, Any] = {
    "compiler": {
        "type": "string",
        "enum": ["compile_api", "session"],
        "description": "compile_api: onnxruntime.ModelCompiler (default where onnxruntime "
        ">= 1.23); session: an InferenceSession per model.",
    },
    "graph_optimization_level": {
        "type": "string",
        "enum": ["disabled", "basic", "extended", "all", "auto"],
        "description": "ONNX Runtime graph optimisations before partitioning (default all). "
        "auto: all, and where nodes fall back to the CPU EP also basic and disabled, keeping "
        "the result with the fewest CPU nodes, then the fewest EPContext nodes.",
    },
    "disable_cpu_ep_fallback": {
        "type": "boolean",
        "description": "session.disable_cpu_ep_fallback: fail when a node would run on the CPU EP.",
    },
    "intra_op_num_threads": {
        "type": "integer",
        "minimum": 1,
        "maximum": 1024,
        "description": "Threads of the compile's session (default: ONNX Runtime's).",
    },
    "external_data_folder": {
        "type": "string",
        "minLength": 1,
        "description": "load = bytes: folder of the models' external data, relative to the "
        "manifest (default: the model's folder).",
    },
}

_SAMPLES = {
    "type": ["string", "array"],
    "minLength": 1,
    "minItems": 1,
    "items": {"type": "string", "minLength": 1},
}
QUANTIZATION: dict[str, Any] = {
    "calibration": {
        **_SAMPLES,
        "description": "Calibration samples relative to the manifest: .npz files (arrays "
        "named after the model's inputs), .npy files (a single-input model), ONNX test-data "
        "folders (test_data_set_N/input_K.pb), folders of them, or globs; for an [llms] "
        "entry, text prompts: .txt files (one prompt a line, UTF-8), folders of them, or "
        "globs.",
    },
    "validation": {
        **_SAMPLES,
        "description": "Samples 'verify --numerics' compares on (default: the calibration "
        "samples); the same forms as calibration.",
    },
    "activations": {
        "type": "string",
        "enum": list(ACTIVATION_TYPES),
        "description": "Activation type (default uint8).",
    },
    "weights": {
        "type": "string",
        "enum": list(WEIGHT_TYPES),
        "description": "Weight type (default uint8).",
    },
    "per_channel": {"type": "boolean", "description": "Per-channel weights (default false)."},
    "method": {
        "type": "string",
        "enum": list(CALIBRATION_METHODS),
        "description": "Calibration method (default minmax).",
    },
    "exclude": {
        "type": "array",
        "items": {"type": "string", "minLength": 1},
        "description": "Node names kept in float (they run outside the NPU).",
    },
    "overrides": {
        "type": "object",
        "additionalProperties": {"type": "string", "enum": list(ACTIVATION_TYPES)},
        "description": "Per-tensor activation types, by tensor name: mixed precision.",
    },
    "check": {
        "type": "object",
        "additionalProperties": False,
        "description": "Limits of 'verify --numerics' (and of 'verify --generate' for an "
        "LLM) against the float source.",
        "properties": {
            "min_sqnr_db": {
                "type": "number",
                "description": "Smallest SQNR (dB) of each output (default 20).",
            },
            "top1": {
                "type": "number",
                "minimum": 0,
                "maximum": 1,
                "description": "Smallest top-1 agreement of [batch, classes] outputs.",
            },
            "min_token_agreement": {
                "type": "number",
                "minimum": 0,
                "maximum": 1,
                "description": "A quantized LLM: smallest share of greedy tokens "
                "'verify --generate' must find equal to the float source's, per prompt "
                "(default 0.9).",
            },
        },
    },
}

_PROVIDER_NAMES = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "string", "minLength": 1},
    "description": "Names of [providers.*] tables to compile for.",
}


def _named_tables(
    description: str, required: list[str], properties: dict[str, Any]
) -> dict[str, Any]:
    """A table of named tables (``[providers.<name>]``, ...), each closed to other keys."""
    return {
        "type": "object",
        "description": description,
        "propertyNames": {"pattern": NAME_PATTERN},
        "additionalProperties": {
            "type": "object",
            "additionalProperties": False,
            "required": required,
            "properties": properties,
        },
    }


SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "epbuild manifest (epbuild.toml)",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "workspace": {
            "type": "object",
            "description": "Where outputs, state and cache live, and how much runs at once.",
            "additionalProperties": False,
            "properties": {
                "out_dir": {
                    "type": "string",
                    "minLength": 1,
                    "description": "Output directory, relative to the manifest (default build).",
                },
                "state_dir": {
                    "type": "string",
                    "minLength": 1,
                    "description": "State directory, relative to the manifest (default .epbuild).",
                },
                "jobs": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 1024,
                    "description": "Compiles run at once (default: number of CPUs).",
                },
                "memory_budget": {
                    "type": ["integer", "string"],
                    "description": "Memory compiles may use at once: bytes or '8G', '512M'.",
                },
                "cache": {
                    "type": "string",
                    "minLength": 1,
                    "description": "Cache directory (relative) or fsspec URL (s3://...).",
                },
                "executor": {
                    "type": "string",
                    "enum": ["local", "dask"],
                    "description": "Where actions run (default local).",
                },
                "scheduler": {
                    "type": "string",
                    "description": "Dask scheduler address for executor = dask.",
                },
            },
        },
        "providers": _named_tables(
            "Named provider configurations.",
            ["ep"],
            {
                "ep": {
                    "type": "string",
                    "description": "Adapter: qnn, openvino, tensorrt, plugin or a "
                    "third-party adapter.",
                },
                "options": {
                    "type": "object",
                    "additionalProperties": {"type": [*_SCALAR["type"], "object"]},
                    "description": "Provider options passed to the EP (a table only where "
                    "the adapter takes one, e.g. OpenVINO's load_config).",
                },
                "session_options": {
                    "type": "object",
                    "additionalProperties": _SCALAR,
                    "description": "Extra ONNX Runtime session config entries.",
                },
                "library": {
                    "type": "string",
                    "description": "plugin: path of the EP shared library.",
                },
                "ep_name": {
                    "type": "string",
                    "description": "plugin: the name the EP registers.",
                },
                "device_type": {
                    "type": "string",
                    "enum": ["cpu", "gpu", "npu"],
                    "description": "plugin: which device type to compile for.",
                },
                "source": {
                    "type": "string",
                    "description": "plugin: the EPContext 'source' value expected.",
                },
                "toolchain": {
                    "type": "object",
                    "additionalProperties": False,
                    "description": "The Python environment its workers run in (default: "
                    "epbuild's own): requirements epbuild installs into an environment it "
                    "makes and keeps, or the python of one you provide.",
                    "properties": {
                        "requirements": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "string", "minLength": 1},
                            "description": "pip requirements, e.g. "
                            '["onnxruntime-openvino==1.24.1"].',
                        },
                        "python": {
                            "type": "string",
                            "minLength": 1,
                            "description": "An interpreter path (relative to the manifest) "
                            "or command name.",
                        },
                    },
                },
                **COMPILE_PROPERTIES,
            },
        ),
        "groups": _named_tables(
            "Model groups.",
            ["models", "providers"],
            {
                "models": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": ["string", "object"],
                        "minLength": 1,
                        "additionalProperties": False,
                        "required": ["path"],
                        "properties": {
                            "path": {
                                "type": "string",
                                "minLength": 1,
                                "description": "Model path relative to the manifest; "
                                "a glob only without a name.",
                            },
                            "name": {
                                "type": "string",
                                "pattern": NAME_PATTERN,
                                "description": "Output stem (<name>_ctx.onnx), default "
                                "the file's stem: the same model can be listed twice.",
                            },
                            "free_dimensions": {
                                **_FREE_DIMENSIONS,
                                "description": "This model's free dimension values, "
                                "over the group's.",
                            },
                            "numerics": {
                                **NUMERICS,
                                "description": "This model's numerics settings, over the group's.",
                            },
                        },
                    },
                    "description": "Model paths relative to the manifest (globs "
                    "allowed), or tables { path, name, free_dimensions }.",
                },
                "providers": _PROVIDER_NAMES,
                "share_weights": {
                    "type": "boolean",
                    "description": "One weight-sharing session group per provider.",
                },
                "embed_mode": {
                    "type": "integer",
                    "enum": [0, 1],
                    "description": "0: separate context binary (default); 1: embedded.",
                },
                "node_name_prefix": {
                    "type": "string",
                    "description": "ep.context_node_name_prefix for EPContext node names.",
                },
                "external_initializers": {
                    "type": "string",
                    "minLength": 1,
                    "description": "File name for CPU-side initializers of ctx models.",
                },
                "load": {
                    "type": "string",
                    "enum": ["path", "bytes"],
                    "description": "Give models to ONNX Runtime by path (default) or bytes.",
                },
                "free_dimensions": _FREE_DIMENSIONS,
                "numerics": NUMERICS,
                "quantize": {
                    "type": "string",
                    "pattern": NAME_PATTERN,
                    "description": "A [quantization.*] table: the models are quantized "
                    "(QDQ) with it before they compile.",
                },
                **COMPILE_PROPERTIES,
            },
        ),
        "quantization": _named_tables(
            "Quantization recipes: calibration samples and types that make a group's "
            "float models QDQ models before they compile.",
            ["calibration"],
            QUANTIZATION,
        ),
        "llms": _named_tables(
            "LLM pipelines: an onnxruntime-genai model folder built into a "
            "static context + iterator pair per provider, packaged for genai.",
            ["source", "providers"],
            {
                "source": {
                    "type": "string",
                    "minLength": 1,
                    "description": "A genai model folder, relative to the manifest: "
                    "genai_config.json + ONNX (+ external data) + tokenizer files.",
                },
                "providers": _PROVIDER_NAMES,
                "context_length": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Static KV-cache length = the longest sequence "
                    "(default 1024, or the model's limit where lower).",
                },
                "window_size": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Prefill chunk length: the context graph's sequence, below "
                    "context_length (default 64, or half of context_length where that is 64 or "
                    "less).",
                },
                "share_weights": {
                    "type": "boolean",
                    "description": "One context binary for both graphs (N+1), as "
                    "devices want (default true).",
                },
                "parts": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Split the decoder at layer boundaries into this many "
                    "parts, each its own prompt + token graph (default 1); the embedding "
                    "runs on the CPU.",
                },
                "max_part_size": {
                    "type": "string",
                    "minLength": 1,
                    "description": "Split the decoder into as few parts as keep each part's "
                    'weights under this size (e.g. "1 GiB"); instead of parts.',
                },
                "prompt": {
                    "type": "string",
                    "minLength": 1,
                    "description": "The prompt 'verify --generate' generates from "
                    "(default a fixed sentence; --prompt wins).",
                },
                "quantize": {
                    "type": "string",
                    "pattern": NAME_PATTERN,
                    "description": "A [quantization.*] table whose calibration names text "
                    "prompts: the static graphs are calibrated on them and quantized (QDQ, "
                    "e.g. uint16 activations and uint8 weights: w8a16) before they compile.",
                },
            },
        ),
        "package": {
            "type": "object",
            "description": "Settings of 'epbuild package' (an ONNX Runtime model package).",
            "additionalProperties": False,
            "properties": {
                "out_dir": {
                    "type": "string",
                    "minLength": 1,
                    "description": "Package directory, relative to the manifest, when "
                    "'epbuild package' gets no -o.",
                },
                "name": {"type": "string", "description": "The package's package_name."},
                "version": {"type": "string", "description": "The package's package_version."},
                "description": {"type": "string", "description": "The package's description."},
                "compatibility_strings": {
                    "type": "boolean",
                    "description": "Give each variant its compatibility_string for the EP to "
                    "judge (default true; false lets a package be opened on hosts whose EP "
                    "crashes judging it: the QNN EP on x86_64).",
                },
                "devices": {
                    "type": "object",
                    "propertyNames": {"pattern": NAME_PATTERN},
                    "additionalProperties": {
                        "type": "string",
                        "enum": ["cpu", "gpu", "npu", "any"],
                    },
                    "description": "Per provider: the device type its variants require "
                    "(default: the provider's own; 'any' sets none).",
                },
                "ep_names": {
                    "type": "object",
                    "propertyNames": {"pattern": NAME_PATTERN},
                    "additionalProperties": {"type": "string", "pattern": EP_NAME_PATTERN},
                    "description": "Per provider: the EP name its variants declare, i.e. the "
                    "name the app registers the EP's plugin library under (default: the EP's "
                    "conventional name, e.g. QNNExecutionProvider).",
                },
            },
        },
    },
}

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


_NAME_HINT = (
    "use letters, digits, '_', '-' and '.', starting with a letter or digit, at most 64 characters"
)


class SchemaViolation(Exception):
    """One violation: the key path and a message."""

    def __init__(self, path: tuple[str, ...], message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.message = message
        self.hint = hint


def _type_ok(value: Any, types: str | list[str]) -> bool:
    for name in [types] if isinstance(types, str) else types:
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, _TYPES[name]):
            return True
    return False


_TYPE_NAMES: dict[type, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "a table",
}


def _describe(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _matches(pattern: str, value: str) -> bool:
    """JSON Schema's ``pattern`` (ECMA-262 semantics): a search, where ``$`` matches only at
    the very end. Python's ``$`` also matches before a final newline, which let a group
    named ``"main\\n"`` through."""
    import re

    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + "\\Z"
    return re.search(pattern, value) is not None


def validate(value: Any, schema: dict[str, Any] = SCHEMA, path: tuple[str, ...] = ()) -> None:
    """Raise ``SchemaViolation`` for the first place ``value`` breaks ``schema``."""

    if "type" in schema and not _type_ok(value, schema["type"]):
        wanted = schema["type"] if isinstance(schema["type"], str) else " or ".join(schema["type"])
        raise SchemaViolation(path, f"must be {wanted}, not {_describe(value)}")
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(json.dumps(c) for c in schema["enum"])
        raise SchemaViolation(path, f"{json.dumps(value)} is not allowed", f"use one of {choices}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise SchemaViolation(path, f"must be at least {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            raise SchemaViolation(path, f"must be at most {schema['maximum']}")
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        raise SchemaViolation(path, "must not be empty")
    if isinstance(value, str) and "pattern" in schema and not _matches(schema["pattern"], value):
        raise SchemaViolation(path, f"{json.dumps(value)} is not a valid name", _NAME_HINT)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise SchemaViolation(path, "must not be empty")
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), (*path, f"[{i}]"))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if schema.get("additionalProperties", True) is False:
            # Before "is required": a misspelt required key ("model") is the unknown one.
            for key in value:
                if key not in props:
                    raise SchemaViolation((*path, key), "unknown key", _known_keys(key, props))
        for req in schema.get("required", []):
            if req not in value:
                raise SchemaViolation((*path, req), "is required")
        pattern = schema.get("propertyNames", {}).get("pattern")
        for key, item in value.items():
            if pattern and not _matches(pattern, key):
                raise SchemaViolation((*path, key), "is not a valid name", _NAME_HINT)
            if key in props:
                validate(item, props[key], (*path, key))
                continue
            extra = schema.get("additionalProperties", True)
            if isinstance(extra, dict):
                validate(item, extra, (*path, key))


def _known_keys(key: str, props: dict[str, Any]) -> str | None:
    """The hint for an unknown ``key``: the known key it is closest to, then all of them."""
    import difflib  # only on this error path: the fast paths validate manifests too

    if not props:
        return None
    known = "known keys: " + ", ".join(props)
    close = difflib.get_close_matches(key, props, n=1, cutoff=0.75)
    return f"did you mean '{close[0]}'? {known}" if close else known


def schema_text() -> str:
    """The schema file's exact contents."""
    return json.dumps(SCHEMA, indent=2) + "\n"


SCHEMA_FILE = "epbuild.schema.json"
"""The schema's file name: in the repository's ``schemas/`` and, for a pip install, beside
this module (package data: ``epbuild schema`` prints it)."""


def shipped_schema() -> str:
    """The schema file installed with epbuild (``epbuild/manifest/epbuild.schema.json``)."""
    return (Path(__file__).resolve().parent / SCHEMA_FILE).read_text(encoding="utf-8")


def main() -> None:
    """Write (or with --check, compare) ``schemas/epbuild.schema.json`` and the copy the
    wheel ships (``epbuild/manifest/epbuild.schema.json``)."""
    here = Path(__file__).resolve()
    targets = [here.parents[2] / "schemas" / SCHEMA_FILE, here.parent / SCHEMA_FILE]
    if "--check" in sys.argv:
        fresh = all(t.is_file() and t.read_text() == schema_text() for t in targets)
        sys.exit(0 if fresh else 1)
    for target in targets:
        target.write_text(schema_text())


if __name__ == "__main__":
    main()
