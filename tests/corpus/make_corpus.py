"""Regenerate the exporter corpus (committed; CI never runs this, it needs torch).

Tiny random-weight models made by ordinary exporters, so that the build rules are tested on
what exporters really write, not only on ``onnx.helper`` graphs:

- ``bert_torchscript.onnx``: a BERT from a ``transformers`` config, ``torch.onnx.export``
  with the TorchScript exporter (``dynamo=False``), symbolic ``batch``/``sequence_length``;
- ``bert_unnamed.onnx``: the same graph with every node name removed (as many converters
  and ``onnx.helper`` graphs have), so ONNX Runtime names its fused nodes ``/...Fusion``;
- ``llama_torchscript.onnx``: a Llama, TorchScript exporter, symbolic dims;
- ``gpt2_dynamo.onnx``: a GPT-2, ``dynamo=True``, symbolic dims;
- ``llama_dynamo_external.onnx`` + ``.onnx.data``: a Llama, ``dynamo=True``, external data;
- ``mlp_unnamed.onnx``: ``onnx.helper`` MLP, unnamed ``MatMul`` + ``Add`` of a bias, input
  ``[1, 256]`` (the case ONNX Runtime fuses into a ``Gemm`` named ``/MatMulAddFusion``);
- ``cnn_torchscript.onnx``: a small CNN (fixed ``[1, 3, 32, 32]``), TorchScript exporter;
- ``cnn_qdq.onnx``: that CNN quantized to QDQ (uint8 activations and weights) with
  ``onnxruntime.quantization`` and its QNN helpers (``qnn_preprocess_model``,
  ``get_qnn_qdq_config``), calibrated on random data.

No hub download: every model is built from a config with random weights (seeded). Run it in
a separate environment (``torch`` CPU, ``transformers``, ``onnx``, ``onnxruntime``,
``onnxscript``):

    venv="$(mktemp -d)/corpus-venv" && python3 -m venv "$venv"
    "$venv"/bin/pip install torch transformers onnx onnxruntime onnxscript
    "$venv"/bin/python tests/corpus/make_corpus.py

It rewrites the models and ``versions.json`` (the versions that made them) beside itself.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VOCAB = 128
HIDDEN = 32
LAYERS = 2
HEADS = 2
SEQ = 8


def _torch() -> Any:
    import torch

    torch.manual_seed(0)
    return torch


def _outputs(model: Any) -> Any:
    """``input_ids, attention_mask → logits`` (a causal LM, no cache) or the last hidden
    state (an encoder): plain tensors, as the exporters want."""
    torch = _torch()

    class Wrapped(torch.nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            kwargs = {"use_cache": False} if hasattr(model, "lm_head") else {}
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            return out.logits if hasattr(out, "logits") else out.last_hidden_state

    return Wrapped().eval()


def bert() -> Any:
    from transformers import BertConfig, BertModel

    _torch()
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=2 * HIDDEN, max_position_embeddings=64,
        attn_implementation="eager",
    )  # fmt: skip
    return _outputs(BertModel(config).eval())


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    _torch()
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    return _outputs(LlamaForCausalLM(config).eval())


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    _torch()
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
        attn_implementation="eager",
    )  # fmt: skip
    return _outputs(GPT2LMHeadModel(config).eval())


def _text_inputs() -> tuple[Any, Any]:
    torch = _torch()
    ids = torch.randint(0, VOCAB, (1, SEQ), dtype=torch.int64)
    return ids, torch.ones((1, SEQ), dtype=torch.int64)


def export_torchscript(model: Any, path: Path) -> None:
    """The TorchScript exporter, symbolic ``batch``/``sequence_length``."""
    torch = _torch()
    axes = {0: "batch", 1: "sequence_length"}
    torch.onnx.export(
        model, _text_inputs(), str(path), dynamo=False, opset_version=17,
        input_names=["input_ids", "attention_mask"], output_names=["output"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "output": axes},
    )  # fmt: skip


def export_dynamo(model: Any, path: Path, *, external: bool) -> None:
    """``dynamo=True``, symbolic ``batch``/``sequence_length``; optionally external data."""
    torch = _torch()
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("sequence_length", max=64)
    dims = {0: batch, 1: seq}
    program = torch.onnx.export(
        model, _text_inputs(), dynamo=True, input_names=["input_ids", "attention_mask"],
        output_names=["output"], dynamic_shapes={"input_ids": dims, "attention_mask": dims},
    )  # fmt: skip
    program.save(str(path), external_data=external)


def neutral_paths(path: Path) -> None:
    """Replace the directories of the machine that made the corpus in every text of the
    model at ``path`` (the dynamo exporter writes stack traces into node ``metadata_props``)
    with those of a made-up ``/srv/exporter-host`` machine: the committed files name no real
    machine, and still hold absolute paths as an exporter's do."""
    import onnx

    swaps = [
        (str(HERE.parent.parent), "/srv/exporter-host/epbuild"),
        (os.path.realpath(sys.prefix), "/srv/exporter-host/venv"),
        (sys.prefix, "/srv/exporter-host/venv"),
        (os.path.realpath(sys.base_prefix), "/usr/local"),
        (sys.base_prefix, "/usr/local"),
    ]

    def neutral(text: str) -> str:
        for real, made_up in swaps:
            text = text.replace(real, made_up)
        return text

    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        node.doc_string = neutral(node.doc_string)
        for prop in node.metadata_props:
            prop.value = neutral(prop.value)
    model.doc_string = neutral(model.doc_string)
    for prop in model.metadata_props:
        prop.value = neutral(prop.value)
    onnx.save(model, str(path))


def unnamed(source: Path, path: Path) -> None:
    """``source`` with every node name removed."""
    import onnx

    model = onnx.load(str(source))
    for node in model.graph.node:
        node.name = ""
    onnx.save(model, str(path))


def mlp_unnamed(path: Path) -> None:
    """Unnamed ``MatMul → Add(bias) → Relu → MatMul → Add(bias)``, input ``[1, 256]``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = {
        "W1": rng.standard_normal((256, 64), dtype=np.float32) * 0.1,
        "B1": rng.standard_normal((64,), dtype=np.float32) * 0.1,
        "W2": rng.standard_normal((64, 16), dtype=np.float32) * 0.1,
        "B2": rng.standard_normal((16,), dtype=np.float32) * 0.1,
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "B1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "B2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))


def cnn() -> Any:
    torch = _torch()
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()  # fmt: skip


def export_cnn(path: Path) -> None:
    torch = _torch()
    torch.onnx.export(
        cnn(), (torch.randn(1, 3, 32, 32),), str(path), dynamo=False, opset_version=17,
        input_names=["image"], output_names=["scores"],
    )  # fmt: skip


def quantize_qdq(source: Path, path: Path) -> None:
    """QDQ for the QNN EP with ``onnxruntime.quantization``'s QNN helpers."""
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import (
        get_qnn_qdq_config,
        qnn_preprocess_model,
    )

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.data = iter(
                [{"image": rng.standard_normal((1, 3, 32, 32), dtype=np.float32)}
                 for _ in range(8)]
            )  # fmt: skip

        def get_next(self) -> dict[str, Any] | None:
            return next(self.data, None)

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        changed = qnn_preprocess_model(str(source), str(pre))
        model = str(pre if changed else source)
        config = get_qnn_qdq_config(
            model, Reader(), activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8
        )
        quantize(model, str(path), config)


def versions() -> dict[str, str]:
    names = ["torch", "transformers", "onnx", "onnxruntime", "onnxscript", "numpy"]
    found = {name: version(name) for name in names}
    return {"python": platform.python_version(), **found}


def main() -> int:
    steps: list[tuple[str, Callable[[Path], None]]] = [
        ("bert_torchscript.onnx", lambda p: export_torchscript(bert(), p)),
        ("bert_unnamed.onnx", lambda p: unnamed(HERE / "bert_torchscript.onnx", p)),
        ("llama_torchscript.onnx", lambda p: export_torchscript(llama(), p)),
        ("gpt2_dynamo.onnx", lambda p: export_dynamo(gpt2(), p, external=False)),
        ("llama_dynamo_external.onnx", lambda p: export_dynamo(llama(), p, external=True)),
        ("mlp_unnamed.onnx", mlp_unnamed),
        ("cnn_torchscript.onnx", export_cnn),
        ("cnn_qdq.onnx", lambda p: quantize_qdq(HERE / "cnn_torchscript.onnx", p)),
    ]
    only = set(sys.argv[1:])
    for name, make in steps:
        if only and name not in only:
            continue
        print(f"making {name}", flush=True)
        make(HERE / name)
        neutral_paths(HERE / name)
    doc = {"versions": versions(), "made_by": "tests/corpus/make_corpus.py"}
    (HERE / "versions.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    total = sum(f.stat().st_size for f in HERE.iterdir() if f.name.endswith((".onnx", ".data")))
    print(f"corpus: {total / 1e6:.2f} MB", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
