"""Child process of ``epbuild.llm.prepare``: reads one JSON line (model, out, window,
context, head_size), writes ``context.onnx`` and ``iterator.onnx`` (+ external data) into
``out``. Exits non-zero with the reason on stderr."""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import onnx

    from epbuild.llm.prepare import STAGES
    from epbuild.llm.static import StaticPrepError, StaticShape, make_static

    args = json.loads(sys.stdin.read())
    model = onnx.load(args["model"])
    for stage, sequence in STAGES:
        shape = StaticShape(sequence or args["window"], args["context"], args["head_size"])
        try:
            static = make_static(model, shape)
        except StaticPrepError as exc:
            print(exc, file=sys.stderr)
            return 1
        onnx.save(
            static,
            os.path.join(args["out"], f"{stage}.onnx"),
            save_as_external_data=True,
            location=f"{stage}.onnx.data",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
