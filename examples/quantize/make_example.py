"""Make the quantization example: a small image classifier trained here on pictures this
script draws, and its calibration and validation samples. Deterministic (fixed seeds);
needs only numpy, onnx and onnxruntime, which epbuild installs.

    python make_example.py        # models/classifier.onnx, calib/*.npz, val/*.npz

The four classes are textures with noise: horizontal stripes, vertical stripes, a
checkerboard and a bright blob. The network is Conv-Relu-Conv-Relu-GlobalAveragePool-
Flatten-Gemm (3x32x32 in, 4 logits out, opset 17): the convolutions keep fixed random
filters and the classifier head is trained with softmax regression on their features.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).parent
CLASSES = ("horizontal", "vertical", "checkerboard", "blob")
SIZE = 32


def picture(kind: int, rng: np.random.Generator) -> np.ndarray:
    """One 3x32x32 picture of class ``kind``, with random phase, period, colour and noise."""
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    period = rng.uniform(4.0, 9.0)
    phase = rng.uniform(0, 2 * np.pi)
    if kind == 0:
        base = np.sin(2 * np.pi * y / period + phase)
    elif kind == 1:
        base = np.sin(2 * np.pi * x / period + phase)
    elif kind == 2:
        base = np.sin(2 * np.pi * x / period + phase) * np.sin(2 * np.pi * y / period + phase)
    else:
        cy, cx = rng.uniform(8, 24, size=2)
        base = 2 * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * rng.uniform(3, 6) ** 2)) - 1
    colour = rng.uniform(0.5, 1.0, size=(3, 1, 1)).astype(np.float32)
    noise = rng.normal(0, 0.3, size=(3, SIZE, SIZE)).astype(np.float32)
    return (colour * base[None] + noise).astype(np.float32)


def dataset(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASSES), size=n)
    return np.stack([picture(int(k), rng) for k in labels]), labels


def network(head_w: np.ndarray, head_b: np.ndarray, rng: np.random.Generator) -> onnx.ModelProto:
    """The classifier, its convolutions' filters drawn from ``rng`` (the same for the
    feature extractor and the final model: call with a generator in the same state)."""
    w1 = rng.normal(0, 0.4, size=(16, 3, 3, 3)).astype(np.float32)
    w2 = rng.normal(0, 0.15, size=(32, 16, 3, 3)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w1, "conv1.weight"),
        numpy_helper.from_array(np.zeros(16, np.float32), "conv1.bias"),
        numpy_helper.from_array(w2, "conv2.weight"),
        numpy_helper.from_array(np.zeros(32, np.float32), "conv2.bias"),
        numpy_helper.from_array(head_w.astype(np.float32), "head.weight"),
        numpy_helper.from_array(head_b.astype(np.float32), "head.bias"),
    ]
    nodes = [
        helper.make_node(
            "Conv",
            ["image", "conv1.weight", "conv1.bias"],
            ["c1"],
            name="/conv1/Conv",
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", ["c1"], ["r1"], name="/relu1/Relu"),
        helper.make_node(
            "Conv",
            ["r1", "conv2.weight", "conv2.bias"],
            ["c2"],
            name="/conv2/Conv",
            pads=[1, 1, 1, 1],
            strides=[2, 2],
        ),
        helper.make_node("Relu", ["c2"], ["r2"], name="/relu2/Relu"),
        helper.make_node("GlobalAveragePool", ["r2"], ["pool"], name="/pool/GlobalAveragePool"),
        helper.make_node("Flatten", ["pool"], ["features"], name="/Flatten"),
        helper.make_node(
            "Gemm",
            ["features", "head.weight", "head.bias"],
            ["logits"],
            name="/head/Gemm",
            transB=1,
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, len(CLASSES)])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    model.producer_name = "epbuild examples/quantize"
    return model


def features(model: onnx.ModelProto, images: np.ndarray) -> np.ndarray:
    """The pooled features of each image (the model run up to its head, in ONNX Runtime)."""
    import onnxruntime as ort

    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output[0].CopyFrom(
        helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 32])
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(["features"], {"image": im[None]})[0] for im in images])


def predict(path: Path, images: np.ndarray) -> np.ndarray:
    """The class the saved model gives each image (the whole file run, as shipped)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.array([session.run(None, {"image": im[None]})[0].argmax() for im in images])


def train(x: np.ndarray, labels: np.ndarray, steps: int = 600) -> tuple[np.ndarray, np.ndarray]:
    """Softmax regression by gradient descent on standardised features, folded back into
    one weight matrix and bias over the raw features."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / std
    w = np.zeros((len(CLASSES), x.shape[1]))
    b = np.zeros(len(CLASSES))
    onehot = np.eye(len(CLASSES))[labels]
    for _ in range(steps):
        logits = z @ w.T + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        grad = (p - onehot) / len(z)
        w -= 0.5 * (grad.T @ z + 1e-3 * w)
        b -= 0.5 * grad.sum(0)
    return w / std, b - (w / std) @ mean


def main() -> None:
    images, labels = dataset(600, seed=1)
    model = network(np.zeros((len(CLASSES), 32)), np.zeros(len(CLASSES)), np.random.default_rng(0))
    w, b = train(features(model, images), labels)
    model = network(w, b, np.random.default_rng(0))
    (HERE / "models").mkdir(exist_ok=True)
    onnx.save(model, HERE / "models" / "classifier.onnx")
    test, truth = dataset(200, seed=2)
    accuracy = float(np.mean(predict(HERE / "models" / "classifier.onnx", test) == truth))
    for folder, seed, n in (("calib", 3, 32), ("val", 4, 32)):
        (HERE / folder).mkdir(exist_ok=True)
        pictures, _ = dataset(n, seed)
        for i, p in enumerate(pictures):
            np.savez(HERE / folder / f"sample_{i:03d}.npz", image=p[None])
    print(f"models/classifier.onnx: {accuracy:.1%} accuracy on 200 new pictures (float)")
    print("calib/: 32 calibration samples; val/: 32 validation samples")


if __name__ == "__main__":
    main()
