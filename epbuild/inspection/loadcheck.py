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
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from epbuild._dataclass import replace
from epbuild.errors import EpbuildError, ModelError, ProviderUnavailableError
from epbuild.executors.worker import compiled_with
from epbuild.fs import os_error_text
from epbuild.providers.contract import ProviderConfig
from epbuild.runtime import open_models

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


def random_inputs(
    session: Any,
    seed: int = SEED,
    float_range: tuple[float, float] | None = None,
    int_range: tuple[int, int] = (0, 4),
) -> dict[str, Any]:
    """Deterministic random feeds for a session's inputs (symbolic dimensions become 1):
    floats standard normal (uniform in ``float_range`` when given), integers (token ids,
    indices) uniform in ``[int_range[0], int_range[1])``."""
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
            feeds[inp.name] = rng.integers(int_range[0], int_range[1], shape).astype(dtype)
        elif float_range is not None:
            feeds[inp.name] = rng.uniform(float_range[0], float_range[1], shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def compare(got: list[Any], want: list[Any]) -> float:
    """Largest absolute difference over all outputs, relative to the largest reference value."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} output(s), the source model {len(want)}")
    figures = [figures_of(a, b) for a, b in zip(got, want, strict=True)]
    return max((float(f["max_rel"] or 0.0) for f in figures), default=0.0)


def figures_of(got: Any, want: Any) -> dict[str, float | None]:
    """How far one output is from its reference: ``max_abs``; ``max_rel`` (relative to the
    largest reference magnitude: element-wise ratios explode where the reference is near 0);
    ``cosine`` of the flattened tensors; ``argmax``, the share of positions whose argmax
    over the last axis agrees (integer outputs and float outputs of rank ≥ 2 with a last
    axis of at least 2: logits-like), else None. A shape mismatch or a non-finite value
    where the reference is finite gives infinite errors."""
    import numpy as np

    a, b = np.asarray(got), np.asarray(want)
    integer = np.issubdtype(b.dtype, np.integer) or b.dtype == np.bool_
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if a64.shape != b64.shape:
        inf = float("inf")
        return {"max_abs": inf, "max_rel": inf, "cosine": -1.0, "argmax": 0.0}
    if not a64.size:
        return {"max_abs": 0.0, "max_rel": 0.0, "cosine": 1.0, "argmax": None}
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a64 - b64)
        diff[np.isnan(a64) & np.isnan(b64)] = 0.0
        diff[np.isnan(diff)] = np.inf
        max_abs = float(diff.max())
        scale = max(float(np.abs(b64[np.isfinite(b64)]).max(initial=0.0)), 1e-6)
        na, nb = float(np.linalg.norm(a64)), float(np.linalg.norm(b64))
        if not (np.isfinite(na) and np.isfinite(nb)):
            cosine = -1.0
        elif na == 0.0 or nb == 0.0:
            cosine = 1.0 if na == nb else 0.0
        else:
            cosine = float(np.dot(a64.ravel(), b64.ravel()) / (na * nb))
    argmax: float | None = None
    if integer:
        argmax = float(np.mean(a64 == b64))
    elif a64.ndim >= 2 and a64.shape[-1] >= 2:
        argmax = float(np.mean(np.argmax(a64, axis=-1) == np.argmax(b64, axis=-1)))
    return {"max_abs": max_abs, "max_rel": max_abs / scale, "cosine": cosine, "argmax": argmax}


def _worst(into: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The worse of two samples' figures for one output."""
    if not into:
        return dict(new)
    out = dict(into)
    out["max_abs"] = max(into["max_abs"], new["max_abs"])
    out["max_rel"] = max(into["max_rel"], new["max_rel"])
    out["cosine"] = min(into["cosine"], new["cosine"])
    if into["argmax"] is not None and new["argmax"] is not None:
        out["argmax"] = min(into["argmax"], new["argmax"])
    return out


def samples(session: Any, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The feeds to compare on, one at a time (a check holds one): one per ``.npz`` file
    the job names (each holds every input by name), else one seeded random feed."""
    import numpy as np

    files = job.get("inputs") or []
    if not files:
        low_high = job.get("float_range")
        yield random_inputs(
            session,
            int(job.get("seed", SEED)),
            tuple(low_high) if low_high else None,
            tuple(job.get("int_range", (0, 4))),
        )
        return
    wanted = {i.name: _NUMPY_TYPES.get(i.type) for i in session.get_inputs()}
    for path in files:
        with np.load(path, allow_pickle=False) as data:
            missing = sorted(set(wanted) - set(data.files))
            if missing:
                raise ValueError(f"{path} has no array named {missing[0]!r} (an input)")
            feed = {n: data[n].astype(t) if t else data[n] for n, t in wanted.items()}
        yield feed


def reference(ort: Any, job: dict[str, Any]) -> tuple[Any, list[str]]:
    """The source model in ORT's CPU EP (with the job's free-dimension overrides) and its
    output names: what a compiled model is compared with."""
    so = ort.SessionOptions()
    for dim, value in job.get("free_dimensions", {}).items():
        so.add_free_dimension_override_by_name(dim, value)
    try:
        cpu = ort.InferenceSession(job["source"], so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT's own types: a source changed since the build, most often
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(
            f"its source model {job['source']} does not load on the CPU EP ({first}); "
            "'epbuild status' says what changed since the build"
        ) from exc
    return cpu, [o.name for o in cpu.get_outputs()]


class Figures:
    """Each output's worst figures over the samples compared so far, and its figures over
    all of them: ``sqnr_db`` (signal to quantization noise of the whole set, in dB) and
    ``top1`` (the share of rows whose argmax agrees, for outputs shaped [batch, classes])."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.samples = 0
        self._worst: dict[str, dict[str, Any]] = {}
        self._energy: dict[str, list[float]] = {n: [0.0, 0.0, 0.0, 0.0] for n in names}
        """Per output: signal energy, noise energy, rows agreeing, rows."""

    def add(self, got: Sequence[Any], want: Sequence[Any]) -> None:
        """One sample: the compiled model's outputs and the source's, both in ``names``
        order."""
        import numpy as np

        self.samples += 1
        for name, a, b in zip(self.names, got, want, strict=True):
            self._worst[name] = _worst(self._worst.get(name, {}), figures_of(a, b))
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if a64.shape != b64.shape:
                continue
            sums = self._energy[name]
            with np.errstate(invalid="ignore", over="ignore"):
                sums[0] += float(np.sum(b64 * b64))
                sums[1] += float(np.sum((a64 - b64) ** 2))
            if b64.ndim == 2 and b64.shape[-1] >= 2:
                sums[2] += float(np.sum(np.argmax(a64, -1) == np.argmax(b64, -1)))
                sums[3] += b64.shape[0]

    def result(self) -> dict[str, Any]:
        """``outputs`` (each output's figures), ``max_error`` (the largest relative error of
        any) and ``samples``."""
        outputs = [{"name": n, **self._worst[n], **self._whole(n)} for n in self.names]
        err = max((o["max_rel"] for o in outputs), default=0.0)
        return {"max_error": err, "outputs": outputs, "samples": self.samples}

    def _whole(self, name: str) -> dict[str, Any]:
        signal, noise, agree, rows = self._energy[name]
        return {"sqnr_db": sqnr_db(signal, noise), "top1": agree / rows if rows else None}


def sqnr_db(signal: float, noise: float) -> float:
    """Signal to noise in dB (infinite for no noise; the noise alone counts if the signal
    is zero)."""
    import math

    if not math.isfinite(noise):
        return -math.inf
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-30) / noise)


def check(job: dict[str, Any]) -> dict[str, Any]:
    """Load the ctx model, run it and the source on the CPU EP on the same feeds, compare
    each output."""
    import onnxruntime as ort

    config = ProviderConfig.from_json(job["provider"])
    config = replace(config, session_options={**config.session_options, **NO_COMPILE})
    try:
        cpu, names = reference(ort, job)
        figures = Figures(names)
        with open_models([job["ctx"]], config) as built:
            for feed in samples(cpu, job):
                want = cpu.run(None, feed)
                got = built.run(built.names[0], feed)
                if len(got) != len(want):
                    return {
                        "outcome": "failed",
                        "message": f"the ctx model has {len(got)} output(s), its source "
                        f"model {len(want)}",
                    }
                figures.add(got, want)
    except ProviderUnavailableError as exc:
        return {"outcome": "not_loadable_here", "message": exc.message}
    except EpbuildError as exc:
        return {"outcome": "failed", "message": _explain(exc.message)}
    result = figures.result()
    err = result["max_error"]
    if err > RTOL:
        return {
            **result,
            "outcome": "failed",
            "message": f"outputs differ from the CPU EP by {err:.3g} (relative; allowed {RTOL:g})",
        }
    return {**result, "outcome": "passed", "message": ""}


def _explain(message: str) -> str:
    if "MODEL_REQUIRES_COMPILATION" in message:
        return (
            f"{message.split(':')[0]}: the EP would compile nodes of it at load, so it is not "
            "a complete ctx model for this EP (loaded with session.disable_model_compile=1)"
        )
    return message


def answer(
    check: Callable[[dict[str, Any]], dict[str, Any]], plain: tuple[type[Exception], ...] = ()
) -> None:
    """A loader subprocess's entry point: one JSON job on stdin, ``check``'s result as one
    JSON line on stdout. An exception is a failure: its type and first line, or (``plain``
    exceptions, epbuild's own) its text alone."""
    job = json.loads(sys.stdin.read())
    try:
        result = check(job)
    except plain as exc:
        result = {"outcome": "failed", "message": f"{exc}"}
    except EpbuildError as exc:  # says what it is (a source model that does not load)
        result = {"outcome": "failed", "message": exc.message}
    except OSError as exc:  # a file gone or unreadable: named from the workspace (the cwd)
        result = {"outcome": "failed", "message": os_error_text(exc, os.getcwd())}
    except Exception as exc:
        result = {"outcome": "failed", "message": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    try:  # what it ran with, as an action key names them (a check action's result)
        result["versions"] = compiled_with(ProviderConfig.from_json(job["provider"]))
    except Exception:  # the figures stand without it (a --load check)
        pass
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Entry point."""
    answer(check)


if __name__ == "__main__":
    main()
