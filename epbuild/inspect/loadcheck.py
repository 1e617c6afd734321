"""``verify --load``'s subprocess: run one ctx model and its source model on the CPU EP.

Run from the workspace root (which is not on its import path) with one JSON job on stdin
(``ctx``, ``source``, ``provider``, and ``free_dimensions`` the source runs with). Prints
one JSON line: ``outcome`` (``passed``, ``failed``, ``not_loadable_here``), ``message`` and
``max_error``. A native crash ends the process; the parent reports it.

The session gets ``session.disable_model_compile=1``: a ctx model the EP would compile (in
part) at load is a failure, not a pass. (The QNN EP compiles nothing of a model that holds
an EPContext node, so for it this bites only on a model without one; other EPs differ.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

NO_COMPILE = {"session.disable_model_compile": "1"}
"""Session config entries of the loaded ctx model: ORT refuses to compile any node."""
SEED = 20240601
RTOL = 2e-2
"""Allowed error relative to the largest reference magnitude: contexts compute in fp16."""

_NUMPY_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


def random_inputs(session: Any, seed: int = SEED) -> dict[str, Any]:
    """Deterministic random feeds for a session's inputs (symbolic dimensions become 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds: dict[str, Any] = {}
    for inp in session.get_inputs():
        dtype = _NUMPY_TYPES.get(inp.type)
        if dtype is None:
            raise ValueError(f"input {inp.name} has type {inp.type}, which this check cannot feed")
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape]
        if dtype == "bool":
            feeds[inp.name] = rng.integers(0, 2, shape).astype(bool)
        elif dtype.startswith(("int", "uint")):
            feeds[inp.name] = rng.integers(0, 4, shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def compare(got: list[Any], want: list[Any]) -> float:
    """Largest absolute difference over all outputs, relative to the largest reference value."""
    import numpy as np

    if len(got) != len(want):
        raise ValueError(f"{len(got)} output(s), the source model {len(want)}")
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a64.shape != b64.shape:
            return float("inf")
        if not a64.size:
            continue
        scale = max(float(np.abs(b64).max()), 1e-6)
        worst = max(worst, float(np.abs(a64 - b64).max()) / scale)
    return worst


def check(job: dict[str, Any]) -> dict[str, Any]:
    """Load the ctx model, run it and the source on the CPU EP, compare."""
    import onnxruntime as ort

    from epbuild.errors import EpbuildError, ProviderUnavailableError
    from epbuild.providers.base import ProviderConfig
    from epbuild.runtime import open_models

    config = ProviderConfig.from_json(job["provider"])
    config = replace(config, session_options={**config.session_options, **NO_COMPILE})
    so = ort.SessionOptions()
    for dim, value in job.get("free_dimensions", {}).items():
        so.add_free_dimension_override_by_name(dim, value)
    cpu = ort.InferenceSession(job["source"], so, providers=["CPUExecutionProvider"])
    feeds = random_inputs(cpu)
    want = cpu.run(None, feeds)
    try:
        with open_models([job["ctx"]], config) as built:
            got = built.run(built.names[0], feeds)
    except ProviderUnavailableError as exc:
        return {"outcome": "not_loadable_here", "message": exc.message}
    except EpbuildError as exc:
        return {"outcome": "failed", "message": _explain(exc.message)}
    if len(got) != len(want):
        return {
            "outcome": "failed",
            "message": f"the ctx model has {len(got)} output(s), its source model {len(want)}",
        }
    err = compare(got, want)
    if err > RTOL:
        return {
            "outcome": "failed",
            "max_error": err,
            "message": f"outputs differ from the CPU EP by {err:.3g} (relative; allowed {RTOL:g})",
        }
    return {"outcome": "passed", "max_error": err, "message": ""}


def _explain(message: str) -> str:
    if "MODEL_REQUIRES_COMPILATION" in message:
        return (
            f"{message.split(':')[0]}: the EP would compile nodes of it at load, so it is not "
            "a complete ctx model for this EP (loaded with session.disable_model_compile=1)"
        )
    return message


def main() -> None:
    """Entry point."""
    job = json.loads(sys.stdin.read())
    try:
        result = check(job)
    except Exception as exc:
        result = {"outcome": "failed", "message": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
